"""GPU code paths: CUDA sync, allocator peaks, NVML, pin_memory, cudnn. Skipped without a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import FAST_MEASURE, ref
from tuner import apply, knobs
from tuner.diagnose import diagnose
from tuner.loop import Trainer
from tuner.nvml import NvmlSampler
from tuner.trial import make_request, run_isolated
from tuner.workloads import load_workload

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda") if torch.cuda.is_available() else None
ROOT = Path(__file__).resolve().parent.parent


def _config(**kw):
    return knobs.resolve(kw, apply.context_for(CUDA), strict=True)[0]


def _plain_loop(workload: str, args: dict, config: dict) -> dict:
    """benchmarks/user_loop.py on the GPU: the loop a user writes, in a fresh process."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "user_loop.py"), workload, json.dumps(args),
           json.dumps(config), "--device", "cuda"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_known_rate_on_gpu():
    """A 50 ms host sleep in the loss bounds the step from below; the tiny model's
    forward, backward and AdamW step add their kernel launches, which a plain loop pays
    too. What the tuner's loop adds on top (a per-step sync or host allocation would)
    is the gap to the plain loop on the same step."""
    args, config = {"step_s": 0.05}, {"micro_batch_size": 4}
    r = run_isolated(make_request(workload=ref("sleepy"), workload_args=args, config=config, device="cuda",
                                  measure=FAST_MEASURE), timeout_s=120)
    plain = _plain_loop(ref("sleepy"), args, config)["samples_per_sec"]
    print(f"known rate 80.0, tuner {r['samples_per_sec']:.2f}, plain loop {plain:.2f}")
    assert r["samples_per_sec"] <= 4 / 0.050 * 1.01
    assert r["samples_per_sec"] == pytest.approx(plain, rel=0.02), (r["samples_per_sec"], plain)
    # Nothing else holds the GPU yet (the tests that train in this process come later):
    # no window may be taken for another process's.
    assert r["disturbed_windows_dropped"] == 0


def test_another_process_on_the_gpu_is_flagged_as_disturbance():
    """NVML on a real driver: a second process holding a CUDA context on the trial's GPU
    makes its windows disturbed (redone, then counted)."""
    other = subprocess.Popen([sys.executable, "-c", "import time, torch; x = torch.ones(1, device='cuda'); "
                              "print('up', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "up"
        r = run_isolated(make_request(workload=ref("sleepy"), workload_args={"step_s": 0.01},
                                      config={"micro_batch_size": 4}, device="cuda", measure=FAST_MEASURE),
                         timeout_s=120)
    finally:
        other.kill()
        other.wait()
    assert r["status"] == "ok", r.get("reason")
    if not NvmlSampler(CUDA).available:
        pytest.skip("no NVML on this driver")
    assert r["disturbed_windows_dropped"] > 0 and r["gpu_util_pct"] is not None, r


def test_pin_memory_non_blocking_and_cudnn_reach_torch():
    t = Trainer(load_workload("conv", {"size": 256}),
                _config(pin_memory=True, non_blocking=True, cudnn_benchmark=True, tf32=True,
                        num_workers=1, micro_batch_size=32), CUDA)
    assert t.loader.pin_memory is True and t.move.non_blocking is True
    assert torch.backends.cudnn.benchmark is True and torch.backends.cuda.matmul.allow_tf32 is True
    t.start()
    t.step()
    assert next(t.model.parameters()).is_cuda and t.loss_finite()


def test_the_hot_path_check_names_the_gpu_s_own_defects_with_measured_waits():
    import re

    from tuner.hotpath import UserCode, check

    source = ROOT / "tests" / "fixture_workloads.py"
    marked = {m.group(1): n for n, line in enumerate(source.read_text().splitlines(), 1)
              if (m := re.search(r"# gpu defect: (\w+)$", line))}
    t = Trainer(load_workload(ref("gpu_defects")), _config(micro_batch_size=8), CUDA)
    result = check(t, UserCode.of_workload(ref("gpu_defects")), steps=5, warm=3)
    found = {f["kind"]: f for f in result["findings"]}
    for kind, line in marked.items():
        assert found[kind]["where"].endswith(f"fixture_workloads.py:{line}"), (kind, found.get(kind))
        assert found[kind]["per_step"] == 1
    assert found["sync"]["cost_ms_per_step"] is not None  # on a GPU the host's wait is measured
    assert result["step_ms"] > 0


def test_device_peak_and_nvml_in_a_trial():
    r = run_isolated(make_request(workload="conv", workload_args={"size": 512},
                                  config={"precision": "bf16", "micro_batch_size": 64}, device="cuda",
                                  measure=FAST_MEASURE), timeout_s=300)
    assert r["status"] == "ok", r.get("reason")
    assert r["peak_device_memory_mb"] > 1 and r["peak_device_reserved_mb"] >= r["peak_device_memory_mb"]
    assert r["hardware"]["gpu"] and r["hardware"]["gpu_memory_mb"] > 1000
    if NvmlSampler(CUDA).available:
        assert r["gpu_util_pct"] is not None and r["gpu_memory_used_mb"] > 0


def test_activations_kept_every_step_on_the_gpu_are_named_as_device_memory_that_grows():
    """Each step's hidden activations kept in a list with their graph on the GPU (1 MB a
    step at this width: a few hundred MB over the windows): the allocator's bytes grow
    through the windows; the same workload keeping nothing has no such note."""
    def run(keep: bool) -> dict:
        return run_isolated(make_request(workload=ref("leaky"), workload_args={"width": 4096, "keep": keep},
                                         config={"micro_batch_size": 64}, device="cuda", measure=FAST_MEASURE),
                            timeout_s=300)

    leaks, plain = run(True), run(False)
    assert leaks["status"] == plain["status"] == "ok", (leaks.get("reason"), plain.get("reason"))
    assert leaks["device_memory_grew_steadily"] and leaks["device_memory_growth_mb"] >= 32, leaks
    assert any(f.startswith("the GPU memory its tensors hold grew through the timed windows")
               for f in diagnose(leaks).flags)
    assert not plain["device_memory_grew_steadily"] and abs(plain["device_memory_growth_mb"]) < 1

def test_hugging_face_batches_reach_the_gpu_with_workers_and_pinning():
    r = run_isolated(make_request(workload=ref("encoding_batches"), workload_args={"size": 256},
                                  config={"micro_batch_size": 8, "num_workers": 1, "pin_memory": True,
                                          "non_blocking": True}, device="cuda", measure=FAST_MEASURE),
                     timeout_s=120)
    assert r["status"] == "ok", r.get("reason")


def test_fp16_with_grad_scaler_and_compile_on_gpu():
    for config in ({"precision": "fp16", "micro_batch_size": 32, "cudnn_benchmark": True},
                   {"precision": "bf16", "micro_batch_size": 32, "compile": "default", "fused_optimizer": True}):
        r = run_isolated(make_request(workload="conv", workload_args={"size": 512}, config=config,
                                      device="cuda", measure=FAST_MEASURE), timeout_s=300)
        assert r["status"] == "ok", (config, r.get("reason"))
        assert r["loss_finite"] is True and r["samples_per_sec"] > 0
        assert (r["compile_s"] > 0) == (config.get("compile") == "default")


def test_a_dataset_kept_on_the_gpu_trains_without_workers_and_refuses_pinning():
    from torch.utils.data import TensorDataset

    from tuner.errors import KnobRefused
    from tuner.workloads import Workload

    on_gpu = TensorDataset(torch.randn(64, 8, device=CUDA), torch.randn(64, 1, device=CUDA))
    wl = Workload(model=lambda: torch.nn.Linear(8, 1), dataset=lambda: on_gpu,
                  loss=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
    with pytest.raises(KnobRefused, match="pin_memory=true.*already on cuda"):
        Trainer(wl, _config(pin_memory=True, micro_batch_size=8), CUDA)
    with pytest.raises(KnobRefused, match="num_workers=1.*already on cuda"):
        Trainer(wl, _config(num_workers=1, micro_batch_size=8), CUDA)
    t = Trainer(wl, _config(micro_batch_size=8), CUDA)
    t.start()
    t.step()
    assert t.loss_finite()
