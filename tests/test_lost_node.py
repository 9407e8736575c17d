"""Nodes lost mid-search: a real multi-node Ray (``ray.cluster_utils.Cluster``), nodes
removed (raylet and workers killed, as a machine that drops off) while they run a trial,
while they are idle, and until no node a trial fits on is left."""

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import FIXTURES, space_lines
from tests.test_search import _records, _space
from tuner.errors import ClusterShrunk
from tuner.search import run_search

pytestmark = pytest.mark.slow


def _in_thread(outcome: dict, **kwargs) -> threading.Thread:
    """The search runs in a thread: Ray starts and removes nodes from the main thread only."""

    def search() -> None:
        try:
            outcome["summary"] = run_search(**kwargs)
        except BaseException as exc:  # noqa: BLE001 -- handed to the test's thread
            outcome["error"] = exc

    searcher = threading.Thread(target=search, daemon=True)
    searcher.start()
    return searcher


def _wait(searcher: threading.Thread, outcome: dict, until, out: Path, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while not until():
        assert time.time() < deadline and searcher.is_alive(), (outcome, _told(out))
        time.sleep(0.1)


def _told(out: Path) -> str:
    """What each record says, for a failed assertion."""
    if not (out / "trials.jsonl").exists():
        return "no records"
    return "; ".join(f"{r['phase']}/{r['status']} mb={r['config'].get('micro_batch_size')} {r.get('reason', '')}"
                     for r in _records(out))


def test_nodes_lost_during_a_search_idle_mid_trial_and_all_of_them(tmp_path, monkeypatch):
    """Each trial needs a GPU node (the head has none), one trial at a time:

    1. while the second trial runs, the other GPU node (idle) is lost: the search goes on;
    2. the node running that trial is lost mid-trial, a new node having joined: the trial
       is recorded as lost with Ray's reason and run again on the new node;
    3. then the last GPU node is lost: no node can hold a trial, and after
       ``trial_timeout_s`` the search stops (``ClusterShrunk``, exit 5) with one line that
       says what a trial needs and how to resume, everything measured kept;
    4. a GPU node joins and ``resume`` completes the search, nothing measured twice;
       ``show`` says what happened."""
    import ray
    from ray._private.state import available_resources_per_node
    from ray.cluster_utils import Cluster

    # Ray declares a node dead after missed health checks (by default 5 of one every 3 s,
    # over 15 s per lost node): checked every second here, a lost node is seen in ~3 s,
    # and a live one whose raylet a loaded machine slows for a moment is not taken for lost.
    quick_death = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "_system_config": quick_death})
    gpu_nodes = {n.node_id: n for n in (cluster.add_node(num_cpus=2, num_gpus=1) for _ in range(2))}
    out = tmp_path / "r" / "lost"
    limit_s = 90
    space = _space(tmp_path, f"""\
        name: lost
        workload: {FIXTURES}:sleepy
        workload_args: {{step_s: 0.05}}
        knobs:
          micro_batch_size: [2, 4, 8, 16]
        sampler: grid
        confirm: {{top: 0}}
        resources: {{max_concurrent: 1}}
        budget: {{trials: 4, trial_timeout_s: {limit_s}}}
        """,  # 16 windows of 0.3 s: a trial still runs after the idle node is lost and a node joins;
        # its process's start and warm-up double that beside other tests on 2 cores (11-13 s in
        # all beside one), and the first trial, on nodes whose workers are still starting, passed
        # 45 s beside two; a trial cut off by the limit is never run again, so it leaves room
        measure=space_lines(window_s=0.3, min_windows=16, max_windows=16, max_timed_s=10))
    monkeypatch.setenv("TUNE_DISABLE_SIGINT_HANDLER", "1")
    ray.shutdown()  # a session another test left: this test's driver joins its own cluster
    ray.init(address=cluster.address, log_to_driver=False)

    def searched() -> list[dict]:
        return [r for r in _records(out) if r["phase"] == "search"] if (out / "trials.jsonl").exists() else []

    try:
        outcome: dict = {}
        searcher = _in_thread(outcome, space=space, results_root=tmp_path / "r", address=cluster.address, quiet=True)

        # 1. the first search trial recorded, the second under way (~6 s): its node holds
        #    its GPU; the other GPU node is idle and is lost
        def busy() -> set:
            free = available_resources_per_node()
            return {i for i in gpu_nodes if free.get(i, {}).get("GPU", 0) < 1}  # Ray leaves out what is 0

        _wait(searcher, outcome, lambda: searched() and len(busy()) == 1, out, timeout_s=limit_s + 120)
        [running] = busy()
        [idle] = set(gpu_nodes) - {running}
        cluster.remove_node(gpu_nodes.pop(idle), allow_graceful=False)

        # 2. a node joins, and the node running the trial is lost
        joined = cluster.add_node(num_cpus=2, num_gpus=1)
        time.sleep(1.0)
        lost_at = time.time()
        cluster.remove_node(gpu_nodes.pop(running), allow_graceful=False)
        _wait(searcher, outcome, lambda: len([r for r in searched() if r["status"] == "ok"]) >= 2, out)

        # 3. the last GPU node is lost: nothing can hold a trial
        cluster.remove_node(joined, allow_graceful=False)
        shrunk_at = time.time()
        searcher.join(timeout=limit_s + 75)
        assert not searcher.is_alive(), "the search still waits for a node"
        error = outcome.get("error")
        assert isinstance(error, ClusterShrunk), outcome
        assert time.time() - shrunk_at >= limit_s  # it waited trial_timeout_s for a node to come back
        message = str(error)
        assert "\n" not in message and "GPU 1" in message and f"tuner resume {out}" in message
        records = _records(out)
        lost = [r for r in records if r["phase"] == "lost"]
        # lost, then run again; or, when the node it was run again on went too, left to resume
        assert lost and all(r["reason"].startswith("lost:") and ("tried again" in r["reason"] or
                                                                 "run again on resume" in r["reason"]) for r in lost)
        ok = [r for r in records if r["phase"] == "search" and r["status"] == "ok"]
        retried = next(r for r in ok if r["key"] == lost[0]["key"])
        assert retried["started_at"] >= lost_at - 1 and retried["node"] == joined.node_id
        assert 2 <= len(ok) < 4

        # 4. a node is back: resume completes the budget, nothing measured twice
        cluster.add_node(num_cpus=2, num_gpus=1)
        outcome = {}
        searcher = _in_thread(outcome, space=space, results_root=tmp_path / "r", address=cluster.address,
                              resume=True, quiet=True)
        searcher.join(timeout=180)
        assert not searcher.is_alive() and "error" not in outcome, outcome
        ok = [r for r in _records(out) if r["phase"] == "search" and r["status"] == "ok"]
        assert sorted(r["config"]["micro_batch_size"] for r in ok) == [2, 4, 8, 16], _told(out)
        assert outcome["summary"]["trials"] == 4
        shown = subprocess.run([sys.executable, "-m", "tuner", "show", str(out)], capture_output=True, text=True)
        assert shown.returncode == 0 and "lost: " in shown.stdout
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_trial_ray_s_memory_monitor_ends_stops_the_search_in_one_line_and_a_local_ray_has_no_monitor(tmp_path):
    """A cluster whose nodes run Ray's memory monitor (its threshold just above what this
    machine uses now) meets a config that holds 4 GB: the monitor ends the trial's workers,
    and Ray Tune stops on that error. The search says so in one line (exit 5) with what to
    do, keeps what it measured, and records the config as out of memory, so that
    ``resume`` does not run it again. The tuner's own local Ray runs without the monitor:
    the same config, under the same threshold, is measured."""
    import os

    import psutil
    from ray.cluster_utils import Cluster

    memory = psutil.virtual_memory()
    if memory.available < 10 * 2**30:
        pytest.skip("the monitor is set 3 GB above what is in use, and the config needs room past it")
    threshold = (memory.total - memory.available + 3 * 2**30) / memory.total  # Ray and a trial: ~1.5 GB

    def space(name: str) -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(textwrap.dedent(f"""\
            name: {name}
            workload: {FIXTURES}:ballast
            workload_args: {{mb_per_sample: 256, step_s: 0.01}}
            knobs:
              micro_batch_size: [1, 16]
            sampler: grid
            confirm: {{top: 0}}
            resources: {{max_concurrent: 1}}
            budget: {{trials: 2, trial_timeout_s: 120}}
            """) + space_lines(window_s=0.2, min_windows=3, max_windows=3))
        return path

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "_system_config": {"memory_usage_threshold": threshold, "memory_monitor_refresh_ms": 250}})
    try:
        run = subprocess.run([sys.executable, "-m", "tuner", "run", str(space("monitored")), "--results",
                              str(tmp_path / "r"), "--address", cluster.address], capture_output=True, text=True,
                             timeout=300)
    finally:
        cluster.shutdown()
    out = tmp_path / "r" / "monitored"
    said = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 5 and said.startswith("error: Ray's memory monitor ended the trial of micro_batch_size=16 "
                                                   "(recorded as out of memory): the node's memory was "), run.stderr
    assert f"python -m tuner resume {out}" in said and "RAY_memory_monitor_refresh_ms=0" in said
    records = _records(out)
    [killed] = [r for r in records if r["config"].get("micro_batch_size") == 16]
    assert (killed["status"], killed["error_kind"]) == ("infeasible", "oom"), killed
    assert any(r["status"] == "ok" for r in records)  # the baseline, measured before, is kept

    env = {**os.environ, "RAY_memory_usage_threshold": f"{threshold:.3f}"}
    local = subprocess.run([sys.executable, "-m", "tuner", "run", str(space("local")), "--results",
                            str(tmp_path / "r")], capture_output=True, text=True, timeout=300, env=env)
    assert local.returncode == 0, local.stderr
    assert [r["status"] for r in _records(tmp_path / "r" / "local")
            if r["config"].get("micro_batch_size") == 16] == ["ok"]
