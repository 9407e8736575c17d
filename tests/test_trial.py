"""One config in its own process (tuner/trial.py): the typed request, and every failure
as a result with a one-line reason."""

import contextlib
import json
import os
import pickle
import subprocess
import sys
import time

import pytest

from tests.helpers import FAST_MEASURE, ref, running
from tuner.trial import TrialRequest, classify, make_request, resolve_config, run_isolated


def _run(name, args=None, config=None, timeout=120, measure=FAST_MEASURE, **kw):
    return run_isolated(make_request(workload=ref(name), workload_args=args or {}, config=config or {},
                                     device="cpu", measure=measure, **kw), timeout_s=timeout)


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


def test_nccl_out_of_shared_memory_is_told_where_and_what_a_container_needs():
    """NCCL's ranks on one node keep their buffers in /dev/shm, a container's 64 MB unless
    started otherwise. PyTorch raises DistBackendError with "unhandled system error" first
    and NCCL's own last error below. NCCL cannot run here (no GPU): the exception is
    PyTorch's own class, with the text PyTorch and NCCL give it."""
    import torch.distributed as dist

    nccl = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled system error "
            "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclSystemError: System call (e.g. socket, "
            "malloc) or external library call failed or device error. \nLast error:\n")
    kind, reason = classify(dist.DistBackendError(nccl + "Error while creating shared memory segment "
                                                  "/dev/shm/nccl-vzIpS6 (size 9637888)"))
    assert kind == "oom", reason
    assert reason.startswith("out of shared memory: NCCL's ranks on one node exchange data in /dev/shm, which holds ")
    assert "--shm-size=8g or --ipc=host" in reason and "NCCL_SHM_DISABLE=1" in reason
    assert reason.endswith(": Error while creating shared memory segment /dev/shm/nccl-vzIpS6 (size 9637888)")
    # NCCL's other system errors (a socket, say) are not put down to /dev/shm
    kind, reason = classify(dist.DistBackendError(nccl + "socketStartConnect: Connect to 10.0.0.2<43211> failed"))
    assert kind == "error" and "shared memory" not in reason


def test_nan_loss_is_a_result():
    r = _run("nan_in", {"precision_dtype": "float16"}, {"precision": "fp16", "micro_batch_size": 4})
    assert r["status"] == "infeasible" and r["loss_finite"] is False
    assert "non-finite" in r["reason"]
    ok = _run("nan_in", {"precision_dtype": "float16"}, {"precision": "fp32", "micro_batch_size": 4})
    assert ok["loss_finite"] is True


def test_a_trial_runs_in_a_fresh_interpreter_its_caller_started(tmp_path):
    """Spawned, as a user's training starts, not forked from a server that imported torch
    once: a forked child's heap follows its server's, and its rate with it
    (docs/how-it-measures.md, "Your process against the tuner's figure")."""
    where = tmp_path / "started.json"
    r = _run("started_as", {"path": str(where)}, {"micro_batch_size": 4})
    assert r["status"] == "ok", r.get("reason")
    lines = where.read_text().splitlines()
    assert lines
    for line in lines:
        started = json.loads(line)
        assert started["ppid"] == os.getpid()
        assert "spawn_main" in " ".join(started["cmdline"]), started["cmdline"]


@pytest.mark.slow
def test_a_trial_s_process_ends_with_its_result_and_its_workers_with_it(tmp_path):
    """Once the result is sent, the process ends without the interpreter's teardown (a
    second per trial with torch imported), so a workload's thread that never ends does not
    hold it to the driver's limit on joining it; its DataLoader workers end with it."""
    pids = tmp_path / "workers.txt"
    r = _run("lingering_thread", {"pid_file": str(pids)},
             {"micro_batch_size": 8, "num_workers": 2, "persistent_workers": True})
    assert r["status"] == "ok", r.get("reason")
    assert r["trial_wall_s"] < 10  # the driver joins a process for 10 s before it kills it
    workers = {int(p) for p in pids.read_text().split()}
    assert len(workers) == 2
    assert not [p for p in workers if running(p)]


@pytest.mark.slow
def test_oom_raise_and_hang_are_results_with_reasons():
    oom = _run("oom_above", {"max_batch": 16}, {"micro_batch_size": 32})
    assert oom["status"] == "infeasible" and oom["error_kind"] == "oom"
    assert oom["reason"].startswith("out of memory")
    bad = _run("raises_in_loss")
    assert bad["error_kind"] == "workload" and "loss raised KeyError" in bad["reason"]
    hang = _run("hangs", timeout=8)
    assert hang["error_kind"] == "timeout" and "hung" in hang["reason"]
    assert hang["trial_wall_s"] < 20


@pytest.mark.slow
def test_a_trial_launched_at_ray_s_worker_niceness_runs_at_the_users():
    """Ray starts its workers at nice 15, and a trial launched by one inherited it: then
    every default-priority process preempted it. The trial puts itself back at the niceness it is asked for
    (threads and DataLoader workers created after inherit it); where the user may not
    raise priority, a note says so."""
    import json
    import os
    import subprocess
    import sys

    code = (
        "import json, os\n"
        "from tests.helpers import FAST_MEASURE, ref\n"
        "from tuner.trial import make_request, run_isolated\n"
        "os.nice(15)  # as Ray's workers start\n"
        "r = run_isolated(make_request(workload=ref('linear'), config={'num_workers': 1},\n"
        "                 measure=FAST_MEASURE, device='cpu', nice=0), timeout_s=120)\n"
        "import sys\n"
        "print(json.dumps({'status': r['status'], 'nice': r.get('nice'), 'notes': r.get('notes'),\n"
        "                  'torch_imported': 'torch' in sys.modules}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["status"] == "ok"
    # the record is plain Python: receiving it did not import torch in this parent (a
    # TorchVersion in it once cost a Tune actor 2 s on the first trial's clock)
    assert r["torch_imported"] is False
    import resource

    if os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20:
        assert r["nice"] == 0
    else:  # an unprivileged user cannot lower niceness: said, not hidden
        assert r["nice"] == 15 and any("RAY_worker_niceness" in n for n in r["notes"])


@pytest.mark.slow
def test_a_trial_that_stops_stepping_is_hung_by_its_progress_not_the_time_limit(temp_dir):
    """Its DataLoader worker blocks for good after a few batches: recorded after
    max(measure.stall_limit_s, 10x its slowest step gap), not at the 300 s limit. The
    floor is set to 5 s here: the rule, not the default 30 s, is what is checked. The
    killed worker's multiprocessing temp dir (its listener for handing batches over),
    which its own exit would have removed, is removed too: the trial has a temp dir of
    its own here, so that what is left there is the trial's."""
    from tuner.settings import MeasureSettings
    from tuner.trial import stall_limit

    floor = MeasureSettings().stall_limit_s
    assert stall_limit([], floor) is None and stall_limit([0.1, 0.2], floor) == floor == 30.0
    assert stall_limit([5.0], floor) == 50.0 and stall_limit([0.1, 0.2], 5.0) == 5.0
    limit_s = 300
    r = _run("stalls", {"after": 60}, {"micro_batch_size": 8, "num_workers": 1}, timeout=limit_s,
             env={"TMPDIR": str(temp_dir)}, measure={**FAST_MEASURE, "stall_limit_s": 5.0})
    assert r["error_kind"] == "timeout" and r["reason"].startswith("hung: no step for"), r.get("reason")
    assert "(limit: measure.stall_limit_s" in r["reason"]  # the setting to raise is named
    # the stall is checked to the second; the whole trial, its start included, only against
    # the limit (its start takes what the tests beside it leave of the cores)
    assert 5.0 <= float(r["reason"].split("for ")[1].split(" s")[0]) < 15 and r["trial_wall_s"] < limit_s / 2
    assert not list(temp_dir.glob("pymp-*"))


@pytest.mark.slow
def test_a_first_step_that_keeps_a_core_busy_longer_than_the_idle_limit_is_no_hang():
    """Before its first step a trial is hung once its processes have done nothing for
    ``measure.idle_limit_s`` (tests/test_search.py: a DataLoader worker blocked at its
    start). A first step that keeps a core busy for longer (a long compile stands so) is
    no hang. The limit is set to 8 s here (the default, 20 s, is the same rule)."""
    busy = _run("busy_first_step", {"seconds": 8 + 10}, {"micro_batch_size": 8}, timeout=300,
                measure={**FAST_MEASURE, "idle_limit_s": 8.0})
    assert busy["status"] == "ok", busy.get("reason")


def test_kill_tree_leaves_no_child_that_was_forked_while_the_tree_was_killed():
    """A process that forks between kill_tree's listing of the tree and its kill left the
    new child re-parented to init and alive (a job's driver outliving the Ray head that
    started it). A parent that forks without pause is killed with every child it made."""
    import uuid

    import psutil

    from tuner.trial import kill_tree

    token = uuid.uuid4().hex  # marks this test's processes, the orphans included
    spawner = subprocess.Popen([sys.executable, "-c",
                                "import subprocess, sys\n"
                                "while True:\n"
                                f"    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', '{token}'])\n"])

    def ours():
        out = []
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if token in (p.info["cmdline"] or []):
                    out.append(p)
        return out

    try:
        deadline = time.time() + 30
        while len(ours()) < 20 and time.time() < deadline:
            time.sleep(0.05)
        kill_tree(spawner.pid)
        spawner.wait(timeout=10)
        psutil.wait_procs(ours(), timeout=2)
        left = ours()
        assert not left, f"{len(left)} children outlived kill_tree"
    finally:
        for p in ours():
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(Exception):
            spawner.kill()


@pytest.mark.slow
def test_a_trial_process_that_dies_is_named_and_tried_once_more():
    """Killed by a signal with no OOM kill counted by the kernel, or exited from native
    code: a death that may be chance, retried once, and named by how it ended."""
    from tuner.hardware import oom_kills

    kills = oom_kills()
    r = _run("dies", {"how": "kill"})
    assert r["status"] == "infeasible", r
    # where the OOM killer ended a process meanwhile (a test beside this one), the kill
    # reads as this trial's own, out of memory, which is all this part could check then
    if oom_kills() == kills:
        assert r["error_kind"] == "died" and r["attempts"] == 2 and r["reason"].startswith(
            "trial process died: killed by signal 9 (out of memory? "), r
    r = _run("dies", {"how": "exit"})
    assert (r["error_kind"], r["reason"], r["attempts"]) == ("died", "trial process died: exit code 3", 2)


def _in_cgroup(limit_bytes: int, workload: str, args: dict, config: dict) -> dict:
    """One trial run by a driver inside a real cgroup held to ``limit_bytes``, both of them
    in it (tests.helpers.memory_cgroup): its record's status, kind, reason and attempts."""
    from tests.helpers import memory_cgroup

    code = ("import json; from tests.helpers import FAST_MEASURE, ref; "
            "from tuner.trial import make_request, run_isolated\n"
            "if __name__ == '__main__':\n"
            f"    r = run_isolated(make_request(workload=ref({workload!r}), workload_args={args!r}, "
            f"config={config!r}, device='cpu', measure=FAST_MEASURE), timeout_s=120)\n"
            "    print(json.dumps({k: r.get(k) for k in ('status', 'error_kind', 'reason', 'attempts')}))")
    with memory_cgroup(limit_bytes) as run:
        out = run(sys.executable, "-c", code, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_trial_killed_at_its_cgroup_s_memory_limit_names_the_limit():
    """A real cgroup held to 1.5 GiB, the driver and its trial in it: a config that holds
    2 GiB is ended by the kernel's OOM killer at the limit, not at the host's RAM: out of
    memory, said with the limit (the host here has room for it), and not tried again."""
    r = _in_cgroup(3 * 2**29, "ballast", {"mb_per_sample": 256, "step_s": 0.001}, {"micro_batch_size": 8})
    assert (r["status"], r["error_kind"], r["attempts"]) == ("infeasible", "oom", 1), r
    assert r["reason"] == ("out of memory: the kernel's OOM killer ended the trial's process (this process's "
                           "cgroup holds it and the trial to 1,536 MB)"), r


@pytest.mark.slow
def test_a_dataloader_worker_killed_at_its_cgroup_s_memory_limit_is_out_of_memory():
    """The same limit, met by a DataLoader worker that keeps what it reads: PyTorch says
    only that the worker was killed; the trial's reason says it ran out of memory, and
    at which limit."""
    r = _in_cgroup(3 * 2**29, "hoarding_workers", {"mb": 64}, {"micro_batch_size": 8, "num_workers": 1})
    assert (r["status"], r["error_kind"]) == ("infeasible", "oom"), r
    assert r["reason"].startswith("out of memory: the kernel's OOM killer ended a DataLoader worker (this "
                                  "process's cgroup holds it and the trial to 1,536 MB): "), r
