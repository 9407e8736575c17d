"""One config in its own process (tuner/trial.py): the typed request, and every failure
as a result with a one-line reason."""

import pickle

from tests.helpers import FAST_MEASURE, ref
from tuner.trial import TrialRequest, classify, make_request, resolve_config, run_isolated


def _run(name, args=None, config=None, timeout=120, **kw):
    return run_isolated(make_request(workload=ref(name), workload_args=args or {}, config=config or {},
                                     device="cpu", measure=FAST_MEASURE, **kw), timeout_s=timeout)


def test_request_is_typed_copied_and_picklable():
    config = {"micro_batch_size": 8}
    req = make_request(workload="conv", config=config, measure=FAST_MEASURE)
    config["micro_batch_size"] = 64  # the caller's dict changes later: the request does not
    assert isinstance(req, TrialRequest) and req.config == {"micro_batch_size": 8}
    assert pickle.loads(pickle.dumps(req)) == req  # it crosses into the trial's process
    resolved = resolve_config(req)
    assert resolved.config["micro_batch_size"] == 8 and resolved.device.type in ("cpu", "cuda")
    assert resolved.workload.dataset is not None and resolved.notes == []


def test_a_dataloader_workers_exception_keeps_the_users_message():
    exc = RuntimeError("Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent "
                       "call last):\n  File ...\nValueError: bad sample 7\n")
    kind, reason = classify(exc)
    assert kind == "error" and reason.endswith("ValueError: bad sample 7")


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
