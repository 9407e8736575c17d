"""GPU code paths: CUDA sync, allocator peaks, NVML, pin_memory, cudnn. Skipped without a GPU."""

import pytest
import torch

from tests.helpers import FAST_MEASURE, ref
from tuner import knobs
from tuner.loop import Trainer
from tuner.measure import NvmlSampler
from tuner.trial import make_request, run_isolated
from tuner.workloads import load_workload

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda") if torch.cuda.is_available() else None


def _config(**kw):
    return knobs.resolve(kw, knobs.context_for(CUDA), strict=True)[0]


def test_pin_memory_non_blocking_and_cudnn_reach_torch():
    t = Trainer(load_workload("conv", {"size": 256}),
                _config(pin_memory=True, non_blocking=True, cudnn_benchmark=True, tf32=True,
                        num_workers=1, micro_batch_size=32), CUDA)
    assert t.loader.pin_memory is True and t.non_blocking is True
    assert torch.backends.cudnn.benchmark is True and torch.backends.cuda.matmul.allow_tf32 is True
    t.start()
    t.step()
    assert next(t.model.parameters()).is_cuda and t.loss_finite()


def test_device_peak_and_nvml_in_a_trial():
    r = run_isolated(make_request(workload="conv", workload_args={"size": 512},
                                  config={"precision": "bf16", "micro_batch_size": 64}, device="cuda",
                                  measure=FAST_MEASURE), timeout_s=300)
    assert r["status"] == "ok", r.get("reason")
    assert r["peak_device_memory_mb"] > 1 and r["peak_device_reserved_mb"] >= r["peak_device_memory_mb"]
    assert r["hardware"]["gpu"] and r["hardware"]["gpu_memory_mb"] > 1000
    if NvmlSampler(CUDA).available:
        assert r["gpu_util_pct"] is not None and r["gpu_memory_used_mb"] > 0


def test_known_rate_on_gpu():
    r = run_isolated(make_request(workload=ref("sleepy"), workload_args={"step_s": 0.05},
                                  config={"micro_batch_size": 4}, device="cuda", measure=FAST_MEASURE),
                     timeout_s=120)
    assert r["samples_per_sec"] == pytest.approx(80, rel=0.05)
