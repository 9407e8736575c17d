"""The search end to end with a real local Ray, real Optuna and real torch trials."""

import io
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import FIXTURES, space_lines, torch_default_threads
from tuner import spec
from tuner.search import run_search

pytestmark = pytest.mark.slow

FAST = space_lines(max_timed_s=4)


def _space(tmp_path, text, measure=FAST):
    p = tmp_path / "space.yaml"
    p.write_text(textwrap.dedent(text) + measure)
    return spec.load(p)


@pytest.fixture(scope="module")
def _module_ray():
    import ray

    yield
    ray.shutdown()


@pytest.fixture
def ray_local(_module_ray):
    """One local Ray shared by this module's tests that can share it (a start and a
    shutdown cost ~5 s here); a test that
    needs its own Ray (``no_ray``) ends it first, and the next test starts another."""
    import ray

    if not ray.is_initialized():
        # a new Ray, as a search starts one (quiet; idle workers kept), never one a
        # developer left running from `ray start`
        from tuner.localray import start_local_ray

        start_local_ray(num_cpus=2, log_to_driver=False)
    yield ray


@pytest.fixture
def no_ray():
    """No Ray in this process: the test starts its own."""
    import ray

    ray.shutdown()


def _records(out: Path):
    return [json.loads(x) for x in (out / "trials.jsonl").read_text().splitlines()]


def test_end_to_end_on_a_builtin_workload(tmp_path, no_ray):
    space = _space(tmp_path, """\
        name: e2e
        workload: conv
        workload_args: {size: 512}
        knobs:
          precision: [fp32, bf16]
          num_workers: [0, 1]
          micro_batch_size: [32]
        budget: {trials: 3, trial_timeout_s: 120}
        confirm: {top: 1, repeats: 1}
        """, space_lines(max_timed_s=4, hot_path=True))
    summary = run_search(space, results_root=tmp_path / "results", quiet=True)
    out = tmp_path / "results" / "e2e"
    for f in ("trials.jsonl", "summary.json", "optuna.journal", "space.yaml"):
        assert (out / f).is_file(), f
    assert (out / "ray").is_dir()
    records = _records(out)
    phases = [r["phase"] for r in records]
    assert phases.count("search") == 3 and phases.count("confirm") == 1
    # the baseline is measured first, then again in the confirm round, after the contender
    assert phases[0] == "baseline" and phases[-2:] == ["confirm", "baseline"]
    assert records[-1]["confirm_round"] == records[-2]["confirm_round"] == 1
    # budget.trials counts configs: 3 tried, then the leader and the baseline confirm
    assert len(records) - 1 == 5
    # trials run at the driver's niceness (0 here), not at Ray's worker niceness (15)
    assert all(r["nice"] == 0 for r in records if r["status"] == "ok")
    # what ran beside every window was measured: the tuner's own processes among it
    assert all(r["interference_cores"] is not None and r["tuner_cpu_cores"] is not None
               for r in records if r["status"] == "ok")
    for r in records:
        assert r["hardware"]["cpu_count"] >= 1 and "config" in r
    # the first trials: PyTorch's defaults in the optimized loop, then the guides' advice
    # (bf16 only on a CPU that runs it in hardware)
    from tuner.hardware import cpu_has_bf16

    first, second = [r for r in records if r["phase"] == "search"][:2]
    assert first["config"]["precision"] == "fp32" and first["config"]["num_workers"] == 0
    assert second["config"]["num_workers"] == 1
    assert second["config"]["precision"] == ("bf16" if cpu_has_bf16() else "fp32")
    saved = json.loads((out / "summary.json").read_text())
    speedup = saved["best"]["samples_per_sec"] / saved["baseline"]["samples_per_sec"]
    assert saved["speedup_vs_baseline"] == pytest.approx(speedup)
    assert saved["best"]["speedup"] == pytest.approx(speedup) and all("speedup" in r for r in saved["top"])
    # a pick below the plain loop is said plainly, never hidden
    assert (saved["verdict"] is not None) == (speedup < 1.0)
    assert saved["best"]["measurements"] >= 2  # chosen on repeated figures
    assert saved["baseline"]["measurements"] == 2
    assert summary["trials"] == 3
    # the hot path checked once, after the search, for the baseline and the pick
    for which in ("baseline", "pick"):
        assert saved["hot_path"][which]["findings"] == [], saved["hot_path"]
    assert saved["hot_path"]["pick"]["compile"] == saved["best"]["config"]["compile"]
    from tuner.results import open_results
    from tuner.tables import print_show

    shown = io.StringIO()
    print_show(open_results(out), out=shown)
    assert "no hot-path defects found" in shown.getvalue()
    # Optuna's own tools open the study
    import optuna

    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(out / "optuna.journal")))
    study = optuna.load_study(study_name="e2e", storage=storage)
    assert len(study.trials) == 3
    # a second run of the same name refuses and points at resume
    from tuner.errors import UserError

    with pytest.raises(UserError, match="already exist.*resume"):
        run_search(space, results_root=tmp_path / "results", quiet=True)


def test_faulty_trials_are_recorded_and_the_search_finishes(tmp_path, ray_local, monkeypatch):
    # the limit ends the trials that hang; the others, their starts slowed by the tests
    # beside this one, must end within it
    space = _space(tmp_path, f"""\
        name: faults
        workload: {FIXTURES}:faulty
        workload_args: {{oom_above: 32, hang_at: 8}}
        knobs:
          micro_batch_size: [8, 16, 64]
          precision: [fp32, fp16]
        sampler: grid
        baseline: {{micro_batch_size: 16}}
        budget: {{trials: 6, trial_timeout_s: 20}}
        confirm: {{top: 0}}
        """)
    # the driver's temporary folders in one of the test's own: a search run beside this one
    # (another test run, a developer's own) makes its own in the shared /tmp
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(own_tmp))
    summary = run_search(space, results_root=tmp_path / "r", quiet=True)
    assert ray_local.is_initialized()  # the caller's Ray: run_search leaves it running
    records = [r for r in _records(tmp_path / "r" / "faults") if r["phase"] == "search"]
    assert len(records) == 6
    by = {(r["config"]["micro_batch_size"], r["config"]["precision"]): r for r in records}
    assert by[(64, "fp32")]["reason"].startswith("out of memory")
    assert by[(8, "fp32")]["reason"].startswith("hung")
    assert "non-finite" in by[(16, "fp16")]["reason"]
    assert by[(16, "fp32")]["status"] == "ok"
    assert summary["best"]["config"]["micro_batch_size"] == 16
    assert summary["best"]["config"]["precision"] == "fp32"
    assert len(summary["infeasible"]) == 5
    # the trials' folders are named for their knobs (not for the Board's state they got)
    folders = [p.name for p in (tmp_path / "r" / "faults" / "ray").iterdir() if p.is_dir()]
    searched = [f for f in folders if "_search_" in f]
    assert len(searched) == 6 and all("micro_batch_size=" in f for f in searched)
    assert len(folders) == 7  # and the baseline's
    assert all(r["driver_asleep"] for r in records if r["status"] == "ok")  # its loop slept through windows
    # nothing of the search outlives it: no folder of marks (measure.hushed)
    assert not list(own_tmp.glob("tuner-hush-*"))


@pytest.mark.alone  # the order of sleep-bound rates
def test_screened_trials_in_a_row_send_the_incumbent_to_be_measured_again(tmp_path, ray_local):
    # sleep-bound: samples/s follows the micro-batch, so the first (8) leads and each
    # smaller one is screened out against it; after each, the incumbent is re-measured
    space = _space(tmp_path, f"""\
        name: recheck
        workload: {FIXTURES}:sleepy
        workload_args: {{step_s: 0.01}}
        knobs:
          micro_batch_size: [8, 2, 3]
        sampler: grid
        budget: {{trials: 3, trial_timeout_s: 60}}
        confirm: {{top: 0}}
        """, space_lines(max_timed_s=4, recheck_after=1))
    summary = run_search(space, results_root=tmp_path / "r", quiet=True)
    records = _records(tmp_path / "r" / "recheck")
    phases = [(r["phase"], r["config"]["micro_batch_size"]) for r in records]
    assert phases[0][0] == "baseline"
    assert phases[1:] == [("search", 8), ("search", 2), ("recheck", 8), ("search", 3)], phases
    assert records[2]["screened"] and records[4]["screened"]
    assert records[3]["key"] == records[1]["key"] and not records[3].get("screened")
    assert summary["best"]["config"]["micro_batch_size"] == 8 and summary["best"]["measurements"] == 2
    assert [r["trial_number"] for r in records if r["phase"] == "search"] == [0, 1, 2]


def test_two_objectives_write_a_pareto_front_and_a_memory_cap_excludes(tmp_path, ray_local):
    text = f"""\
        name: pareto
        workload: {FIXTURES}:ballast
        workload_args: {{mb_per_sample: 8}}
        knobs:
          micro_batch_size: [4, 32]
        objective: {{metric: samples_per_sec, memory: true}}
        sampler: grid
        budget: {{trials: 2, trial_timeout_s: 60}}
        """
    summary = run_search(_space(tmp_path, text), results_root=tmp_path / "r", quiet=True)
    front = summary["pareto"]
    assert [r["config"]["micro_batch_size"] for r in front] == [4, 32]  # low memory first
    assert front[0]["memory_mb"] < front[1]["memory_mb"] and front[0]["samples_per_sec"] < front[1]["samples_per_sec"]
    cap = (front[0]["memory_mb"] + front[1]["memory_mb"]) / 2
    capped = _space(tmp_path, text.replace("name: pareto", "name: capped") + f"constraints: {{max_memory_mb: {cap}}}\n")
    summary = run_search(capped, results_root=tmp_path / "r", quiet=True)
    assert [r["config"]["micro_batch_size"] for r in summary["pareto"]] == [4]
    assert any("exceeds max_memory_mb" in r["reason"] for r in summary["infeasible"])


def test_a_local_ray_starts_without_the_parts_a_search_never_reads(no_ray):
    """No log monitor (it reads Ray's log files every 0.1 s, for drivers that want
    workers' output; a search does not), no autoscaler monitor, no dashboard head where
    no trial has ranks, metrics off, the raylet's timers rarer: CPU beside every trial
    otherwise."""
    import base64
    import json
    import os

    import psutil
    import ray

    from tuner.localray import QUIET_RAY_CONFIG, QUIET_RAY_ENV, start_local_ray

    unset = [k for k in QUIET_RAY_ENV if k not in os.environ]
    start_local_ray(num_cpus=1, log_to_driver=False, state_api=False)
    try:
        assert ray.get(ray.remote(lambda: 7).remote()) == 7
        # this session's processes: those of a Ray an earlier test in this process ended
        # may still be on their way out (seen: its dashboard, under the parallel suite)
        session = os.path.basename(ray._private.worker._global_node.get_session_dir_path())
        ours = []
        for p in psutil.Process().children(recursive=True):
            try:
                if session in " ".join(p.cmdline()):
                    ours.append(p)
            except psutil.Error:
                pass
        cmds = [" ".join(p.cmdline()) for p in ours]
        assert any("gcs_server" in c for c in cmds) and any("raylet" in c for c in cmds)
        assert not [c for c in cmds if "log_monitor.py" in c or "autoscaler/_private/monitor.py" in c]
        assert not [c for c in cmds if "dashboard/dashboard.py" in c]  # no head process without ranks
        node = ray._private.worker._global_node  # the config the head was started with
        assert all(node._config.get(k) == v for k, v in QUIET_RAY_CONFIG.items())
        # ...and the GCS, from which the raylet and every worker take theirs
        gcs = next(p for p in ours if "gcs_server" in p.name())
        given = next(a.split("=", 1)[1] for a in gcs.cmdline() if a.startswith("--config_list="))
        assert json.loads(base64.b64decode(given)).items() >= QUIET_RAY_CONFIG.items()
        # the raylet starts the agents in the environment it got (an agent's own environ
        # cannot be read back: its process title is written over that memory)
        raylet = next(p for p in ours if p.name() == "raylet")
        assert {k: raylet.environ().get(k) for k in QUIET_RAY_ENV} == {k: os.environ[k] for k in QUIET_RAY_ENV}
    finally:
        ray.shutdown()
        for k in unset:  # this process's environment as it was, for the tests after
            os.environ.pop(k, None)
    from ray._private import node, parameter

    # put back for whoever starts Ray next
    assert parameter.RayParams.__name__ == "RayParams" and node.Node.start_api_server.__name__ == "start_api_server"


def test_tune_s_trials_measure_in_the_worker_that_measured_the_baseline(tmp_path, ray_local):
    """Tune's trials hand their measurements to an idle worker of their node, the
    baseline's, rather than start their processes from each trial's actor: one parent,
    one environment for every measurement of the search."""
    where = tmp_path / "where"
    space = _space(tmp_path, f"""\
        name: where
        workload: {FIXTURES}:started_as
        workload_args: {{path: "{where}"}}
        knobs:
          micro_batch_size: [4, 8]
        sampler: grid
        budget: {{trials: 2}}
        confirm: {{top: 0}}
        """)
    summary = run_search(space, results_root=tmp_path / "r", quiet=True)
    assert summary["trials"] == 2
    started = [json.loads(line) for line in where.read_text().splitlines()]
    servers = [s["ppid"] for s in started]
    # the baseline's and both trials' (no hot-path check after them: hot_path is false)
    assert len(servers) == 3 and len(set(servers)) == 1, servers
    # started from a Ray worker, the trial's process does not run Ray's worker script
    # again (a spawned child's re-run of its parent's main), so it holds no Ray
    assert not any(s["ray_imported"] for s in started), started


def _pid() -> int:
    import os

    return os.getpid()


def test_the_worker_that_measured_the_baseline_outlives_the_tune_run(ray_local):
    """Idle while two actors (Tune's trials) hold the cores, the worker that ran a task
    (the baseline) is still there for the next (the confirm rounds): a Ray with its
    default settings ends an idle worker beyond one per CPU
    after 1 s, and the next task started a new one."""
    first = ray_local.get(ray_local.remote(num_cpus=2)(_pid).remote())

    @ray_local.remote(num_cpus=1)
    class Trial:
        def pid(self) -> int:
            return _pid()

    trials = [Trial.remote() for _ in range(2)]
    assert first not in ray_local.get([t.pid.remote() for t in trials])
    time.sleep(3)  # the raylet looks for idle workers to end every second
    for t in trials:
        ray_local.kill(t)
    assert ray_local.get(ray_local.remote(num_cpus=2)(_pid).remote()) == first


@pytest.fixture(scope="module")
def logical_gpu_cluster():
    """Two nodes of 3 CPUs and 2 logical GPUs each (Ray's num_gpus on a CPU machine: the
    trials' torch runs on the CPU), shared by the placement tests (a start and shutdown of two nodes costs
    ~15 s here)."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # a shared local Ray: the placement tests' driver joins this cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "num_gpus": 2})
    cluster.add_node(num_cpus=3, num_gpus=2)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _sleepy_search(tmp_path, cluster, name: str, rest: str) -> list[dict]:
    space = _space(tmp_path, f"name: {name}\nworkload: {FIXTURES}:sleepy\nworkload_args: {{step_s: 0.01}}\n"
                   f"sampler: grid\nconfirm: {{top: 0}}\n" + textwrap.dedent(rest))
    summary = run_search(space, results_root=tmp_path / "r", address=cluster.address, quiet=True)
    assert summary["device"] == "cuda"
    return [r for r in _records(tmp_path / "r" / name) if r["phase"] == "search"]


@pytest.mark.parametrize("user_threads", ["1", None])
def test_a_trial_without_torch_threads_runs_the_threads_the_user_s_own_run_gets(tmp_path, ray_local, monkeypatch,
                                                                                 user_threads):
    """The baseline (a plain PyTorch loop) and any config that leaves ``torch_threads``
    unset run with the user's threads: the OMP_NUM_THREADS the search started with, else
    PyTorch's own choice (physical cores, where there are fewer than logical ones), at
    most the CPUs the trial reserved. Ray gives its workers an OMP_NUM_THREADS of its own;
    the trials took the reserved CPUs, whatever the user had set."""
    if user_threads:
        monkeypatch.setenv("OMP_NUM_THREADS", user_threads)
        expected = 1
    else:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        expected = min(2, torch_default_threads())  # ray_local's 2 CPUs, each trial's alone
    space = _space(tmp_path, f"""\
        name: threads
        workload: {FIXTURES}:sleepy
        workload_args: {{step_s: 0.01}}
        knobs:
          micro_batch_size: [4, 8]
        sampler: grid
        budget: {{trials: 2}}
        confirm: {{top: 0}}
        """)
    run_search(space, results_root=tmp_path / "r", quiet=True)
    records = _records(tmp_path / "r" / "threads")
    assert {r["phase"] for r in records} >= {"baseline", "search"}
    assert [r["intra_op_threads"] for r in records] == [expected] * len(records), records


def test_the_tuner_s_own_processes_are_ray_s_daemons_and_agents_and_not_its_workers(ray_local):
    """The CPU they use beside a trial is reported as the tuner's own, and they run at a
    lower priority than the trial. Ray's agents take a "ray::" title as its workers do:
    they were once taken for workers, left at nice 0 and counted as interference."""
    import os

    import psutil

    from tuner.localray import tuner_processes

    @ray_local.remote
    class Worker:
        def pid(self) -> int:
            return os.getpid()

    worker = ray_local.get(Worker.remote().pid.remote())

    def by_name() -> dict:
        return {q.name(): q.pid for q in psutil.Process().children(recursive=True)}

    deadline = time.time() + 20  # the raylet starts its agents in the background
    while "ray::DashboardAgent" not in by_name() and time.time() < deadline:
        time.sleep(0.5)
    agent = by_name()["ray::DashboardAgent"]
    # the driver's own child, not Ray's (a notebook's, a script's; truth.py's plain loop
    # beside a trial was once lowered to SCHED_IDLE and counted as the tuner's CPU)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pids = tuner_processes(local=True)
        assert other.pid not in pids and os.sched_getscheduler(other.pid) == os.SCHED_OTHER
    finally:
        other.kill()
        other.wait()
    names = {psutil.Process(p).name() for p in pids}
    assert os.getpid() in pids and {"gcs_server", "raylet", "ray::DashboardAgent"} <= names
    assert worker not in pids  # a worker runs the trials: never lowered, never counted as the tuner's
    # lower than the trial: they run on a core it leaves idle, and never preempt it
    assert os.sched_getscheduler(agent) == os.SCHED_IDLE and psutil.Process(agent).nice() >= 10
    assert os.sched_getscheduler(worker) == os.SCHED_OTHER and psutil.Process(worker).nice() != 10
    assert psutil.Process(by_name()["raylet"]).nice() == 0  # its workers, trials among them, inherit it


def test_a_sigterm_that_lands_while_ray_waits_still_reads_as_sigterm(ray_local):
    """The command's handler raises Stopped(SIGTERM); where the main thread is inside
    ``ray.get`` then, Ray's signal check swaps it for a bare KeyboardInterrupt. The search
    once exited 130 ("stopped (SIGINT)") for a scheduler's SIGTERM that landed there."""
    import os
    import signal
    import threading

    from tuner.cli import _stop_on_signals
    from tuner.errors import Stopped

    @ray_local.remote
    def wait() -> None:
        time.sleep(20)

    restore = _stop_on_signals()
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        ref = wait.remote()
        timer.start()
        with pytest.raises(KeyboardInterrupt) as caught:
            ray_local.get(ref, timeout=30)
        assert Stopped.signal_of(caught.value) == signal.SIGTERM
    finally:
        timer.cancel()
        restore()
        Stopped.received = None
        ray_local.shutdown()  # the task still sleeps: the next test gets a Ray of its own


def test_what_the_driver_writes_as_ray_shuts_down_goes_to_a_log_not_the_terminal(tmp_path, no_ray, capfd,
                                                                                  monkeypatch):
    """A stopped search says one line. A trial cut by the stop fails as the GCS goes, and
    the driver's core worker then writes "Failed to push error to driver" to file
    descriptor 2 from C++, above that line (seen under load in the stop test of
    test_results.py). That line comes only in a race, so it is written here as the core
    worker writes it, to descriptor 2, from inside a real Ray's shutdown."""
    import os

    import ray

    from tuner.localray import shutdown_ray, start_local_ray

    start_local_ray(num_cpus=1, log_to_driver=False, state_api=False)
    real = ray.shutdown

    def with_the_core_worker_s_line() -> None:
        os.write(2, b"[E task_manager.cc] Failed to push error to driver for task d695\n")
        real()

    monkeypatch.setattr(ray, "shutdown", with_the_core_worker_s_line)
    shutdown_ray(tmp_path / "ray-shutdown.log")
    assert not ray.is_initialized()
    os.write(2, b"stopped (SIGINT)\n")  # the command's own line, after
    # (not the whole of fd 2: under -n, a Ray Tune SIGINT handler an earlier in-process
    # search of this worker left behind once logged its own error here)
    err = capfd.readouterr().err
    assert "Failed to push error" not in err and err.endswith("stopped (SIGINT)\n")
    assert "Failed to push error" in (tmp_path / "ray-shutdown.log").read_text()
    monkeypatch.undo()
    shutdown_ray(tmp_path / "quiet.log")  # nothing written: no file left behind
    assert not (tmp_path / "quiet.log").exists()


@pytest.mark.alone  # three nodes on two cores
def test_placement_on_logical_gpus_across_two_nodes(tmp_path, logical_gpu_cluster, capsys):
    records = _sleepy_search(tmp_path, logical_gpu_cluster, "placement", """\
        knobs:
          num_workers: [0, 1]
          micro_batch_size: [4, 8]
        budget: {trials: 4, trial_timeout_s: 60}
        """)
    assert len(records) == 4
    for r in records:
        assert len(r["gpu_ids"]) == 1 and r["node"]
        assert r["cpus_reserved"] == 1 + r["config"]["num_workers"]
    slots = {}
    for r in records:
        slots.setdefault((r["node"], r["gpu_ids"][0]), []).append((r["started_at"], r["ended_at"]))
    for intervals in slots.values():
        intervals.sort()
        for (_, end), (start, _) in zip(intervals, intervals[1:], strict=False):
            assert start >= end - 0.05, "two trials shared a GPU"
    assert len({r["node"] for r in records}) == 2  # both nodes ran trials
    # a worker takes a trial past its share of a node (3 cores over its 2 GPUs' trials), and is named
    err = capsys.readouterr().err
    assert ("note: knobs.num_workers: 1 DataLoader workers need more than a trial's share of the node's cores "
            "(3 over 2 trials at once: 1 each") in err
    # a node's 3 logical CPUs are more than a process on this machine can use, and said so
    from tuner.hardware import usable_cores

    if usable_cores() < 3:
        assert f"note: Ray counts 3 CPUs on a node where a trial's process can use {usable_cores()}" in err


@pytest.mark.alone  # two ranks per trial, two trials at once
def test_two_rank_trials_run_at_once_and_never_share_a_logical_gpu(tmp_path, logical_gpu_cluster):
    """Each rank gets its own GPU id, the ranks of a trial stay on one node, and two
    2-rank trials run at once on different GPUs (gloo: logical GPUs have no CUDA)."""
    a, b = _sleepy_search(tmp_path, logical_gpu_cluster, "ranks", """\
        knobs:
          world_size: [2]
          micro_batch_size: [4, 8]
        baseline: {world_size: 1}
        budget: {trials: 2, trial_timeout_s: 120}
        """)
    assert a["status"] == b["status"] == "ok", (a.get("reason"), b.get("reason"))
    slots = []
    for r in (a, b):
        assert len(r["ranks"]) == 2 and all(len(x["gpu_ids"]) == 1 for x in r["ranks"])
        assert len({x["node"] for x in r["ranks"]}) == 1  # one node unless spread_ranks
        slots.append({(x["node"], x["gpu_ids"][0]) for x in r["ranks"]})
        assert len(slots[-1]) == 2
    assert a["started_at"] < b["ended_at"] and b["started_at"] < a["ended_at"]  # at once
    assert not slots[0] & slots[1]  # no GPU given to both


def test_the_replay_decides_as_the_live_search_did(tmp_path, ray_local):
    """``benchmarks/search_replay.py --check-live`` feeds a finished search's records to the
    policy in the order they landed: the same configs, thresholds, confirm rounds and pick.
    A folder whose records say otherwise fails at its first difference."""
    import shutil

    # sleep-bound: the micro-batch sets the rate, the fused optimizer does not, so the
    # batch of 2 is screened out against 8; the confirm rounds meet a machine that slowed
    # after the search, so the noise between repeats is wide and both batches of 8, alike
    # in every round, race through both rounds
    trials = tmp_path / "r" / "live" / "trials.jsonl"
    space = _space(tmp_path, f"""\
        name: live
        workload: {FIXTURES}:drifting
        workload_args: {{records: "{trials}", step_s: 0.01}}
        knobs:
          micro_batch_size: [8, 2]
          fused_optimizer: [false, true]
        budget: {{trials: 4, trial_timeout_s: 60}}
        confirm: {{top: 2, repeats: 2}}
        """, space_lines(max_timed_s=4, recheck_after=1))
    run_search(space, results_root=tmp_path / "r", quiet=True)
    out = tmp_path / "r" / "live"
    records = _records(out)
    assert any(r.get("screened") for r in records)
    assert {r.get("confirm_round") for r in records} >= {1, 2}
    check = [sys.executable, str(Path(__file__).parent.parent / "benchmarks" / "search_replay.py"), "--check-live"]
    r = subprocess.run([*check, str(out)], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the same" in r.stdout
    # the same folder with one threshold that the policy would not have given
    forged = tmp_path / "forged"
    shutil.copytree(out, forged)
    held = next(r for r in records if r.get("screen"))
    held["screen"] = {**held["screen"], "below": held["screen"]["below"] * 2}
    (forged / "trials.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    r = subprocess.run([*check, str(forged)], capture_output=True, text=True, timeout=180)
    assert r.returncode == 1 and "screening threshold" in r.stdout, r.stdout + r.stderr


def test_a_trial_hung_at_its_first_batch_costs_seconds_and_its_like_are_not_run(tmp_path, ray_local):
    """DataLoader workers that block for good at their start, in a search over the worker
    count: the hung trial is found idle before its first step, the configs that differ
    from it only in knobs that cannot matter to a loader's hang are not run, and the search
    picks its winner in less time than the trial limit alone would have cost.
    The idle wait is what the space sets (``measure.idle_limit_s``, lowered from its
    default here), and is checked to the second; the bounds on the walls are loose, since
    a trial's start (torch imported, the workload built, its workers spawned) takes what
    the tests beside it leave of the cores."""
    limit_s, idle_s = 300, 8.0
    space = _space(tmp_path, f"""\
        name: hangs
        workload: {FIXTURES}:hangs_in_workers
        workload_args: {{workers: 2}}
        knobs:
          num_workers: [0, 2]
          fused_optimizer: [false, true]
          micro_batch_size: [8]
        budget: {{trials: 4, trial_timeout_s: {limit_s}}}
        confirm: {{top: 1, repeats: 1}}
        """, space_lines(max_timed_s=4, idle_limit_s=idle_s))
    t0 = time.time()
    summary = run_search(space, results_root=tmp_path / "r", quiet=True)
    assert time.time() - t0 < limit_s  # the hung trial alone would have cost it
    records = _records(tmp_path / "r" / "hangs")
    hung = [r for r in records if r.get("hung_phase")]
    assert len(hung) == 1 and hung[0]["config"]["num_workers"] == 2
    assert hung[0]["hung_phase"] == "waiting for the first batch" and "measure.idle_limit_s" in hung[0]["reason"]
    # found at the space's limit, not the default's 20 s
    assert idle_s <= hung[0]["hung_wait_s"] < idle_s + 10 and hung[0]["trial_wall_s"] < limit_s / 2
    # the other config with 2 workers differs from it in the fused optimizer alone
    skipped = [r for r in records if r.get("skipped")]
    assert len(skipped) == 1 and skipped[0]["config"]["num_workers"] == 2, records
    assert "not run: hung as a config with the same micro_batch_size=8, num_workers=2 did" in skipped[0]["reason"]
    assert summary["best"]["config"]["num_workers"] == 0
    # the hung config is never a confirm contender
    assert all(r["config"]["num_workers"] == 0 for r in records if r.get("phase") == "confirm")
    # the policy, replayed on these records, decides the same (the skip included)
    check = [sys.executable, str(Path(__file__).parent.parent / "benchmarks" / "search_replay.py"), "--check-live"]
    r = subprocess.run([*check, str(tmp_path / "r" / "hangs")], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
