"""A node lost mid-search: a real multi-node Ray (``ray.cluster_utils.Cluster``), a node
removed while it runs a trial."""

import subprocess
import sys
import time

import pytest

from tests.helpers import FIXTURES
from tests.test_search import _records, _space
from tuner.search import run_search

pytestmark = pytest.mark.slow


def test_a_trial_whose_node_is_lost_is_recorded_and_run_again_on_another(tmp_path, monkeypatch):
    """The node running a trial goes away mid-trial (its raylet and workers killed, as a
    machine that drops off): the trial is recorded as lost with Ray's reason, Tune runs it
    again on a node that joined meanwhile, the search completes, and ``show`` says what
    happened. (The search runs in a thread: Ray starts nodes from the main thread only.)"""
    import threading

    import ray
    from ray.cluster_utils import Cluster

    # the head has no GPU: every trial runs on a GPU node, and the first is the one lost
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    doomed = cluster.add_node(num_cpus=2, num_gpus=1)
    out = tmp_path / "r" / "lost"
    space = _space(tmp_path, f"""\
        name: lost
        workload: {FIXTURES}:sleepy
        workload_args: {{step_s: 0.05}}
        knobs:
          micro_batch_size: [4, 8, 16]
        sampler: grid
        confirm: {{top: 0}}
        budget: {{trials: 3, trial_timeout_s: 120}}
        """, measure="measure: {warmup_steps: 2, window_s: 0.5, min_windows: 10, max_windows: 10, max_timed_s: 10}\n")
    monkeypatch.setenv("TUNE_DISABLE_SIGINT_HANDLER", "1")
    ray.shutdown()  # a session another test left: this test's driver joins its own cluster
    ray.init(address=cluster.address, log_to_driver=False)
    outcome: dict = {}

    def search() -> None:
        try:
            outcome["summary"] = run_search(space, results_root=tmp_path / "r", address=cluster.address, quiet=True)
        except BaseException as exc:  # noqa: BLE001 -- handed to the test's thread
            outcome["error"] = exc

    searcher = threading.Thread(target=search, daemon=True)
    searcher.start()
    try:
        # once the first search trial is recorded, the second is under way (~6 s long)
        deadline = time.time() + 180
        while time.time() < deadline and not (out / "trials.jsonl").exists() or \
                not any(r["phase"] == "search" for r in _records(out)):
            assert time.time() < deadline and searcher.is_alive(), outcome
            time.sleep(0.1)
        time.sleep(1.5)
        cluster.add_node(num_cpus=2, num_gpus=1)
        lost_at = time.time()
        cluster.remove_node(doomed, allow_graceful=False)
        searcher.join(timeout=300)
        assert not searcher.is_alive() and "error" not in outcome, outcome
        records = _records(out)
        lost = [r for r in records if r["phase"] == "lost"]
        assert len(lost) == 1, [r["phase"] for r in records]
        assert lost[0]["reason"].startswith("lost:") and "tried again" in lost[0]["reason"]
        # the lost config was measured again, on the node that joined
        search = [r for r in records if r["phase"] == "search" and r["status"] == "ok"]
        assert {r["config"]["micro_batch_size"] for r in search} == {4, 8, 16}
        again = next(r for r in search
                     if r["config"]["micro_batch_size"] == lost[0]["config"]["micro_batch_size"])
        assert again["started_at"] >= lost_at - 1 and again["node"] != doomed.unique_id
        assert outcome["summary"]["trials"] == 3
        shown = subprocess.run([sys.executable, "-m", "tuner", "show", str(out)], capture_output=True, text=True)
        assert shown.returncode == 0 and "lost: " in shown.stdout
    finally:
        ray.shutdown()
        cluster.shutdown()
