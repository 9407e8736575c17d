"""Trials that span several data-parallel ranks, run through Ray Train.

A trial with ``world_size > 1`` runs a ``TorchTrainer`` (Ray Train V2's "a Ray Train
run as one Ray Tune trial" pattern) with one Train worker per rank: one GPU each on
GPUs, ``1 + num_workers`` CPUs each. Ray Train starts the process group (NCCL on
GPUs, gloo on CPUs) and tears it down. Every rank builds the same ``Trainer``: DDP
with the ``ddp_*`` knobs, its own shard of the data, its own DataLoader workers. Every
rank runs the same measurement, which agrees on each window's figures at the window
edge (``tuner.ranks.Agree``). Rank 0 reports the record.

The ranks of one trial stay on one node (``STRICT_PACK``) unless the space asks for
``resources.spread_ranks``. A rank that raises fails the Train run, and the error
becomes the trial's one-line reason. A rank whose process dies is named, and as out of
memory where the kernel's OOM killer (counted on its node) or Ray's memory monitor ended
it, not the peers whose collectives then lost it. A rank that hangs (a collective that never
completes, a DataLoader that never delivers) ends its own process once it has made no
step for max(30 s, 10x its slowest step gap), as a single-process trial's parent finds
it; before the first step, once every rank's processes have been idle for 20 s (a rank
idle alone may wait in a collective while another compiles); and at the trial's time
limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import threading
import time
import uuid

from tuner import knobs
from tuner.capacity import cluster_shape
from tuner.errors import ray_memory_kill
from tuner.trial import (
    LOOK_S,
    TrialRequest,
    Vigil,
    classify,
    hang_limits,
    hung_reason,
    infeasible,
    out_of_descriptors,
)

# How often Ray Train's controller asks the ranks whether they are done (seconds).
CONTROLLER_POLL_S = 0.5
# Cores below which a rank's process tree counts as idle before its first step. The tree's
# root is the Ray worker itself, whose own threads answer the controller's polls and this
# module's watchdog: a rank blocked for good keeps using a few hundredths of a core, more on
# a slower host, which a single-process trial's floor (TreeActivity.CPU_FLOOR) would take
# for work. Work that matters here (a compile, a dataset opened, workers starting) uses a
# core or moves bytes.
RANK_CPU_FLOOR = 0.1


def per_rank_resources(config: dict, use_gpu: bool) -> dict[str, float]:
    """What one rank reserves: 1 + num_workers CPUs, and a GPU on GPUs."""
    bundle: dict[str, float] = {"CPU": knobs.process_cpus(config)}
    if use_gpu:
        bundle["GPU"] = 1
    return bundle


def ranks_fit(world: int, per_rank: dict[str, float], shape: dict, spread: bool = False) -> str | None:
    """Why ``world`` ranks cannot be placed on this cluster, or None. On one node unless
    ``spread`` (Ray Train would otherwise wait for resources that never come)."""
    where = "the cluster" if spread else "one node"
    have = {"CPU": shape["cpus"] if spread else shape["max_node_cpus"],
            "GPU": shape["gpus"] if spread else shape["max_node_gpus"]}
    for kind, each in per_rank.items():
        if world * each > have.get(kind, 0):
            return (f"{world} ranks need {world * each:g} {kind}s ({each:g} per rank) and {where} "
                    f"has {have.get(kind, 0):g}" + ("" if spread else "; resources.spread_ranks spreads them"))
    return None


def run_ranks(request: TrialRequest, *, timeout_s: float = 600.0, spread: bool = False,
              storage: str | None = None, use_gpu: bool | None = None, backend: str | None = None) -> dict:
    """Measure a multi-rank request through Ray Train (Ray must be up); returns the
    record like ``trial.run_isolated`` (never raises for a failing trial; ranks that
    cannot be placed are infeasible at once). ``use_gpu``:
    one GPU per rank (default: when the request's device is cuda); ``backend``: the
    process group's (default: NCCL with GPUs, gloo without)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    world = int(request.config["world_size"])
    use_gpu = request.device == "cuda" if use_gpu is None else use_gpu
    per_rank = per_rank_resources(request.config, use_gpu)
    why = ranks_fit(world, per_rank, cluster_shape(), spread=spread)
    if why:
        return {**infeasible("invalid", f"world_size={world}: {why}", request), "trial_wall_s": 0.0, "attempts": 1}
    t0 = time.perf_counter()
    own_storage = storage is None
    storage = storage or tempfile.mkdtemp(prefix="tuner-train-")
    # Ray Train keeps reported metrics only with checkpoints: rank 0 hands its record
    # to this small actor instead (on any node).
    box = ray.remote(_Box).options(num_cpus=0).remote(world)
    # Ray Train's controller learns that the ranks are done at its next poll of them (every
    # 2 s by default), and the trial's wall waits for it. A poll is a light call to each
    # rank, and a slow one is no missed health check before its own timeout (10 minutes).
    # A setting of the user's own stands.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(CONTROLLER_POLL_S))
    trainer = TorchTrainer(
        _rank_main,
        train_loop_config={"request": dataclasses.asdict(request), "timeout_s": timeout_s, "box": box},
        torch_config=TorchConfig(backend=backend),
        scaling_config=ScalingConfig(num_workers=world, use_gpu=use_gpu,
                                     resources_per_worker=per_rank,
                                     placement_strategy="SPREAD" if spread else "STRICT_PACK"),
        run_config=RunConfig(name=f"ranks-{uuid.uuid4().hex[:8]}", storage_path=storage,
                             failure_config=FailureConfig(max_failures=0)),
    )
    try:
        trainer.fit()
        record = json.loads(ray.get(box.get.remote()))
    except TrainingFailedError as exc:
        try:
            hung, said, started = ray.get(box.why.remote(), timeout=10)
        except Exception:  # the box's node lost with the ranks: Ray's own reasons below
            hung, said, started = None, {}, {}
        if hung:  # the ranks' watchdogs ended them: a collective (or the user's code) hung
            kind, reason = "timeout", hung
        elif time.perf_counter() - t0 >= timeout_s:
            kind, reason = "timeout", hung_reason(timeout_s)
        else:
            kind, reason = _failure(exc, said, _oom_killed(exc, started))
        record = infeasible(kind, reason, request)
    finally:
        ray.kill(box)
        if own_storage:
            shutil.rmtree(storage, ignore_errors=True)
    record["trial_wall_s"] = time.perf_counter() - t0
    record["attempts"] = 1
    return record


def _failure(exc: BaseException, said: dict[int, tuple[str, str]] | None = None,
             oom_killed: dict[int, str] | None = None) -> tuple[str, str]:
    """(kind, one-line reason) of a failed Train run. A rank whose process the OOM killer
    ended (the kernel's, seen on its node: ``oom_killed``, rank -> the memory it was held
    to; or Ray's memory monitor, which says so) is named first: its peers' errors follow
    from it. Then the lowest rank's own error, as the rank classified it on its own node
    (``said``: what its machine lacked, /dev/shm say, is that node's), else as classified
    here; an error that says only that a collective's peer went away (gloo's "Connection
    reset by peer") comes after any other, and after a rank whose process died. A rank's failure
    also fails its peers, as Ray sees them (their processes end, or their health checks
    fail on a loaded machine): those name the rank only where no rank raised an error of
    its own."""
    failures: dict[int, BaseException] = getattr(exc, "worker_failures", None) or {}
    if not failures:
        cause = getattr(exc, "controller_failure", exc)
        return "error", f"Ray Train failed: {str(cause).strip().splitlines()[0][:300] if str(cause).strip() else type(cause).__name__}"
    own = {rank: err for rank in sorted(failures) if (err := _own_error(failures[rank])) is not None}
    died = sorted(set(failures) - set(own))
    for rank in died:
        if rank in (oom_killed or {}):
            return "oom", f"rank {rank}: out of memory: the kernel's OOM killer ended its process ({oom_killed[rank]})"
        if (use := ray_memory_kill(str(failures[rank]))) is not None:
            return "oom", (f"rank {rank}: out of memory: Ray's memory monitor ended its process ({use}, past "
                           "RAY_memory_usage_threshold)")
    caused = {rank: err for rank, err in own.items() if not _peer_lost(err)}
    if died and not caused:
        rank = min(died)
        return "died", f"rank {rank} died: {str(failures[rank]).strip().splitlines()[0][:200]}"
    rank = min(caused or own)
    kind, reason = (said or {}).get(rank) or classify(own[rank])
    return kind, f"rank {rank}: {reason}"


# What a collective raises on a rank whose peer's process went away (gloo's TCP pairs,
# NCCL's abort after a peer's exit): the peer's death is the cause.
PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe",
             "remote process exited", "nccl communicator was aborted")


def _peer_lost(err: BaseException) -> bool:
    said = str(err).lower()
    return any(s in said for s in PEER_LOST)


def _node_memory() -> tuple[int | None, int | None]:
    """On one node: the kernel's count of OOM kills, and the memory limit of the cgroup
    that holds its Ray workers (None: none)."""
    from tuner.hardware import memory_limit, oom_kills

    limit = memory_limit()
    return oom_kills(), limit[0] if limit else None


def _oom_killed(exc: BaseException, started: dict[int, tuple[str, int | None]]) -> dict[int, str]:
    """The ranks of a failed run whose process died while the kernel's OOM killer ended a
    process on their node, each with the memory it was held to. ``started``: each rank's
    node and that count when it started. Read on each such node by a task pinned there;
    a node that is gone or slow to answer (10 s) tells nothing."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    failures: dict[int, BaseException] = getattr(exc, "worker_failures", None) or {}
    died = [r for r in sorted(failures) if _own_error(failures[r]) is None and started.get(r, (None, None))[1] is not None]
    read = ray.remote(_node_memory)
    asked = {r: read.options(num_cpus=0, max_retries=0,
                             scheduling_strategy=NodeAffinitySchedulingStrategy(started[r][0], soft=False)).remote()
             for r in died}
    killed = {}
    for rank, ref in asked.items():
        try:
            kills, limit = ray.get(ref, timeout=10)
        except Exception:
            continue
        if kills is not None and kills > started[rank][1]:
            killed[rank] = f"its cgroup holds it to {limit / 2**20:,.0f} MB" if limit else "its node's memory"
    return killed


def _own_error(err: BaseException) -> BaseException | None:
    """The rank's own exception; None where Ray reports the rank's process as gone or
    unresponsive."""
    original = getattr(err, "cause", None) or getattr(err, "__cause__", None) or err
    if not isinstance(original, BaseException) or type(original).__name__ in (
            "ActorDiedError", "RayActorError", "WorkerCrashedError",
            "WorkerHealthCheckFailedError", "WorkerHealthCheckTimeoutError"):
        return None
    return original


class _Box:
    """Holds rank 0's record for the driver, why a rank ended a hung trial, and each
    failed rank's error as it classified it."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.idles: dict[int, float] = {}  # each rank's idle seconds, as it last said
        self.record: str | None = None
        self.hang: str | None = None  # why the first rank to find the trial hung ended it
        self.said: dict[int, tuple[str, str]] = {}  # each failed rank's (kind, reason), from its own node
        self.started: dict[int, tuple[str, int | None]] = {}  # each rank's node, and its OOM kills then

    def put(self, record: str) -> None:
        self.record = record

    def get(self) -> str | None:
        return self.record

    def idle(self, rank: int, seconds: float) -> float:
        """Takes a rank's idle seconds; gives the least of every rank's (0 before all said)."""
        self.idles[rank] = seconds
        return min(self.idles.values()) if len(self.idles) == self.world else 0.0

    def hung(self, reason: str) -> None:
        self.hang = self.hang or reason

    def failed(self, rank: int, kind: str, reason: str) -> None:
        self.said[rank] = (kind, reason)

    def start(self, rank: int, node: str, oom_kills: int | None) -> None:
        self.started[rank] = (node, oom_kills)

    def why(self) -> tuple[str | None, dict[int, tuple[str, str]], dict[int, tuple[str, int | None]]]:
        return self.hang, self.said, self.started


def _rank_main(cfg: dict) -> None:
    """The body of each rank (a Ray Train worker)."""
    import ray.train

    from tuner.hostload import TreeActivity
    from tuner.trial import execute

    request = TrialRequest(**cfg["request"])
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    done = threading.Event()
    # The rank's progress, read as a single-process trial's parent reads it: once it has
    # stepped, a hang is no step for max(measure.stall_limit_s, 10x its slowest gap),
    # found on every rank alike (the ranks step together). Before its first step, a rank
    # alone idle tells nothing (it may wait in a collective while another compiles): the
    # trial is hung when every rank's processes have been idle for measure.idle_limit_s,
    # as the box hears from all of them.
    idle_s, stall_s = hang_limits(request)
    vigil, lock = Vigil(time.perf_counter(), cfg["timeout_s"], None, idle_s, stall_s), threading.Lock()
    activity = TreeActivity(os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES") if request.device != "cpu" else None,
                            cpu_floor=RANK_CPU_FLOOR)

    def heard(message: str) -> None:
        with lock:
            vigil.heard(("progress", message), time.perf_counter(), None)

    def all_idle(now: float) -> dict | None:
        try:
            idle = ray.get(cfg["box"].idle.remote(rank, activity.idle_for(now)), timeout=10)
        except Exception:  # the box out of reach: the time limit still holds
            return None
        if idle < idle_s:
            return None
        return infeasible("timeout", f"hung: no step after {now - vigil.t0:.0f} s, every rank's processes idle "
                          f"for {idle:.0f} s (limit: measure.idle_limit_s)", request)

    def watchdog() -> None:
        # A rank stuck in a collective (or its data) cannot raise: end the process, which
        # fails the Train run on every rank; the driver reads why from the box.
        while True:
            with lock:
                now = time.perf_counter()
                found, wait, stepped = vigil.hung(now, request), vigil.wait_s(now), bool(vigil.gaps)
            if found is None and not stepped:
                found = all_idle(now)
            if found is not None:
                break
            if done.wait(min(wait, LOOK_S)):
                return
        reason = found["reason"]
        if why := out_of_descriptors(os.getpid()):
            reason += f"; {why}"
        print(f"tuner: rank {rank} {reason}; ending it", flush=True)
        with contextlib.suppress(Exception):
            ray.get(cfg["box"].hung.remote(reason), timeout=10)
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        import ray as _ray

        from tuner.hardware import oom_kills

        node = _ray.get_runtime_context().get_node_id()
        # the kernel's count before the rank's work: the driver reads it again on this node
        # if the rank's process dies (_oom_killed)
        with contextlib.suppress(Exception):
            _ray.get(cfg["box"].start.remote(rank, node, oom_kills()), timeout=10)
        record = execute(request, progress=heard,
                         rank_info={"node": node, "node_ip": _ray.util.get_node_ip_address(),
                                    "gpu_ids": [str(g) for g in _ray.get_gpu_ids()]})
    except Exception as exc:
        with contextlib.suppress(Exception):
            ray.get(cfg["box"].failed.remote(rank, *classify(exc)), timeout=10)
        raise
    finally:
        done.set()
    if rank == 0:
        import ray as _ray

        _ray.get(cfg["box"].put.remote(json.dumps(record, default=str)))
