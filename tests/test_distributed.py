"""Trials over several data-parallel ranks, through Ray Train (gloo on this CPU machine):
the DDP knobs reach torch, the ranks agree on every window, a rank's error names the
rank, and the figures are global."""

import json
import time

import pytest

from tests.helpers import FAST_MEASURE, ref
from tuner.distributed import ranks_fit, run_ranks
from tuner.loop import EpochSampler, GroupedBatchSampler
from tuner.records import scaling_efficiency
from tuner.trial import make_request


def test_ranks_draw_disjoint_equal_shards_of_one_order():
    shards = [list(EpochSampler(103, seed=4, rank=r, world=3)) for r in range(3)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) == 103 // 3
    assert not set(shards[0]) & set(shards[1]) and not set(shards[1]) & set(shards[2])
    groups = [list(range(0, 40)), list(range(40, 64))]
    batches = [list(GroupedBatchSampler(groups, 4, seed=1, rank=r, world=2)) for r in range(2)]
    assert len(batches[0]) == len(batches[1]) == 8
    assert not {tuple(b) for b in batches[0]} & {tuple(b) for b in batches[1]}


def test_ranks_that_cannot_be_placed_are_said_so():
    shape = {"max_node_cpus": 2, "cpus": 4, "max_node_gpus": 0, "gpus": 0}
    why = ranks_fit(2, {"CPU": 2}, shape)
    assert "4 CPUs" in why and "one node has 2" in why and "spread_ranks" in why
    assert ranks_fit(2, {"CPU": 2}, shape, spread=True) is None
    assert "GPU" in ranks_fit(2, {"CPU": 1, "GPU": 1}, shape)
    assert ranks_fit(2, {"CPU": 1}, shape) is None


def test_static_graph_is_never_combined_with_no_sync_accumulation():
    # PyTorch's DDP crashes, then skips all-reduces, with both (pytorch/pytorch#143580)
    from tuner import knobs

    ctx = knobs.Context(device="cpu", cpu_count=2)
    both = {"world_size": 2, "grad_accum_steps": 2, "ddp_static_graph": True, "ddp_no_sync_accumulation": True}
    full, notes = knobs.resolve(both, ctx, strict=False)
    assert full["ddp_static_graph"] is False and any("pytorch#143580" in n for n in notes)
    with pytest.raises(knobs.UserError, match="ddp_static_graph"):
        knobs.resolve(both, ctx, strict=True)
    assert knobs.resolve({**both, "grad_accum_steps": 1}, ctx, strict=True)[0]["ddp_static_graph"] is True
    # a hook the CPU's gloo cannot run is said before any rank starts
    with pytest.raises(knobs.UserError, match="bf16_compress.*fp16_compress"):
        knobs.resolve({"world_size": 2, "ddp_comm_hook": "bf16_compress"}, ctx, strict=False)
    # and every DDP knob is held at PyTorch's default on one rank
    full, notes = knobs.resolve({"ddp_bucket_cap_mb": 100}, ctx, strict=False)
    assert full["ddp_bucket_cap_mb"] == 25 and "needs world_size > 1" in notes[0]


def test_a_rank_s_own_error_is_named_before_what_ray_says_of_its_peers():
    """A rank that raises fails its peers too, as Ray sees them: on a loaded machine
    rank 0's health check failed while rank 1 had raised, and the trial was put down to
    rank 0. Ray's view of a rank names it only where no rank raised an error of its own."""
    from types import SimpleNamespace

    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    from tuner.distributed import _failure

    checked = WorkerHealthCheckFailedError("A worker health check failed.", RuntimeError("gone"))
    own = ValueError("rank 1 was told to fail")
    kind, reason = _failure(SimpleNamespace(worker_failures={0: checked, 1: own}))
    assert kind != "died" and reason.startswith("rank 1:") and "told to fail" in reason
    kind, reason = _failure(SimpleNamespace(worker_failures={1: checked}))
    assert kind == "died" and reason == "rank 1 died: A worker health check failed."
    # what the rank said of its error on its own node (the size of that node's /dev/shm,
    # say) wins over what the driver's node would say of it
    on_its_node = ("oom", "out of shared memory: NCCL's ranks on one node exchange data in /dev/shm, which holds 64 MB")
    kind, reason = _failure(SimpleNamespace(worker_failures={0: checked, 1: own}), {1: on_its_node})
    assert (kind, reason) == ("oom", f"rank 1: {on_its_node[1]}")


def test_a_rank_whose_process_died_is_named_before_its_peers_lost_connection():
    """A rank whose process dies (the OOM killer, a segfault) leaves its peer's collective
    to raise that the connection went ("Connection closed by peer", gloo's words): the rank
    that died is named, out of memory where its node's OOM count went up meanwhile
    (``oom_killed``), and Ray's memory monitor says so itself."""
    from types import SimpleNamespace

    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    from tuner.distributed import _failure

    checked = WorkerHealthCheckFailedError("A worker health check failed.", RuntimeError("gone"))
    lost = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:33166. This is typically caused by a remote worker crashing.")
    assert _failure(SimpleNamespace(worker_failures={0: lost, 1: checked})) == (
        "died", "rank 1 died: A worker health check failed.")
    assert _failure(SimpleNamespace(worker_failures={0: lost, 1: checked}), None, {1: "its node's memory"}) == (
        "oom", "rank 1: out of memory: the kernel's OOM killer ended its process (its node's memory)")
    # where no rank died, as Ray saw it, the error is still the rank's own
    kind, reason = _failure(SimpleNamespace(worker_failures={0: lost}))
    assert kind == "error" and reason.startswith("rank 0: raised RuntimeError: ") and "closed by peer" in reason
    # a rank's own error that is not about its peer comes first, whichever rank it is
    own = ValueError("rank 1 was told to fail")
    assert _failure(SimpleNamespace(worker_failures={0: checked, 1: own}))[1].startswith("rank 1: raised ValueError")
    assert _failure(SimpleNamespace(worker_failures={0: lost, 1: own}))[1].startswith("rank 1: raised ValueError")


def test_scaling_efficiency_pairs_equal_configs():
    rows = [{"feasible": True, "config": {"world_size": 1, "micro_batch_size": 8, "ddp_bucket_cap_mb": 25},
             "samples_per_sec": 100.0},
            {"feasible": True, "config": {"world_size": 2, "micro_batch_size": 8, "ddp_bucket_cap_mb": 50},
             "samples_per_sec": 150.0},
            {"feasible": True, "config": {"world_size": 2, "micro_batch_size": 16}, "samples_per_sec": 150.0}]
    scaling_efficiency(rows)
    assert rows[1]["scaling_efficiency"] == pytest.approx(0.75)
    assert "scaling_efficiency" not in rows[0] and "scaling_efficiency" not in rows[2]


def _two_steps_on_a_rank(rank: int, port: int, config: dict, queue) -> None:
    import torch
    import torch.distributed as dist

    from tuner import knobs
    from tuner.loop import Trainer
    from tuner.workloads import load_workload

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        full, _ = knobs.resolve(config, knobs.Context(device="cpu", cpu_count=2), strict=True)
        t = Trainer(load_workload(ref("linear"), {"size": 64}), full, torch.device("cpu"), seed=0)
        t.start()
        for _ in range(3):
            t.step()
        queue.put((rank, [v for p in t.model.parameters() for v in p.detach().flatten().tolist()]))
    finally:
        dist.destroy_process_group()


def _train_two_ranks(config: dict) -> dict[int, list[float]]:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_two_steps_on_a_rank, args=(r, port, config, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    return out


@pytest.mark.slow
@pytest.mark.alone  # two ranks on two cores
def test_no_sync_accumulation_gives_the_gradients_of_an_all_reduce_per_micro_batch():
    # gloo, two processes, the real Trainer: three optimizer steps of two micro-batches
    base = {"world_size": 2, "micro_batch_size": 4, "grad_accum_steps": 2}
    every = _train_two_ranks(base)
    last_only = _train_two_ranks({**base, "ddp_no_sync_accumulation": True})
    assert every[0] == every[1] and last_only[0] == last_only[1]  # the ranks agree
    assert last_only[0] == pytest.approx(every[0], abs=1e-6)


@pytest.fixture(scope="module")
def ray_4cpu():
    import ray

    from tuner.localray import start_local_ray

    # a new Ray, never one a developer left running from `ray start`, and quiet as a
    # search starts one: the search in this module measures what runs beside its trials,
    # and Ray's daemons with their default timers used ~0.1 cores beside every window here
    start_local_ray(num_cpus=4, configure_logging=False)
    yield
    ray.shutdown()


def _spy(tmp_path, config, measure=None, **args):
    out = tmp_path / f"spy-{len(list(tmp_path.glob('spy-*')))}.jsonl"
    req = make_request(workload=ref("ddp_spy"), workload_args={"out": str(out), **args}, config=config,
                       device="cpu", measure=measure or FAST_MEASURE)
    record = run_ranks(req, timeout_s=180)
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    # each rank's first loss call is the probe for unused parameters, on the bare model
    probes = [c for c in lines if not c["ddp"]]
    assert len(probes) <= config["world_size"]
    return record, [c for c in lines if c["ddp"]]


@pytest.mark.slow
@pytest.mark.alone
def test_two_ranks_train_ddp_with_the_knobs_and_agree_on_every_window(ray_4cpu, tmp_path):
    config = {"world_size": 2, "micro_batch_size": 8, "grad_accum_steps": 2, "ddp_bucket_cap_mb": 50,
              "ddp_gradient_as_bucket_view": True, "ddp_comm_hook": "fp16_compress",
              "ddp_no_sync_accumulation": True}
    # (the model also has a layer the loss never reaches: without find_unused_parameters,
    # DDP would raise on the second step)
    r, calls = _spy(tmp_path, config, step_s=0.005, unused_layer=True)
    assert r["status"] == "ok", r.get("reason")
    ranks = {c["rank"] for c in calls}
    assert ranks == {0, 1} and len({c["pid"] for c in calls}) == 2
    first = calls[0]
    assert first["ddp"] and first["world"] == 2 and first["bucket_bytes"] == 50 * 2**20
    assert first["as_view"] is True and first["static"] is False and first["hook"] == ["fp16_compress_hook"]
    # no_sync: of each accumulation step's two micro-batches, only the second all-reduces
    for rank in (0, 1):
        syncs = [c["sync"] for c in calls if c["rank"] == rank]
        assert syncs[:6] == [False, True] * 3
    # the same number of steps on both ranks (DDP would hang otherwise), different data,
    # and the same parameters before every forward: the all-reduce really happens
    mine, theirs = ([c for c in calls if c["rank"] == r] for r in (0, 1))
    assert len(mine) == len(theirs) > 6
    assert {c["x0"] for c in mine} != {c["x0"] for c in theirs}
    assert all(a["params"] == b["params"] for a, b in zip(mine, theirs, strict=True))
    assert mine[0]["params"] != mine[-1]["params"]  # and they did change
    # global figures, each rank's own, memory per node
    assert r["world_size"] == 2 and len(r["ranks"]) == 2 and r["slowest_rank"] in (0, 1)
    assert r["samples_per_sec_per_rank"] == pytest.approx(r["samples_per_sec"] / 2)
    assert all(x["step_time_ms"] > 2 * 5 for x in r["ranks"])  # two micro-batches of 5 ms each
    # global: both ranks' samples (a rank's own rate, 16 samples per its step, reads half),
    # and never beyond the sleeps' bound of 2 ranks x 16 samples per 10 ms
    slowest = max(x["step_time_ms"] for x in r["ranks"])
    assert 1.5 * 16 / (slowest / 1e3) < r["steady_samples_per_sec"] <= 2 * 16 / 0.010
    (node, mb), = r["host_memory_per_node_mb"].items()
    assert mb == pytest.approx(sum(x["peak_host_memory_mb"] for x in r["ranks"]))
    assert r["peak_host_memory_mb"] == pytest.approx(mb)
    assert calls[0]["unused"] is True
    assert any("find_unused_parameters turned on" in n and "unused.weight" in n for n in r["notes"])


def test_ranks_that_do_not_fit_are_infeasible_before_ray_train_waits_for_them(ray_4cpu, tmp_path):
    # 3 ranks of 1 + 1 worker CPUs on a 4-CPU node: Ray Train would wait forever
    req = make_request(workload=ref("linear"), config={"world_size": 3, "num_workers": 1, "micro_batch_size": 8},
                       device="cpu", measure=FAST_MEASURE)
    r = run_ranks(req, timeout_s=60)
    assert r["status"] == "infeasible" and r["error_kind"] == "invalid"
    assert r["reason"].startswith("world_size=3: 3 ranks need 6 CPUs") and r["trial_wall_s"] < 5


@pytest.mark.slow
@pytest.mark.alone  # two ranks on two cores: beside another test, Ray Train saw rank 1's health check fail before its error
@pytest.mark.parametrize("fault", ["fail_rank", "hang_rank", "stall"])
def test_a_rank_that_raises_or_hangs_is_named_and_leaves_no_process(ray_4cpu, tmp_path, fault):
    """A rank that raises names itself. One that hangs before its first step (its peer
    then waits in the all-reduce) is ended once every rank's processes have been idle for
    ``measure.idle_limit_s`` (one rank idle alone may be waiting for another's compile);
    one that hangs after stepping (``stall``) by its progress, after
    ``measure.stall_limit_s``, as a single-process trial is: both long before the trial's
    time limit. Both limits are set lower than their defaults here: the rule is checked,
    not the default seconds."""
    import time

    import psutil

    out = tmp_path / "spy-fault.jsonl"
    args = {"fail_rank": {"fail_rank": 1}, "hang_rank": {"hang_rank": 1},
            "stall": {"hang_rank": 1, "hang_after": 12}}[fault]
    req = make_request(workload=ref("ddp_spy"), workload_args={"out": str(out), **args},
                       config={"world_size": 2, "micro_batch_size": 8}, device="cpu",
                       measure={**FAST_MEASURE, "idle_limit_s": 8.0, "stall_limit_s": 10.0})
    r = run_ranks(req, timeout_s=180 if fault == "fail_rank" else 600)
    assert r["status"] == "infeasible" and "\n" not in r["reason"]
    if fault == "fail_rank":
        assert r["reason"].startswith("rank 1:") and "rank 1 was told to fail" in r["reason"]
    else:
        said = "every rank's processes idle for" if fault == "hang_rank" else "hung: no step for"
        assert r["error_kind"] == "timeout" and r["reason"].startswith("hung: no step") and said in r["reason"], r
        assert r["trial_wall_s"] < 150  # the limit is 600 s
        # at the limits the request set, not the defaults (20 s idle, 30 s without a step)
        waited = float(r["reason"].split("idle for " if fault == "hang_rank" else "no step for ")[1].split(" s")[0])
        assert (8 <= waited < 20) if fault == "hang_rank" else (10 <= waited < 30), r["reason"]
    # both ranks' processes (and so their DataLoader workers) are gone
    pids = {json.loads(line)["pid"] for line in out.read_text().splitlines()}
    assert len(pids) == 2
    deadline = time.time() + 30
    while time.time() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.5)
    assert not any(psutil.pid_exists(p) for p in pids)


class _Blocked:
    """A stand-in for a rank blocked in a collective: a Ray worker doing nothing of its own."""

    def pid(self) -> int:
        import os

        return os.getpid()

    def poll(self) -> bool:
        return True

    def block(self, box) -> None:
        """Waits for good, while a thread asks ``box`` every LOOK_S, as a rank's watchdog does."""
        import threading

        import ray

        from tuner.trial import LOOK_S

        def watchdog() -> None:
            while True:
                ray.get(box.poll.remote())
                time.sleep(LOOK_S)

        threading.Thread(target=watchdog, daemon=True).start()
        threading.Event().wait()


@pytest.mark.alone  # the idle Ray worker's own CPU use, read beside nothing else
def test_a_blocked_ray_worker_polled_as_ray_train_polls_reads_idle_to_the_rank_watchdog(ray_4cpu):
    """A rank's process tree is a Ray worker, whose own threads answer the controller's
    polls: blocked for good, it kept using a few hundredths of a core, and the
    single-process floor took that for work in look after look (the hung rank was then
    ended minutes late). Under the rank's floor it reads idle, look after look."""
    import threading

    import ray

    from tuner.distributed import CONTROLLER_POLL_S, RANK_CPU_FLOOR
    from tuner.hostload import TreeActivity
    from tuner.trial import LOOK_S

    worker, box = (ray.remote(_Blocked).options(num_cpus=n, max_concurrency=4).remote() for n in (1, 0))
    try:
        pid = ray.get(worker.pid.remote())
        worker.block.remote(box)
        stop = threading.Event()

        def controller() -> None:
            while not stop.wait(CONTROLLER_POLL_S):
                ray.get(worker.poll.remote())

        threading.Thread(target=controller, daemon=True).start()
        activity = TreeActivity(pid, cpu_floor=RANK_CPU_FLOOR)
        time.sleep(2 * LOOK_S)  # the worker settles after its calls start
        activity.idle_for(time.perf_counter())
        idles = []
        for _ in range(6):
            time.sleep(LOOK_S)
            idles.append(activity.idle_for(time.perf_counter()))
        stop.set()
        assert idles[-1] >= 5 * LOOK_S, idles
    finally:
        ray.kill(worker)
        ray.kill(box)


@pytest.mark.slow
@pytest.mark.alone  # undisturbed windows and the per-rank rate
def test_a_search_over_world_size_reports_scaling_efficiency(ray_4cpu, tmp_path):
    from tests.test_search import _records, _space
    from tuner.search import run_search

    spy = tmp_path / "spy.jsonl"
    space = _space(tmp_path, f"""\
        name: ddp
        workload: {ref("ddp_spy")}
        workload_args: {{out: "{spy}", step_s: 0.02, size: 512}}
        sampler: grid
        knobs:
          world_size: [1, 2]
          micro_batch_size: [8]
          grad_accum_steps: 2
          ddp_static_graph: true
        budget: {{trials: 2, trial_timeout_s: 180}}
        confirm: {{top: 0}}
        """)
    summary = run_search(space, results_root=tmp_path / "r", quiet=True)
    calls = [c for c in map(json.loads, spy.read_text().splitlines()) if c["ddp"]]
    # the two-rank trial ran DDP with static_graph, PyTorch's bucket size, and (no
    # no_sync asked) an all-reduce on every micro-batch
    assert {c["rank"] for c in calls} == {0, 1} and all(c["sync"] for c in calls)
    assert calls[0]["static"] is True and calls[0]["bucket_bytes"] == 25 * 2**20 and calls[0]["unused"] is False
    records = {r["config"]["world_size"]: r for r in _records(tmp_path / "r" / "ddp") if r["phase"] == "search"}
    assert records[1]["status"] == records[2]["status"] == "ok", records[2].get("reason")
    assert records[2]["world_size"] == 2 and len(records[2]["ranks"]) == 2
    # the trial's own ranks, their workers and Ray Train's processes are never outside load
    assert not records[2]["disturbed"] and records[2]["disturbed_windows_dropped"] == 0
    two = next(r for r in summary["top"] if r["config"]["world_size"] == 2)
    # 2 x 20 ms of sleep per step on each rank: two ranks nearly double the rate (with
    # 5 ms, the gloo all-reduce and the step itself weighed enough on a slow VM to read
    # 0.51; ranks that ran one after the other would read 0.5)
    assert 0.6 < two["scaling_efficiency"] <= 1.05
    assert two["samples_per_sec_per_rank"] == pytest.approx(two["samples_per_sec"] / 2, rel=0.05)
    saved = json.loads((tmp_path / "r" / "ddp" / "summary.json").read_text())
    assert any(r.get("scaling_efficiency") == pytest.approx(two["scaling_efficiency"]) for r in saved["top"])
    import contextlib
    import io

    from tuner.cli import main

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        assert main(["show", str(tmp_path / "r" / "ddp")]) == 0
    assert f"scaling: {two['scaling_efficiency']:.0%} of 2x one rank" in shown.getvalue()


def _ranks_alone(tmp_path, args: dict, run=None, env: dict | None = None, system: dict | None = None) -> dict:
    """A two-rank trial of ``ddp_spy`` with ``args``, run by a driver in a fresh process
    that starts its own Ray (in ``run``: a command runner, tests.helpers.memory_cgroup's;
    else a plain subprocess with ``env``; ``system``: Ray's settings over the tuner's local
    ones): its record's status, kind and reason."""
    import os
    import subprocess
    import sys

    args = {"out": str(tmp_path / "spy.jsonl"), **args}
    code = ("import json; from tests.helpers import FAST_MEASURE, ref; from tuner.localray import start_local_ray; "
            "from tuner.distributed import run_ranks; from tuner.trial import make_request\n"
            "if __name__ == '__main__':\n"
            f"    start_local_ray(num_cpus=4, configure_logging=False, _system_config={system or {}!r})\n"
            f"    r = run_ranks(make_request(workload=ref('ddp_spy'), workload_args={args!r}, "
            "config={'world_size': 2, 'micro_batch_size': 8}, device='cpu', measure=FAST_MEASURE), timeout_s=180)\n"
            "    print(json.dumps({k: r.get(k) for k in ('status', 'error_kind', 'reason')}))")
    root = os.path.dirname(os.path.dirname(__file__))
    argv = (sys.executable, "-c", code)
    out = run(*argv, timeout=300, cwd=root) if run else subprocess.run(
        argv, capture_output=True, text=True, timeout=300, cwd=root, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.alone  # two ranks on two cores: beside another test, Ray Train saw a rank's health check fail first
@pytest.mark.parametrize("killer", ["kernel", "ray"])
def test_a_rank_ended_by_an_oom_killer_is_named_out_of_memory(tmp_path, killer):
    """A rank that keeps taking memory, ended by the kernel's OOM killer at a real cgroup's
    limit (the driver and its whole Ray in it), or by Ray's memory monitor (its threshold
    set just above what this machine uses now, as a node near full would be). Its peer's
    all-reduce then raises that the connection went, and Ray sees only that the rank's
    process died: the trial says the rank ran out of memory, and what held it."""
    import re

    import psutil

    from tests.helpers import memory_cgroup

    if killer == "kernel":
        with memory_cgroup(3 * 2**30) as run:
            r = _ranks_alone(tmp_path, {"hoard_rank": 1}, run=run)
        assert (r["status"], r["error_kind"]) == ("infeasible", "oom"), r
        assert r["reason"] == "rank 1: out of memory: the kernel's OOM killer ended its process (its cgroup holds it to 3,072 MB)"
        return
    memory = psutil.virtual_memory()
    if memory.available < 10 * 2**30:
        pytest.skip("Ray's memory monitor is set 3 GB above what is in use, and the hoarding rank needs room past it")
    threshold = (memory.total - memory.available + 3 * 2**30) / memory.total
    # as a cluster's nodes run it: the tuner's own local Ray runs without the monitor
    r = _ranks_alone(tmp_path, {"hoard_rank": 1, "hoard_pause_s": 0.05, "hoard_cap_mb": 6144},
                     env={"RAY_memory_usage_threshold": f"{threshold:.3f}"}, system={"memory_monitor_refresh_ms": 250})
    assert (r["status"], r["error_kind"]) == ("infeasible", "oom"), r
    # Ray's monitor chooses which of the trial's processes to end
    assert re.fullmatch(r"rank [01]: out of memory: Ray's memory monitor ended its process \(the node's memory was "
                        r"[\d.]+GB used / [\d.]+GB limit, past RAY_memory_usage_threshold\)", r["reason"]), r
