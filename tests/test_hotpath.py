"""The hot-path check: planted defects found at their lines, nothing on a clean twin or
in the tuner's own loop."""

import re
from pathlib import Path

import pytest
import torch

from tuner.hotpath import FIX, Sites, UserCode, _Calls, _copy_target, check
from tuner.loop import Trainer
from tuner.tables import hot_path_lines, search_hot_path_lines
from tuner.trial import make_request, resolve_config

PLANTED = Path(__file__).parent / "fixtures" / "hotpath_planted.py"
COMPILE_KINDS = {"graph_break", "recompile"}


def planted() -> dict[tuple[int, str], str]:
    """(line, kind) of every defect marked in the fixture (the marks, not line numbers
    written here, say where they are)."""
    out = {}
    for n, line in enumerate(PLANTED.read_text().splitlines(), 1):
        m = re.search(r"  # defect: ([a-z_, ]+)$", line)
        for kind in (m.group(1).split(", ") if m else []):
            out[(n, kind)] = line.strip()
    return out


def run_check(clean: bool, compile: str = "off", baseline: bool = False, rnn: bool = False, **config) -> dict:
    req = make_request(workload=f"{PLANTED}:make", workload_args={"clean": clean, "rnn": rnn}, device="cpu",
                       config={"compile": compile, "micro_batch_size": 8, **config})
    resolved, _, workload, device = resolve_config(req)
    trainer = Trainer(workload, resolved, device, baseline=baseline)
    return check(trainer, UserCode.of_workload(req.workload), steps=5, warm=3)


def found(result: dict) -> set[tuple[int, str]]:
    kinds = {"sync": "sync", "branch": "branch", "dynamic_size": "dynamic_size"}
    out = set()
    for f in result["findings"]:
        path, line = f["where"].rsplit(":", 1)
        assert Path(path).resolve() == PLANTED.resolve(), f  # only the workload's own file
        out.add((int(line), kinds.get(f["kind"], f["kind"])))
    return out


def test_every_planted_defect_is_named_at_its_line_and_the_clean_twin_has_none():
    expected = {k for k in planted() if k[1] not in COMPILE_KINDS}
    result = run_check(clean=False)
    assert found(result) == expected
    for f in result["findings"]:
        assert f["fix"] == FIX[f["kind"]] and f["per_step"] >= 1, f
    # the comprehension runs once per item of the batch: three per step
    assert next(f for f in result["findings"] if f["kind"] == "isinstance")["per_step"] == 3
    # a measured cost is put beside the step it is part of (the check's own eager steps)
    lines = hot_path_lines(result)
    assert result["step_ms"] > 0
    assert any("torch.ones" in ln and "of an eager step" in ln for ln in lines), lines
    clean = run_check(clean=True)
    assert clean["findings"] == [] and "no hot-path defects found" in "\n".join(hot_path_lines(clean))
    # a constant that torch's own module builds inside the call (a GRU's zero initial state)
    # has no line of the user's to move; one that a torch function the line calls returns has
    assert run_check(clean=True, rnn=True)["findings"] == []


def test_the_tuners_own_loop_is_never_blamed():
    # the baseline's loop reads loss.item() every step (tuner/loop.py): not the user's line
    result = run_check(clean=True, baseline=True, grad_accum_steps=2)
    assert result["findings"] == []


@pytest.mark.slow
@pytest.mark.parametrize("inside", [False, True])
def test_anomaly_detection_left_on_is_named_at_the_line_that_turns_it_on(inside):
    from tests.helpers import ref

    source = Path(__file__).with_name("fixture_workloads.py")
    line = next(n for n, text in enumerate(source.read_text().splitlines(), 1)
                if ("detect_anomaly():" if inside else "set_detect_anomaly(True)") in text)
    req = make_request(workload=ref("anomalous"), workload_args={"inside": inside}, device="cpu",
                       config={"micro_batch_size": 8})
    resolved, _, workload, device = resolve_config(req)
    try:
        result = check(Trainer(workload, resolved, device), UserCode.of_workload(req.workload), steps=5, warm=3)
        assert torch.is_anomaly_enabled() != inside  # the check leaves it as it found it
    finally:
        torch.autograd.set_detect_anomaly(False)
    [f] = [f for f in result["findings"] if f["kind"] == "anomaly"]
    assert f["where"].endswith(f"fixture_workloads.py:{line}") and f["function"] == ("loss" if inside else "model")
    assert f["fix"] == FIX["anomaly"]
    # on for the process, it is timed off; turned on in the step, it cannot be
    assert (f["cost_ms_per_step"] is None) == inside and (inside or f["cost_ms_per_step"] >= 0)


@pytest.mark.parametrize("how", ["with", "decorator"])
def test_an_autocast_the_step_turns_on_itself_is_named_and_the_knob_s_own_is_not(how):
    """Inside the workload's own autocast the precision knob has no effect: named at the
    ``with`` line or at the decorated function. An autocast turned off in the step, and the
    knob's own (precision=bf16), are no finding."""
    from tests.helpers import ref

    source = Path(__file__).with_name("fixture_workloads.py")
    line = next(n for n, text in enumerate(source.read_text().splitlines(), 1) if f"# own autocast: {how}" in text)

    def autocast_findings(how: str, precision: str) -> list[dict]:
        req = make_request(workload=ref("own_autocast"), workload_args={"how": how}, device="cpu",
                           config={"micro_batch_size": 8, "precision": precision})
        resolved, _, workload, device = resolve_config(req)
        result = check(Trainer(workload, resolved, device), UserCode.of_workload(req.workload), steps=5, warm=3)
        return [f for f in result["findings"] if f["kind"] == "autocast"]

    [f] = autocast_findings(how, "fp32")
    assert f["where"].endswith(f"fixture_workloads.py:{line}"), f
    assert f["function"] == ("loss" if how == "with" else "forward") and f["per_step"] == 1
    assert "bfloat16" in f["what"] and f["cost_ms_per_step"] is None and f["fix"] == FIX["autocast"]
    assert autocast_findings("off", "bf16") == []


def test_graph_breaks_and_recompiles_under_compile_are_named_at_their_lines():
    result = run_check(clean=False, compile="default")
    assert found(result) == set(planted())
    recompile = next(f for f in result["findings"] if f["kind"] == "recompile")
    assert recompile["per_step"] > 0 and "self.keep" in recompile["what"]
    assert run_check(clean=True, compile="default")["findings"] == []


@pytest.mark.slow
def test_a_graph_break_dynamo_records_as_a_bare_code_is_named_in_words(capfd):
    """A break dynamo cannot resume from (a GRU after a random op) is listed as
    ``step_unsupported``; what it met and its hint are in dynamo's graph-break log, which
    the check reads at the same line, and does not print."""
    [finding] = run_check(clean=True, rnn=True, compile="default")["findings"]
    line = next(n for n, text in enumerate(PLANTED.read_text().splitlines(), 1) if "= self.rnn(h)" in text)
    assert finding["kind"] == "graph_break" and finding["where"].endswith(f":{line}"), finding
    assert "GRU" in finding["what"] and "allow_rnn" in finding["what"], finding
    assert "Graph break" not in capfd.readouterr().err


def test_copies_to_a_gpu_are_classified_by_pinning_and_blocking():
    # No CUDA here: only the classification of a call is tested (the copy itself is not
    # run); on a CPU-only build every host tensor reads as not pinned.
    assert _copy_target("to", (torch.ones(1), "cuda:0"), {}) == (torch.device("cuda:0"), False)
    assert _copy_target("to", (torch.ones(1),), {"device": "cuda", "non_blocking": True}) == \
        (torch.device("cuda"), True)
    assert _copy_target("to", (torch.ones(1), torch.float16), {})[0] is None
    calls = _Calls(Sites(UserCode()), on_gpu=True)
    assert calls._kind("to", (torch.ones(1), "cuda"), {})[0] == "unpinned_copy"
    assert calls._kind("to", (torch.ones(1), "cpu"), {}) is None
    assert _Calls(Sites(UserCode()), on_gpu=False)._kind("to", (torch.ones(1), "cuda"), {}) is None


def test_user_code_is_the_workloads_folder_not_installed_packages(tmp_path):
    wl = tmp_path / "proj" / "wl.py"
    wl.parent.mkdir()
    wl.write_text("")
    user = UserCode.of_file(wl)
    assert user.owns(str(tmp_path / "proj" / "model" / "net.py"))
    assert not user.owns(str(tmp_path / "elsewhere.py"))
    assert not user.owns(torch.__file__)
    builtin = UserCode.of_workload("conv")  # a built-in: its own file only, not the tuner's loop
    assert builtin.owns(str(Path(__file__).parents[1] / "tuner" / "workloads" / "builtin.py"))
    assert not builtin.owns(str(Path(__file__).parents[1] / "tuner" / "loop.py"))


def test_a_search_prints_the_picks_findings_and_those_only_the_baseline_has():
    finding = {"kind": "sync", "where": "m.py:3", "function": "loss", "what": ".item()", "per_step": 1.0,
               "cost_ms_per_step": None, "cost": "count only", "fix": FIX["sync"]}
    other = {**finding, "kind": "hasattr", "where": "m.py:9", "what": "hasattr()"}
    pick = {"findings": [finding], "steps": 5, "device": "cpu", "compile": "default"}
    lines = search_hot_path_lines({"pick": pick, "baseline": {**pick, "findings": [finding, other]}})
    assert sum("m.py:3" in ln for ln in lines) == 1 and any("m.py:9" in ln for ln in lines)
    assert search_hot_path_lines({"error": "the time budget was spent"}) == \
        ["hot path: not checked (the time budget was spent)"]


def test_a_measured_cost_is_said_as_its_share_of_the_step_and_a_count_is_not():
    invariant = {"kind": "invariant", "where": "m.py:5", "function": "forward", "what": "torch.full(...)",
                 "per_step": 1.0, "cost_ms_per_step": 0.031, "cost": "0.031 ms per step", "fix": FIX["invariant"]}
    sync = {**invariant, "kind": "sync", "where": "m.py:7", "cost_ms_per_step": None, "cost": "count only"}
    lines = hot_path_lines({"findings": [invariant, sync], "steps": 5, "step_ms": 1560.0, "device": "cpu"})
    assert "under 0.1% of an eager step (1,560.0 ms)" in lines[1] and "of an eager step" not in lines[3]
    lines = hot_path_lines({"findings": [{**invariant, "cost_ms_per_step": 2.0}], "steps": 5, "step_ms": 8.0})
    assert ": 25% of an eager step (8.0 ms)" in lines[1]
    # a result written before the step was timed prints as it did
    assert "of an eager step" not in "\n".join(hot_path_lines({"findings": [invariant], "steps": 5}))


def test_a_library_file_is_named_by_its_package_not_its_folder():
    """site-packages lies inside the standard library's folder: a file there is named by its
    package (``yaml``), never as "site-packages", whichever order the folders came in (a
    Ray job's process read "site-packages: bool(tensor)" where a local run read
    "transformers: ...")."""
    import os

    import yaml

    from tuner.hotpath import LIBRARY_DIRS, _owner

    for i, outer in enumerate(LIBRARY_DIRS):
        assert not any(inner.startswith(outer + os.sep) for inner in LIBRARY_DIRS[i + 1:]), LIBRARY_DIRS
    assert _owner(yaml.__file__) == "yaml"
