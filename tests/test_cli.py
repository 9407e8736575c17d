"""The command line as a user meets it: real subprocesses, exit codes, one-line errors."""

import json
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers import FIXTURES

FAST = "measure: {warmup_steps: 2, window_s: 0.2, min_windows: 3, max_windows: 4}\n"


def tuner(*args, cwd=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "tuner", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def _space(tmp_path, workload, extra=""):
    p = tmp_path / "space.yaml"
    p.write_text(f"name: t\nworkload: {workload}\n" + FAST + textwrap.dedent(extra))
    return p


def test_help_is_fast():
    t = time.perf_counter()
    r = tuner("--help")
    assert r.returncode == 0 and "bench" in r.stdout
    assert time.perf_counter() - t < 3.0  # no torch import (~2 s here) for --help


def test_bench_json_has_the_documented_fields(tmp_path):
    space = _space(tmp_path, "conv", "workload_args: {size: 256}\nknobs:\n  micro_batch_size: [16]\n")
    r = tuner("bench", str(space), "--json", "--set", "precision=bf16", "--set", "num_workers=1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("samples_per_sec", "samples_per_sec_spread", "step_time_ms", "data_wait_fraction",
                "compile_s", "warmup_s", "peak_host_memory_mb", "peak_device_memory_mb",
                "loss_finite", "projected_run_s", "config", "workload", "hardware"):
        assert key in out, key
    assert out["config"]["precision"] == "bf16" and out["config"]["num_workers"] == 1
    assert out["config"]["micro_batch_size"] == 16
    assert out["samples_per_sec"] > 0 and out["peak_device_memory_mb"] is None
    assert out["workload"]["ref"] == "conv" and out["hardware"]["cpu_count"] >= 1


def test_bench_baseline_table(tmp_path):
    space = _space(tmp_path, "conv", "workload_args: {size: 256}\nknobs:\n  micro_batch_size: [16]\n")
    r = tuner("bench", str(space), "--baseline")
    assert r.returncode == 0, r.stderr
    assert "samples/sec (sustained)" in r.stdout and "num_workers=0" in r.stdout
    assert "precision=fp32" in r.stdout


@pytest.mark.parametrize("args,workload,match", [
    (["--set", "num_wrkers=2"], "conv", "unknown knob 'num_wrkers'"),
    (["--set", "precision=fp8"], "conv", "precision.*fp8"),
    (["--set", "prefetch_factor=4", "--set", "num_workers=0"], "conv", "prefetch_factor=4.*num_workers > 0"),
    (["--set", "pin_memory=true"], "conv", "pin_memory.*GPU knob"),
    ([], "missing_mod_xyz:make", "module 'missing_mod_xyz' not found"),
    ([], f"{FIXTURES}:raises", "raised: RuntimeError: my dataset path does not exist"),
    ([], f"{FIXTURES}:raises_in_loss", "KeyError"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, workload, match):
    import re

    r = tuner("bench", str(_space(tmp_path, workload)), *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert re.search(match, lines[0]), lines[0]
    assert "Traceback" not in r.stderr


def test_debug_shows_the_traceback(tmp_path):
    r = tuner("--debug", "bench", str(_space(tmp_path, f"{FIXTURES}:raises")))
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_knobs_lists_the_table():
    r = tuner("knobs")
    assert r.returncode == 0
    from tuner.knobs import KNOBS

    for name in KNOBS:
        assert name in r.stdout
