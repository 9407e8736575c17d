"""``tuner profile``: a trace, the top operators, and the same verdict as bench."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ref


@pytest.mark.slow
@pytest.mark.alone
def test_profile_writes_a_trace_and_honest_figures(tmp_path):
    space = tmp_path / "s.yaml"
    space.write_text(f"name: p\nworkload: {ref('slow_data')}\nworkload_args: {{sample_s: 0.001, step_s: 0.05}}\n"
                     "knobs:\n  micro_batch_size: [4]\n"
                     "measure: {warmup_steps: 2, window_s: 0.3, min_windows: 3, max_windows: 4}\n")
    r = subprocess.run([sys.executable, "-m", "tuner", "profile", str(space), "--out", str(tmp_path / "prof"),
                        "--json", "--steps", "4", "--set", "fused_optimizer=true"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    trace = json.loads((tmp_path / "prof" / "trace.json").read_text())
    assert trace["traceEvents"] and any(e.get("name") == "tuner::data_wait" for e in trace["traceEvents"])
    names = {op["name"] for op in summary["top_ops"]}
    assert names & {"aten::addmm", "aten::mm", "aten::linear", "aten::mse_loss"}, names
    assert summary["data_loading_ms"] > 4 * 4 * 1.0 * 0.9  # 4 steps of 4 samples of >= 1 ms
    # throughput from the unprofiled measurement: 4 samples per (50 ms step + 4 ms data)
    # (at most that; the tiny model's own step adds 1-2 ms on this VM, depending on its load)
    assert 0.85 * 4 / 0.054 <= summary["samples_per_sec"] <= 1.02 * 4 / 0.054
    # the verdict is the profiled config's: it advises no knob the config already sets (it
    # read a measurement without its config, and advised PyTorch's defaults away)
    from tuner.diagnose import diagnose

    measured = summary["measurement"]
    assert measured["config"]["fused_optimizer"] is True and measured["has_conv2d"] is False
    assert not any("fused_optimizer" in r for r in diagnose(measured).recommendations)
    assert any("fused_optimizer" in r for r in diagnose({**measured, "config": {}}).recommendations)
    # then the hot-path check: a loss that only sleeps has no defect
    assert summary["hot_path"]["findings"] == [] and summary["hot_path"]["steps"] > 0
