"""``tuner init``: the batch probe and the written space file."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ref
from tuner import spec
from tuner.scaffold import (
    BF16_SLOWER,
    PROBE_MEASURE,
    Probe,
    batch_values,
    bf16_probe_size,
    bf16_verdict,
    knob_lines,
    probe_batch,
)
from tuner.trial import make_request, run_isolated


def test_probe_grows_then_bisects_to_the_largest_that_fits():
    # 10 MB per sample against a 300 MB cap: 30 fits, 32 does not (the probe's logic
    # alone, on a known memory curve). Sizes grow 4x while four times a size's peak is
    # under half the cap (1: 40 MB), then double (4: 160 MB).
    seen = []

    def measure(b):
        seen.append(b)
        return {"status": "ok", "peak_host_memory_mb": 10.0 * b, "step_time_ms": 1.0}

    fit = probe_batch(measure, device="cpu", max_memory_mb=300, max_step_s=1.0)
    assert seen[:5] == [1, 4, 8, 16, 32]
    assert 28 <= fit.largest <= 30 and fit.largest * 10 <= 300
    assert fit.first_too_big.batch * 10 > 300 and fit.first_too_big.batch - fit.largest <= max(1, fit.largest // 8)


def test_probe_grows_4x_only_while_the_step_and_the_peak_stay_far_under_their_limits():
    """The step bounds the growth as the peak does: 4x while four times a size's step
    is under half ``max_step_s``; on a GPU without a memory cap (nothing to scale the
    peak against), 2x."""
    seen: list[int] = []

    def measure(b):
        seen.append(b)
        return {"status": "ok", "peak_device_memory_mb": 1.0, "peak_host_memory_mb": 1.0, "step_time_ms": 2.0 * b}

    fit = probe_batch(measure, device="cpu", max_memory_mb=None, max_step_s=1.0)
    # 64: four times its 128 ms step is over 500 ms; 512 is the first over 1 s
    assert seen[:6] == [1, 4, 16, 64, 128, 256] and seen[6] == 512 and fit.largest >= 448, seen
    seen.clear()
    probe_batch(measure, device="cuda", max_memory_mb=None, max_step_s=1.0)
    assert seen[:4] == [1, 2, 4, 8], seen


def test_probe_treats_a_failed_or_slow_step_as_not_fitting():
    fit = probe_batch(lambda b: {"status": "infeasible", "reason": "out of memory"} if b >= 64
                      else {"status": "ok", "peak_host_memory_mb": 1.0, "step_time_ms": b * 10.0},
                      device="cpu", max_memory_mb=None, max_step_s=0.5)
    assert fit.largest < 64 and fit.largest * 10 <= 500  # slower than 0.5 s above 50
    assert "step" in fit.first_too_big.why


def test_a_step_over_the_limit_that_its_smaller_neighbour_puts_under_it_is_probed_again():
    """One window of a large batch holds a step or two: a step read twice as long as its
    size's (here once, at 48) is probed again and the faster reading kept, where the size
    below it, scaled, puts it under the limit. A step that scales over the limit (64) is
    not probed again."""
    seen: list[int] = []

    def measure(b):
        seen.append(b)
        step = 10.0 * b * (2 if b == 48 and seen.count(48) == 1 else 1)
        return {"status": "ok", "peak_host_memory_mb": 1.0, "step_time_ms": step}

    said: list[str] = []
    fit = probe_batch(measure, device="cpu", max_memory_mb=None, max_step_s=0.5, say=said.append)
    assert fit.largest == 48 and seen.count(48) == 2 and seen.count(64) == 1, seen
    assert next(p for p in fit.probes if p.batch == 48).step_ms == 480.0
    assert "micro_batch_size=48: fits (peak 1 MB, step 480 ms; probed twice, the other step 960 ms)" in said, said

def test_batch_values_and_knobs_follow_the_hardware():
    assert batch_values(48) == [8, 16, 32, 48]
    assert batch_values(64) == [8, 16, 32, 64]
    assert batch_values(1) == [1]
    cpu = dict((k, v) for k, v, _ in knob_lines("cpu", 2, bf16=False, conv=False, compiler=True))
    assert cpu["precision"] == ["fp32", "bf16"] and "pin_memory" not in cpu and cpu["num_workers"] == [0, 1, 2]
    assert "channels_last" not in cpu and cpu["compile"] == ["off", "default"]
    assert cpu["malloc_retain"] == [False, True]  # this machine's libc is glibc
    gpu = dict((k, v) for k, v, _ in knob_lines("cuda", 16, bf16=True, conv=True, compiler=False))
    assert gpu["precision"] == ["fp32", "bf16", "fp16"] and gpu["pin_memory"] == [False, True]
    assert gpu["num_workers"] == [0, 1, 2, 4, 8, 16] and "compile" not in gpu and "channels_last" in gpu
    # eight GPUs on 64 cores: a trial per GPU at once, each with its share of the cores
    shared = {k: (v, why) for k, v, why in knob_lines("cuda", 64, bf16=True, conv=False, compiler=True, gpus=8)}
    assert shared["num_workers"][0] == [0, 1, 2, 4, 8] and "64 over 8 GPUs" in shared["num_workers"][1]
    assert dict((k, v) for k, v, _ in knob_lines("cpu", 64, bf16=True, conv=False, compiler=True,
                                                 gpus=8))["num_workers"] == [0, 1, 2, 4, 8, 16]  # no GPU trials
    old_gpu = dict((k, v) for k, v, _ in knob_lines("cuda", 8, bf16=False, conv=False, compiler=True))
    assert old_gpu["precision"] == ["fp32", "fp16"]  # a V100 or T4: no bf16
    # the fused optimizer on either device, where the workload's optimizer has a fused step
    assert cpu["fused_optimizer"] == gpu["fused_optimizer"] == [False, True]
    assert cpu["gc_freeze"] == gpu["gc_freeze"] == [False, True]  # the interpreter's, on either device
    for device in ("cpu", "cuda"):
        assert "fused_optimizer" not in dict((k, v) for k, v, _ in knob_lines(device, 2, bf16=True, conv=False,
                                                                              compiler=True, fused=False))
    # a dataset kept on the GPU: no workers, nothing to pin or copy; the GPU's own flags stay
    resident = dict((k, v) for k, v, _ in knob_lines("cuda", 16, bf16=True, conv=True, compiler=True,
                                                     items_on="cuda:0"))
    assert not {"num_workers", "persistent_workers", "pin_memory", "non_blocking"} & set(resident)
    assert resident["cudnn_benchmark"] == resident["tf32"] == [False, True]


def test_the_fused_optimizer_is_searched_only_where_the_optimizer_has_a_fused_step():
    """PyTorch's default CPU step of Adam, AdamW, SGD and Adagrad is a loop over the
    parameters; each has a fused CPU kernel, which the knob builds. RMSprop has none:
    ``init`` leaves the knob out, saying why, rather than write a knob whose trials fail."""
    import torch

    from tuner.apply import fused_optimizer_of

    params = [torch.nn.Parameter(torch.zeros(4))]
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad):
        assert fused_optimizer_of(cls(params, lr=0.1)) is None, cls
    assert fused_optimizer_of(torch.optim.RMSprop(params, lr=0.1)) == "RMSprop has no fused implementation"


@pytest.mark.slow
def test_init_on_cpu_with_a_memory_cap(tmp_path):
    # 40 MB held per sample: with the cap 300 MB above a 1-sample trial's peak, the
    # largest micro-batch is about 8 (few sizes to probe, each a trial's process). The
    # written file loads, its largest value trains under the cap, and the next probed
    # size does not.
    args = {"mb_per_sample": 40, "step_s": 0.001}

    def peak(b):
        r = run_isolated(make_request(workload=ref("ballast"), workload_args=args, device="cpu",
                                      config={"micro_batch_size": b}, measure=PROBE_MEASURE), timeout_s=120)
        assert r["status"] == "ok", r.get("reason")
        return r["peak_host_memory_mb"]

    cap = peak(1) + 300
    out = tmp_path / "space.yaml"
    run = subprocess.run([sys.executable, "-m", "tuner", "init", ref("ballast"), "--workload-args",
                          "{mb_per_sample: 40, step_s: 0.001}", "--device", "cpu", "--max-memory-mb", str(cap),
                          "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    space = spec.load(out)
    sizes = space.model.knobs["micro_batch_size"]
    largest = max(sizes)
    assert 7 <= largest <= 9, sizes
    comment = next(line for line in out.read_text().splitlines() if line.lstrip().startswith("micro_batch_size"))
    too_big = int(re.search(r"; (\d+) did not", comment).group(1))
    assert too_big > largest
    assert peak(largest) <= cap < peak(too_big)
    # a CPU without GPU knobs; a 2-core machine gets 0 or 1 worker
    assert "pin_memory" not in space.model.knobs and "torch_threads" in space.model.knobs
    # its optimizer is the default AdamW, which has a fused CPU step
    assert space.model.knobs["fused_optimizer"] == [False, True]


def test_bf16_without_native_instructions_stays_only_where_its_probe_step_kept_near_fp32_s():
    """On a CPU without native bf16 the probe sets a bf16 step beside the largest fp32 one
    quick enough to stay within the probe's limits several times over, and bf16 stays in
    the space only where it took under BF16_SLOWER times fp32's step."""
    fit = probe_batch(lambda b: {"status": "ok", "peak_host_memory_mb": 1.0, "step_time_ms": 10.0 * b},
                      device="cpu", max_memory_mb=None, max_step_s=1.0)
    beside = bf16_probe_size(fit)
    assert beside.fits and beside.step_ms <= 250 and all(
        p.step_ms > 250 for p in fit.probes if p.fits and p.batch > beside.batch)
    slow = Probe(64, True, "fits", 1.0, step_ms=400.0)  # none quick enough: the smallest that fit
    assert bf16_probe_size(type(fit)(64, [Probe(128, True, "fits", 1.0, 800.0), slow])) is slow
    keep, why = bf16_verdict(beside, {"status": "ok", "step_time_ms": beside.step_ms * 1.3})
    assert keep and "took 1.3x fp32's" in why and f"micro_batch_size={beside.batch}" in why
    keep, why = bf16_verdict(beside, {"status": "ok", "step_time_ms": beside.step_ms * BF16_SLOWER * 2})
    assert not keep and f"took {BF16_SLOWER * 2:.1f}x fp32's" in why
    keep, why = bf16_verdict(beside, {"status": "infeasible", "reason": "hung: no step for 60 s"})
    assert not keep and "did not run: hung: no step for 60 s" in why


@pytest.mark.slow
def test_init_on_a_cpu_without_native_bf16_probes_a_bf16_step_and_keeps_bf16_by_it(tmp_path, monkeypatch):
    """Where the CPU has no native bf16 (forced here, so that a host with it runs this path
    too; the probes themselves are real), init probes one bf16 step, says what it read, and
    the space holds bf16 exactly where that step took under BF16_SLOWER times fp32's."""
    import tuner.hardware
    from tuner.scaffold import init_space

    monkeypatch.setattr(tuner.hardware, "cpu_has_bf16", lambda: False)
    monkeypatch.chdir(tmp_path)
    said: list[str] = []
    out = tmp_path / "space.yaml"
    init_space(ref("linear"), {"size": 4096, "dim": 256, "lr": 1e-4}, out, device="cpu", upper=64, say=said.append)
    probing = [line for line in said if line.startswith("probing bf16 at micro_batch_size=")]
    assert len(probing) == 1, said
    ratio = float(re.search(r"a bf16 step took ([\d.]+)x fp32's", out.read_text() + "\n".join(said)).group(1))
    precision = spec.load(out).model.knobs.get("precision")
    if ratio < BF16_SLOWER:
        assert precision == ["fp32", "bf16"] and "the search measures whether it pays" in out.read_text()
    else:
        assert precision is None and any(line.startswith("precision left out: no native bf16") for line in said)

@pytest.mark.slow
def test_init_keeps_the_workload_s_own_output_out_of_its_probe_lines(tmp_path):
    """A workload that prints as it builds its model (a library's warnings, a progress
    bar) printed it once per probe, between the probe lines: each probe's output goes to
    one file, named once, and the CLI prints it at most once (its own check of make())."""
    (tmp_path / "noisy.py").write_text(
        "import sys\n"
        "from tests.fixture_workloads import linear\n"
        "def make():\n"
        "    wl = linear(size=48)\n"
        "    build = wl.model\n"
        "    def model():\n"
        "        print('NOISE-OUT'); print('NOISE-ERR', file=sys.stderr)\n"
        "        return build()\n"
        "    wl.model = model\n"
        "    return wl\n")
    run = subprocess.run([sys.executable, "-m", "tuner", "init", "noisy.py:make", "--device", "cpu", "-o",
                          "space.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert run.returncode == 0, run.stderr
    said = run.stdout + run.stderr
    assert said.count("NOISE-OUT") <= 1 and said.count("NOISE-ERR") <= 1, said
    log = Path(re.search(r"the workload's own output: (\S+?),", said).group(1))
    probes = said.count("micro_batch_size=")
    assert probes >= 3 and log.read_text().count("NOISE-OUT") >= probes - 1, (probes, log.read_text())
    assert log.read_text().count("NOISE-ERR") == log.read_text().count("NOISE-OUT")
    log.unlink()


def test_init_holds_workers_to_one_where_each_would_yield_the_whole_stream(tmp_path, temp_dir):
    """An iterable dataset that does not split itself among the DataLoader's workers: the
    space searches 0 or 1 worker, and init says why; a stream that splits gets the cores."""
    out = tmp_path / "space.yaml"
    run = subprocess.run([sys.executable, "-m", "tuner", "init", ref("unsplit_stream"), "--workload-args",
                          "{size: 256}", "--device", "cpu", "-o", str(out)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "TMPDIR": str(temp_dir)})
    assert run.returncode == 0, run.stderr
    # a workload that writes nothing leaves no log of its output in the temp dir
    assert not list(temp_dir.glob("tuner-init-*")), list(temp_dir.iterdir())
    assert "num_workers held to [0, 1]: every DataLoader worker yields the whole iterable dataset" in run.stdout + run.stderr
    assert spec.load(out).model.knobs["num_workers"] == [0, 1]
    line = next(x for x in out.read_text().splitlines() if x.lstrip().startswith("num_workers"))
    assert "get_worker_info()" in line
    many = dict((k, v) for k, v, _ in knob_lines("cpu", 16, bf16=True, conv=False, compiler=True))
    assert many["num_workers"] == [0, 1, 2, 4, 8, 16]


def test_init_says_when_the_temp_folder_leaves_dataloader_workers_no_room(tmp_path, temp_dir):
    """A TMPDIR too long for the workers' sockets: init writes the space all the same (the
    fix is the environment's) and says what to shorten, where its check of an iterable
    dataset's workers would have waited for ever for their first item."""
    tmpdir = temp_dir / ("t" * 100)
    tmpdir.mkdir()
    out = tmp_path / "space.yaml"
    run = subprocess.run([sys.executable, "-m", "tuner", "init", ref("unsplit_stream"), "--workload-args",
                          "{size: 256}", "--device", "cpu", "-o", str(out)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "TMPDIR": str(tmpdir)})
    assert run.returncode == 0, run.stderr
    note = next(ln for ln in run.stderr.splitlines() if ln.startswith("note: DataLoader workers"))
    assert "set TMPDIR to a shorter folder" in note and note.endswith("`tuner run` refuses num_workers above 0 until then")
    assert 0 in spec.load(out).model.knobs["num_workers"]


@pytest.mark.slow
@pytest.mark.parametrize(("workload", "why"), [("own_autocast", "the workload turns on torch.autocast itself at"),
                                               ("half_model", "the model's parameters are bfloat16")])
def test_init_leaves_precision_out_where_the_knob_would_change_little(tmp_path, workload, why):
    out = tmp_path / "space.yaml"
    run = subprocess.run([sys.executable, "-m", "tuner", "init", ref(workload), "--device", "cpu",
                          "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert f"precision left out: {why}" in run.stdout + run.stderr
    assert "precision" not in spec.load(out).model.knobs


@pytest.mark.slow
def test_init_stops_where_only_a_batch_of_one_runs_and_says_why(tmp_path):
    # items of different sizes: a batch of one needs no stacking, two fail in the collate;
    # a space of batches of one would search nothing anyone trains with
    out = tmp_path / "space.yaml"
    run = subprocess.run([sys.executable, "-m", "tuner", "init", ref("uneven"), "--device", "cpu", "-o", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and not out.exists()
    assert "micro_batch_size=2 raised, and only micro_batch_size=1 ran" in run.stderr, run.stderr
    assert "pad_sequence" in run.stderr


def test_init_refuses_to_overwrite(tmp_path):
    out = tmp_path / "space.yaml"
    out.write_text("keep me")
    run = subprocess.run([sys.executable, "-m", "tuner", "init", "conv", "-o", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "--force" in run.stderr and out.read_text() == "keep me"


def test_a_space_written_into_another_folder_names_the_workload_file_from_there(tmp_path, monkeypatch):
    """A relative workload file is found from the space file's folder: ``init x.py:make -o
    sub/space.yaml`` writes ``../x.py:make``."""
    from pathlib import Path

    from tuner.scaffold import seen_from

    monkeypatch.chdir(tmp_path)
    assert seen_from("x.py:make", Path("sub/space.yaml")) == "../x.py:make"
    assert seen_from("x.py:make", Path("space.yaml")) == "x.py:make"
    assert seen_from("lib/x.py:make", Path("sub/deeper/space.yaml")) == "../../lib/x.py:make"
    assert seen_from("conv", Path("sub/space.yaml")) == "conv" and seen_from("pkg.mod:make", Path("a/b.yaml")) == "pkg.mod:make"


def test_probe_stops_where_an_epoch_would_hold_too_few_steps(tmp_path):
    """A batch of the whole dataset fits in memory but is one step per epoch: the probe
    stops at the largest batch that leaves STEPS_PER_EPOCH steps, and the space file says
    why it stopped there."""
    from tuner.scaffold import STEPS_PER_EPOCH, write_space

    seen = []

    def measure(b):
        seen.append(b)
        return {"status": "ok", "peak_host_memory_mb": 1.0, "step_time_ms": 1.0, "epoch_size": 2048}

    fit = probe_batch(measure, device="cpu", max_memory_mb=None, max_step_s=1.0)
    bound = 2048 // STEPS_PER_EPOCH // 8 * 8
    assert fit.largest == bound and max(seen) == bound and fit.first_too_big is None
    text = write_space(tmp_path / "s.yaml", name="s", workload="conv", workload_args={}, device="cpu",
                       fit=fit, lines=[], trials=4, cap_note="")
    assert f"fewer than {STEPS_PER_EPOCH} steps in an epoch of 2048 samples" in text
    assert max(spec.load(tmp_path / "s.yaml").model.knobs["micro_batch_size"]) == bound
    # an iterable dataset without len(): no epoch bounds the probe, and the file says how to give one
    fit = probe_batch(lambda b: {"status": "ok", "peak_host_memory_mb": 1.0, "step_time_ms": 1.0, "epoch_size": None},
                      device="cpu", max_memory_mb=None, max_step_s=1.0, upper=256)
    assert fit.largest == 256
    text = write_space(tmp_path / "i.yaml", name="i", workload="conv", workload_args={}, device="cpu",
                       fit=fit, lines=[], trials=4, cap_note="")
    assert "upper bound (the dataset's length is unknown: Workload(epoch_size=...)" in text


def test_a_batch_too_small_for_the_model_is_passed_over_and_an_oom_is_not(tmp_path):
    """BatchNorm raises at a batch of 1 ("expected more than 1 value per channel"): the
    probe goes on doubling to a size that runs, and the values written start there. An OOM
    at 1 stops it at once (nothing larger fits); so does a workload that raises at every
    size up to SMALLEST, named with the sizes tried."""
    from tuner.scaffold import SMALLEST, write_space

    def bn(b):
        if b < 2:
            return {"status": "infeasible", "error_kind": "workload",
                    "reason": "workload loss raised ValueError: Expected more than 1 value per channel"}
        if b > 20:
            return {"status": "infeasible", "error_kind": "oom", "reason": "out of memory"}
        return {"status": "ok", "peak_host_memory_mb": 1.0, "step_time_ms": 1.0}

    fit = probe_batch(bn, device="cpu", max_memory_mb=None, max_step_s=1.0)
    assert fit.smallest == 2 and 16 <= fit.largest <= 20 and fit.first_too_big.batch > fit.largest
    assert batch_values(16, smallest=4) == [4, 8, 16] and batch_values(16) == [2, 4, 8, 16]
    text = write_space(tmp_path / "s.yaml", name="s", workload="conv", workload_args={}, device="cpu",
                       fit=fit, lines=[], trials=4, cap_note="")
    assert min(spec.load(tmp_path / "s.yaml").model.knobs["micro_batch_size"]) >= 2 and "below 2" in text

    seen = []

    def oom(b):
        seen.append(b)
        return {"status": "infeasible", "error_kind": "oom", "reason": "out of memory"}

    assert probe_batch(oom, device="cpu", max_memory_mb=None, max_step_s=1.0).largest is None and seen == [1]
    seen.clear()

    def broken(b):
        seen.append(b)
        return {"status": "infeasible", "error_kind": "workload", "reason": "workload loss raised KeyError: 'x'"}

    assert probe_batch(broken, device="cpu", max_memory_mb=None, max_step_s=1.0).largest is None
    assert seen == [1, 2, 4, SMALLEST]


def test_the_input_pipeline_s_knobs_are_written_where_reading_the_items_costs_the_step(tmp_path):
    """``dataset_cache`` is searched where reading a micro-batch's items (timed on a sample
    of them) takes CACHE_WAIT of the probe's step more than reading them from the cache,
    and only where a cache would be right: items that differ between reads, or more than the memory free now, are left
    out with the reason on one line (the fix named). ``augment_on`` on a GPU, where the
    workload has an augment. The Decoded items sleep ``decode_s`` each, a decode's cost."""
    import torch

    from tests.fixture_workloads import Decoded
    from tuner.scaffold import Fit, Probe, pipeline_lines

    def fit(step_ms: float, map_style: bool = True) -> Fit:
        return Fit(largest=32, probes=[Probe(16, True, "fits", 1.0, step_ms / 2), Probe(32, True, "fits", 1.0, step_ms)],
                   map_style=map_style)

    said: list[str] = []
    # 32 items of 2 ms each against a 100 ms step: well over CACHE_WAIT
    lines = {k: (v, why) for k, v, why in pipeline_lines(lambda: Decoded(64, 0.002), fit(100.0), "cpu", False,
                                                          say=said.append)}
    assert lines["dataset_cache"][0] == [False, True] and "saved at micro_batch_size=32" in lines["dataset_cache"][1]
    assert "augment_on" not in lines and not said
    # items that cost next to nothing to read: a knob searched for nothing
    assert pipeline_lines(lambda: Decoded(64, 0.0), fit(1000.0), "cpu", False, say=said.append) == [] and not said
    # items read from a tensor cost less than a slice of the cache's shared memory: nothing to save, at
    # any step time
    rows = torch.utils.data.TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
    assert pipeline_lines(lambda: rows, fit(0.05), "cpu", False, say=said.append) == [] and not said
    # a random draw in __getitem__: no cache, and the line says where the draw belongs
    assert pipeline_lines(lambda: Decoded(64, 0.002, random=True), fit(100.0), "cpu", False, say=said.append) == []
    assert len(said) == 1 and "differs between two reads" in said[0] and "Workload(augment=...)" in said[0]
    # more items than the memory free now could hold (a billion lazily made ones)
    said.clear()
    assert pipeline_lines(lambda: Decoded(10**9, 0.002), fit(100.0), "cpu", False, say=said.append) == []
    assert len(said) == 1 and "MB the cache may hold of the memory free now" in said[0]

    # an iterable dataset has no items to read by index: the dataset is not even built
    def never():
        raise AssertionError("built")

    assert pipeline_lines(never, fit(100.0, map_style=False), "cpu", False) == []
    # a dataset that raises here (the probes read theirs): said, and no line
    said.clear()
    assert pipeline_lines(never, fit(100.0), "cpu", False, say=said.append) == []
    assert said == ["dataset_cache left out: the dataset raised here: AssertionError: built"]
    # the augment's placement: on a GPU only (on a CPU the device is the host)
    assert pipeline_lines(never, fit(100.0, map_style=False), "cuda", True)[0][:2] == ("augment_on", ["host", "device"])
    assert pipeline_lines(never, fit(100.0, map_style=False), "cpu", True) == []
    # the batches' own knobs, where the workload gives sources or lengths of a map-style dataset
    said.clear()
    lines = {k: v for k, v, _ in pipeline_lines(lambda: rows, fit(0.05), "cpu", False, say=said.append,
                                                 has_groups=True, has_lengths=True)}
    assert lines == {"batch_grouping": ["mixed", "by_source"], "group_by_length": [False, True]} and not said
    assert pipeline_lines(never, fit(100.0, map_style=False), "cpu", False, has_groups=True, has_lengths=True) == []
    # items whose length varies, padded by the workload's collate, from a workload that
    # gives no lengths: said, with the padding measured and the fix
    from tests.fixture_workloads import Sentences, _pad

    said.clear()
    assert pipeline_lines(lambda: Sentences(256), fit(1000.0), "cpu", False, say=said.append, collate=_pad) == []
    assert len(said) == 1 and said[0].startswith("group_by_length left out: the workload gives no lengths, and its "
                                                 "items' lengths vary (2-") \
        and re.search(r"in a sample of 32\): collated as one batch, they are \d\d% padding", said[0]) \
        and "Workload(lengths=" in said[0], said
    said.clear()
    assert pipeline_lines(lambda: Sentences(256), fit(1000.0), "cpu", False, say=said.append, has_lengths=True,
                          collate=_pad)
    assert not said
    # the same for token ids as Python lists; but a few ids per field beside a larger
    # part (packed by an EmbeddingBag, not padded) are no reason for it, nor are parts
    # that the collate concatenates (a batch of graphs) rather than pads
    tokens = [{"input_ids": list(range(2 + i % 40)), "label": i % 2} for i in range(64)]

    def pad_lists(items):
        longest = max(len(it["input_ids"]) for it in items)
        return torch.tensor([it["input_ids"] + [0] * (longest - len(it["input_ids"])) for it in items])

    clicks = [{"dense": torch.zeros(13), "ids": [[1] * (1 + i % 6), [2] * (1 + i % 3)]} for i in range(64)]
    graphs = [{"x": torch.zeros(4 + i % 30, 8), "edges": torch.zeros(2, 3 + i % 50, dtype=torch.long)}
              for i in range(64)]

    def concatenated(items):
        return torch.cat([it["x"] for it in items]), torch.cat([it["edges"] for it in items], dim=1)

    said.clear()
    assert pipeline_lines(lambda: tokens, fit(1000.0), "cpu", False, say=said.append, collate=pad_lists) == []
    assert len(said) == 1 and "its items' lengths vary (2-" in said[0], said
    said.clear()
    assert pipeline_lines(lambda: clicks, fit(1000.0), "cpu", False, say=said.append, collate=list) == [] and not said
    assert pipeline_lines(lambda: graphs, fit(1000.0), "cpu", False, say=said.append, collate=concatenated) == []
    assert not said


@pytest.mark.slow
def test_init_writes_the_cache_for_a_workload_whose_items_are_slow_to_read(tmp_path):
    """The whole path: init probes a workload whose items take 4 ms each to read, and the
    space it writes searches dataset_cache, saying why; the file loads."""
    out = tmp_path / "space.yaml"
    run = subprocess.run([sys.executable, "-m", "tuner", "init", ref("decoded"), "--workload-args",
                          "{size: 80, decode_s: 0.004}", "--device", "cpu", "-o", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert spec.load(out).model.knobs["dataset_cache"] == [False, True]
    line = next(x for x in out.read_text().splitlines() if x.lstrip().startswith("dataset_cache"))
    assert "items take" in line and "ms from the cache" in line and "filled once, up front" in line
