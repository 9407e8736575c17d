import pytest

from tests.helpers import FAST_MEASURE, ref
from tuner.measure import median_error, tree_memory_bytes
from tuner.trial import make_request, run_isolated


def _run(name, args=None, config=None, timeout=120, measure=None, **kw):
    req = make_request(workload=ref(name), workload_args=args or {}, config=config or {},
                       device="cpu", measure=measure or FAST_MEASURE, **kw)
    return run_isolated(req, timeout_s=timeout)


def test_known_step_time_is_reported_at_the_true_rate():
    # 50 ms per micro-batch of 4 samples: 80 samples/s, sustained over whole epochs
    # (the tiny model's own step adds about 1 ms here).
    r = _run("sleepy", {"step_s": 0.05}, {"micro_batch_size": 4})
    assert r["status"] == "ok", r.get("reason")
    assert r["steady_samples_per_sec"] == pytest.approx(80, rel=0.05)
    assert r["samples_per_sec"] == pytest.approx(80, rel=0.05)
    assert r["step_time_ms"] == pytest.approx(50, rel=0.05)
    assert r["epoch_starts_measured"] >= 1  # the timed phase crossed epoch boundaries
    assert r["peak_device_memory_mb"] is None and r["loss_finite"] is True
    assert r["projected_run_s"] > 0 and r["config"]["micro_batch_size"] == 4


def test_dataloader_workers_memory_is_in_the_peak():
    no_workers = _run("hungry_workers", {"mb": 300}, {"num_workers": 0, "micro_batch_size": 8})
    two = _run("hungry_workers", {"mb": 300}, {"num_workers": 2, "micro_batch_size": 8})
    assert no_workers["status"] == two["status"] == "ok"
    # each of the two workers holds 300 MB that the main process does not
    assert two["peak_host_memory_mb"] - no_workers["peak_host_memory_mb"] > 0.85 * 600


def test_nan_loss_is_a_result():
    r = _run("nan_in", {"precision_dtype": "float16"}, {"precision": "fp16", "micro_batch_size": 4})
    assert r["status"] == "infeasible" and r["loss_finite"] is False
    assert "non-finite" in r["reason"]
    ok = _run("nan_in", {"precision_dtype": "float16"}, {"precision": "fp32", "micro_batch_size": 4})
    assert ok["loss_finite"] is True


def test_oom_raise_and_hang_are_results_with_reasons():
    oom = _run("oom_above", {"max_batch": 16}, {"micro_batch_size": 32})
    assert oom["status"] == "infeasible" and oom["error_kind"] == "oom"
    assert oom["reason"].startswith("out of memory")
    bad = _run("raises_in_loss")
    assert bad["error_kind"] == "workload" and "loss raised KeyError" in bad["reason"]
    hang = _run("hangs", timeout=8)
    assert hang["error_kind"] == "timeout" and "hung" in hang["reason"]
    assert hang["trial_wall_s"] < 20


def test_tree_memory_and_median_error():
    import os

    assert tree_memory_bytes(os.getpid()) > 10 * 2**20
    assert median_error([100, 100, 100, 100]) == 0
    assert median_error([100, 101, 99, 100, 150]) < median_error([100, 120, 80, 110, 90])
