"""Run one config in its own process: timeout, crash and OOM become results.

``run_isolated(request)`` starts a fresh Python process (spawned, not forked: a
user's training starts as one), measures the config there and returns a plain dict.
The child measures its own memory and the load beside it at window edges
(``tuner.hostload.TreeProbe``); the parent only blocks on the child's pipe (it takes no
CPU from the trial), kills the tree when the trial exceeds its time limit, and turns
every failure into a result with ``status: infeasible`` and a one-line ``reason``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import psutil

from tuner.errors import KnobRefused, UserError, WorkloadError, exception_chain
from tuner.records import Record, Status

# Imported by the trial's process before its clock starts: torch, and torch._dynamo, which
# the first optimizer step imports otherwise (sympy and torch.distributed among it). A
# user's process pays both once, before its first step; neither is part of a config's
# cost.
#
# The process is spawned, not forked from a server that imported these once (which would
# save seconds per trial): a forked child's glibc heap follows its server's, and its rate
# with it, so every trial forked from one server drew the same heap, and read faster or
# slower than a user's fresh process (docs/how-it-measures.md, "Your process against the
# tuner's figure").
_PRELOAD = ["torch", "torch._dynamo", "tuner.loop", "tuner.measure", "tuner.hardware", "tuner.workloads.builtin"]


@dataclass
class TrialRequest:
    """What one trial measures and how: plain data, picklable (it crosses into the
    trial's process and Ray's workers)."""

    workload: str
    """A built-in name, ``file.py:factory`` or ``pkg.mod:factory``."""
    workload_args: dict = field(default_factory=dict)
    base_dir: str | None = None
    """Where a relative workload file is found (the space file's folder)."""
    config: dict = field(default_factory=dict)
    """Knob values; the rest are resolved to their defaults on the trial's device."""
    baseline: bool = False
    """Measure the plain PyTorch loop instead of the optimized one."""
    strict: bool | list[str] = False
    """A knob that cannot apply here is an error (``bench --set``: True for all, or the
    knobs the user set), not a note."""
    device: str = "auto"
    measure: dict = field(default_factory=dict)
    """``MeasureSettings`` fields (the space's ``measure:`` section)."""
    run: dict = field(default_factory=dict)
    """``RunPlan`` fields (the space's ``run:`` section)."""
    seed: int = 0
    env: dict = field(default_factory=dict)
    """Environment of the trial's process (OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES)."""
    threads_cap: int | None = None
    """The CPUs the trial reserved: its intra-op threads, where the torch_threads knob does
    not set them, are PyTorch's own default in the environment the search started from
    (``env``'s OMP_NUM_THREADS where that had one), at most these. None: as started."""
    isolate_compile_cache: bool = True
    """Without ``compile_cache``: a cold inductor cache of the trial's own."""
    observers: list = field(default_factory=list)
    """Pids of the tuner's own processes (the launcher, the Tune driver, Ray's daemons),
    whose CPU use during the timed windows is reported apart."""
    screen: dict | None = None
    """``{"below": samples/sec, "margin": fraction}``: the search's screening threshold."""
    compile_cache: str | None = None
    """An inductor cache folder shared by one compile group of a search: cold (empty)
    for the group's first trial, warm after."""
    check_hot_path: bool = False
    """Run the hot-path check (``tuner.hotpath``) on the config instead of measuring it."""
    also_check: list = field(default_factory=list)
    """``(config, baseline)`` pairs checked after it in the same process (one start-up)."""
    nice: int | None = None
    """The niceness the trial runs at: the user's, that of the process that started the
    search (Ray starts its workers at nice 15). None: the niceness it started with."""


def make_request(*, workload: str, workload_args: dict | None = None, base_dir: str | None = None,
                 config: dict | None = None, baseline: bool = False, strict: bool | list[str] = False,
                 device: str = "auto", measure: dict | None = None, run: dict | None = None,
                 seed: int = 0, env: dict | None = None, isolate_compile_cache: bool = True,
                 observers: list[int] | None = None, screen: dict | None = None,
                 compile_cache: str | None = None, nice: int | None = None,
                 threads_cap: int | None = None) -> TrialRequest:
    """A ``TrialRequest``, with its mappings copied (the caller's may change later)."""
    return TrialRequest(workload=workload, workload_args=dict(workload_args or {}), base_dir=base_dir,
                        config=dict(config or {}), baseline=baseline, strict=strict, device=device,
                        measure=dict(measure or {}), run=dict(run or {}), seed=seed, env=dict(env or {}),
                        isolate_compile_cache=isolate_compile_cache, observers=list(observers or []),
                        screen=screen, compile_cache=compile_cache, nice=nice, threads_cap=threads_cap)


class Resolved(NamedTuple):
    """A request resolved on this machine: its full config, the notes on knobs that do
    not apply here, the workload, the torch device."""

    config: dict
    notes: list[str]
    workload: Any
    device: Any


def resolve_config(request: TrialRequest) -> Resolved:
    """Load the workload and resolve the request's knobs on this machine's device;
    raises UserError for a bad knob."""
    from pathlib import Path

    import torch

    from tuner import apply, knobs
    from tuner.hardware import pick_device
    from tuner.workloads import load_workload

    device = torch.device(pick_device(request.device))
    base = Path(request.base_dir) if request.base_dir else None
    workload = load_workload(request.workload, request.workload_args, base)
    ctx = apply.context_for(device, workload)
    config, notes = knobs.resolve(request.config, ctx, strict=request.strict)
    return Resolved(config, notes, workload, device)


def bench_request(space: Any, overrides: dict | None = None, baseline: bool = False) -> TrialRequest:
    """What ``tuner bench`` measures: the space's recommended config for this machine's
    device (the guides' advice within the space; ``baseline``: the plain PyTorch loop),
    with ``overrides`` applied (the advice fitted around them), each one checked strictly (a
    knob set that cannot apply here is an error before anything runs)."""
    from tuner import apply

    m = space.model
    resolved = resolve_config(make_request(workload=m.workload, workload_args=m.workload_args,
                                           base_dir=str(space.base_dir), device=m.device))
    overrides = dict(overrides or {})
    if baseline:
        config = {**space.baseline_config(), **overrides}
    else:
        ctx = apply.context_for(resolved.device, resolved.workload)
        config = space.recommended_config(ctx, given=overrides)
    config = space.derive(config)
    # only what the user set is checked strictly: advice it leaves without effect
    # (persistent workers under num_workers=0) is held at its default, with a note
    request = make_request(workload=m.workload, workload_args=m.workload_args, base_dir=str(space.base_dir),
                           config=config, baseline=baseline, strict=sorted(overrides), device=m.device,
                           measure=m.measure.model_dump(), run=m.run.model_dump(), seed=m.seed)
    request.config = resolve_config(request).config
    return request


def execute(request: TrialRequest, progress: Callable[[str], None] | None = None,
            rank_info: dict | None = None, phase: Callable[[str], None] | None = None) -> Record:
    """Build and measure the request's config in this process; return metrics + context.
    (Each rank of a multi-rank trial calls it too: ``tuner.distributed``.)"""
    import torch

    from tuner.hostload import TreeProbe
    from tuner.loop import Trainer
    from tuner.measure import measure
    from tuner.settings import PHASES, MeasureSettings, RunPlan

    t0 = time.perf_counter()
    config, notes, workload, device = resolve_config(request)
    priority_note = run_at_niceness(request.nice)
    if priority_note:
        notes = [*notes, priority_note]
    from tuner.hardware import debug_env

    notes = [*notes, *(f"the environment sets {d}; unset it for training runs"
                       for d in debug_env(gpu=device.type == "cuda"))]
    cache_dir, cleanup, cache_state = None, False, None
    if config["compile"] != "off":
        if request.compile_cache:
            # The group's cache: cold for its first trial (which measures the compile the
            # user's first run pays), warm for the others (which measure steady speed).
            cache_dir = request.compile_cache
            cache_state = "warm" if os.path.isdir(cache_dir) and os.listdir(cache_dir) else "cold"
            os.makedirs(cache_dir, exist_ok=True)
        elif request.isolate_compile_cache:
            # A cold inductor cache per trial: compile_s must not depend on what ran before.
            cache_dir, cleanup, cache_state = tempfile.mkdtemp(prefix="tuner-inductor-"), True, "cold"
        if cache_dir:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
            torch._dynamo.reset()
    try:
        if phase:
            phase(PHASES[0])
        trainer = Trainer(workload, config, device, baseline=request.baseline, seed=request.seed)
        if request.check_hot_path:
            return _check_hot_path(request, trainer, config, notes)
        metrics = measure(trainer, MeasureSettings(**request.measure), RunPlan(**request.run),
                          startup_s=time.perf_counter() - t0, progress=progress,
                          probe=TreeProbe(request.observers),
                          screen=request.screen, rank_info=rank_info, phase=phase)
        notes = notes + trainer.notes
        if trainer.cache_fill_s is not None:  # dataset_cache: paid once, in startup_s, shown apart
            metrics["cache_fill_s"], metrics["cache_mb"] = trainer.cache_fill_s, trainer.dataset.nbytes / 2**20
    finally:
        if cleanup:
            shutil.rmtree(cache_dir, ignore_errors=True)
        if config["gc_freeze"]:
            from tuner.apply import release_gc_freeze

            release_gc_freeze()
    metrics["compile_cache"] = cache_state
    status, reason = Status.OK, None
    if not metrics["loss_finite"]:
        status, reason = Status.INFEASIBLE, metrics.pop("reason")
    threads = torch.get_num_threads()
    if config["torch_threads"] is not None and threads != config["torch_threads"]:  # set again in the step
        notes = [*notes, f"the workload's step set torch.set_num_threads({threads}): this trial ran at {threads} "
                         f"intra-op threads, not the knob's {config['torch_threads']}"]
    notes = [*notes, *(f"the workload turns on torch.autocast itself at {site}: inside it the precision knob has no "
                       f"effect (this trial's precision={config['precision']})" for site in metrics.get("own_autocast") or [])]
    return {"status": status, "reason": reason, **metrics, "config": config, "notes": notes,
            "nice": os.getpriority(os.PRIO_PROCESS, 0), "intra_op_threads": threads,
            **workload_facts(workload, trainer),
            "baseline": request.baseline, "device": str(device)}


def workload_facts(workload: Any, trainer: Any) -> dict:
    """What a record says of the workload and the machine beside its figures: which knobs
    can apply to it (the diagnosis advises none that cannot) and the hardware."""
    from tuner import apply
    from tuner.hardware import describe
    from tuner.workloads import users_after_step, workload_facts

    # whether the optimizer takes a fused step here (its class, its device, no sparse gradients)
    try:
        fused_step = trainer.config["fused_optimizer"] or apply.fused_optimizer_of(trainer.optimizer, trainer.model) is None
    except Exception:  # an optimizer that cannot be rebuilt from its defaults: unknown
        fused_step = None
    return {**workload_facts(workload),
            "clip_grad_norm": workload.clip_grad_norm, "has_after_step": users_after_step(workload) is not None,
            "half_params": trainer.half_params,
            "map_style": trainer.sampler is not None, "has_conv2d": apply.has_conv2d(trainer.model),
            "fused_step": fused_step, "hardware": describe()}


def _check_hot_path(request: TrialRequest, trainer: Any, config: dict, notes: list[str]) -> Record:
    """The hot-path check of the request's config, then of each of ``also_check`` in this
    process (a check that raises says why in its place)."""
    import dataclasses

    from tuner.hotpath import UserCode, check
    from tuner.loop import Trainer

    user = UserCode.of_workload(request.workload, request.base_dir)
    also = []
    for other, baseline in request.also_check:
        try:
            resolved = resolve_config(dataclasses.replace(request, config=other, baseline=baseline, also_check=[]))
            also.append(check(Trainer(resolved.workload, resolved.config, resolved.device, baseline=baseline,
                                      seed=request.seed), user))
        except Exception as exc:  # the first check's findings stand without it
            also.append({"error": classify(exc)[1]})
    return {"status": Status.OK, "reason": None, "hot_path": check(trainer, user), "hot_path_also": also,
            "config": config, "notes": notes + trainer.notes, "baseline": request.baseline,
            "device": str(trainer.device)}


def run_at_niceness(target: int | None) -> str | None:
    """Put this process back at the user's niceness before it measures.

    Ray starts its workers at nice 15 (``RAY_worker_niceness``), and a trial launched by
    one inherits it. At nice 15 every process at the default priority, the Tune driver
    among them, preempts the trial at once: a step that sleeps and wakes, and the threads
    of DDP ranks (gloo's included), run measurably slower there. The user's own script
    runs at their niceness. Linux niceness is per thread, and the threads created after
    this (torch's, DataLoader workers) inherit it. Lowering niceness needs CAP_SYS_NICE
    (or RLIMIT_NICE); without it the trial stays where it is and the note says so.
    """
    if target is None:
        return None
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current == target:
        return None
    try:
        # every thread there is already (a rank's gloo threads and Ray's were started
        # before the trial was built), this one first
        renice(os.getpid(), target)
    except OSError:
        return (f"the trial ran at nice {current} (Ray's worker niceness), not at the search's {target}: "
                f"anything at a higher priority preempted it; start Ray with RAY_worker_niceness=0")
    return None


def renice(pid: int, nice: int, only_lower_priority: bool = False) -> None:
    """Set every thread of ``pid`` to ``nice`` (Linux niceness is per thread). Raises
    OSError when the main thread may not be set; a thread that ended meanwhile is skipped.
    ``only_lower_priority``: never raise a thread's priority (niceness only goes up)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = []
    tids = [pid] + [t for t in tids if t != pid]
    for i, tid in enumerate(tids):
        try:
            current = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, max(nice, current) if only_lower_priority else nice)
        except OSError:
            if i == 0:
                raise


def classify(exc: BaseException) -> tuple[str, str]:
    """(kind, one-line reason) for an exception raised by a trial."""
    import torch

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("Caught ") and "Original Traceback" in str(exc):
        # Raised in a DataLoader worker: PyTorch re-raises "Caught X in DataLoader worker
        # process N." with the original traceback as text; keep the user's own message.
        original = [ln for ln in str(exc).strip().splitlines() if ln.strip()][-1].strip()
        text = f"{text.rstrip('.')}: {original}"
    text = text[:300]
    module = type(exc).__module__ or ""
    said = str(exc).lower()
    shm = [ln.strip() for ln in str(exc).splitlines() if "/dev/shm/nccl" in ln or "shared memory segment" in ln]
    if "nccl" in said and shm:
        # NCCL's ranks on one node could not make their buffers in /dev/shm: PyTorch's first
        # line is "unhandled system error", and NCCL's own ("Last error:") says where
        from tuner.hardware import shm_advice

        return "oom", f"out of shared memory: {shm_advice('nccl')}: {shm[-1][:200]}"
    if "out of shared memory" in said or "unable to allocate shared memory" in said:
        # a DataLoader worker's batch that /dev/shm cannot hold (or the Bus error it dies of)
        from tuner.hardware import shm_advice

        return "oom", f"out of shared memory: {shm_advice()}: {text}"
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in said:
        return "oom", f"out of memory: {text}"
    if isinstance(exc, UserError):
        return "invalid", f"invalid config: {text}"
    if isinstance(exc, WorkloadError):
        return "workload", text
    if module.startswith(("torch._dynamo", "torch._inductor")):
        return "compile", f"compile failed: {type(exc).__name__}: {text}"
    return "error", f"raised {type(exc).__name__}: {text}"


def _child(conn: Any, request: TrialRequest, output: str | None = None) -> None:
    if output:  # the process's own descriptors: DataLoader workers and C libraries write there too
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.update(request.env)
    torch_chose = request.threads_cap is not None and "OMP_NUM_THREADS" not in request.env \
        and "torch" not in sys.modules
    if torch_chose:  # Ray's own variable, not the user's: PyTorch chooses, as in the user's run
        os.environ.pop("OMP_NUM_THREADS", None)
    # A spawned child may inherit its parent's start method; put back the platform
    # default so DataLoader workers start as in the user's own script.
    mp.set_start_method(mp.get_all_start_methods()[0], force=True)
    for name in _PRELOAD:
        importlib.import_module(name)
    if request.threads_cap is not None:
        # The trial's default thread count (the torch_threads knob still overrides it) is
        # the user's: the variable they started with, else PyTorch's own choice (the
        # physical cores, where there are fewer than logical ones), at most the CPUs the
        # trial reserved; set as a call too, since the variable is read once, as torch loads.
        import torch

        given = request.env.get("OMP_NUM_THREADS", "")
        users = int(given) if given.isdigit() else torch.get_num_threads() if torch_chose else request.threads_cap
        threads = max(1, min(request.threads_cap, users))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    from tuner.hardware import oom_kills

    kills = oom_kills()
    try:
        result = execute(request, progress=lambda msg: conn.send(("progress", msg)),
                         phase=lambda name: conn.send(("phase", name)))
        conn.send(("result", result))
    except BaseException as exc:  # every failure is a result
        kind, reason = worker_killed(exc, *classify(exc), kills)
        # a knob's value refused whatever the other knobs: the search runs no other config with it
        conn.send(("error", kind, reason, traceback.format_exc(), exc.refusal if isinstance(exc, KnobRefused) else None))
    finally:
        conn.close()
        _exit_now()


def _exit_now() -> None:
    """End the trial's process once its result is sent, without the interpreter's
    teardown: with torch imported, freeing every module and object took about a second
    per trial (longer with a workload's large heap), which the driver waited out before
    the next trial, and a workload's non-daemon thread could keep it alive. What the
    teardown would do that matters is done here: the output flushed, and the process's
    own children ended (DataLoader and compile workers), as multiprocessing's exit handler
    ends daemonic ones; its resource tracker is left to see the process go and release
    what it tracks."""
    import logging
    from multiprocessing import resource_tracker

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    try:
        children = [c for c in psutil.Process().children(recursive=True) if c.pid != tracker]
    except psutil.Error:
        children = []
    _end(children, grace_s=3)
    os._exit(0)


def kill_tree(pid: int) -> None:
    """Kill a process and all its descendants, by id. The tree is stopped (SIGSTOP) before
    it is killed, and listed again until a listing finds no one new: a process that forks
    between a listing and the kill leaves its new child re-parented to init and alive (a
    Ray head whose job supervisor started a job's driver in that moment left the driver
    running for good)."""
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return
    procs: dict[int, psutil.Process] = {}
    while True:
        try:
            found = [root, *root.children(recursive=True)]
        except psutil.Error:  # the root is gone: its descendants listed so far are killed
            found = []
        new = [p for p in found if p.pid not in procs]
        if not new:
            break
        for p in new:
            with contextlib.suppress(psutil.Error):
                p.suspend()
            procs[p.pid] = p
    _end(list(procs.values()))


def _end(procs: list[psutil.Process], grace_s: float = 0.0) -> None:
    """End ``procs``: with a grace, asked to (SIGTERM), then killed if still there after
    it; without one, killed at once; either way waited for (up to 5 s after a kill).
    The multiprocessing temp dirs of those that are gone are removed: their own exit
    handler, which would have, does not run."""
    temp_dirs = {p.pid: _mp_temp_dirs(p) for p in procs}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate() if grace_s else p.kill()
    gone: list[psutil.Process] = []
    if grace_s:
        gone, procs = psutil.wait_procs(procs, timeout=grace_s)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
    gone += psutil.wait_procs(procs, timeout=5)[0]
    for p in gone:
        for folder in temp_dirs[p.pid]:
            shutil.rmtree(folder, ignore_errors=True)


def _mp_temp_dirs(proc: psutil.Process) -> set[str]:
    """The ``pymp-*`` folders of ``proc``'s listening sockets: multiprocessing makes one per
    process that shares file descriptors (a DataLoader worker handing batches over), and
    only that process's exit handler removes it, which a killed process never runs."""
    try:
        sockets = proc.net_connections(kind="unix")
    except psutil.Error:
        return set()
    folders = {os.path.dirname(s.laddr) for s in sockets if isinstance(s.laddr, str) and s.laddr}
    return {f for f in folders if os.path.basename(f).startswith("pymp-")}


def infeasible(kind: str, reason: str, request: TrialRequest, **extra: Any) -> Record:
    """The record of a trial that produced no figure: its kind and one-line reason."""
    return {"status": Status.INFEASIBLE, "error_kind": kind, "reason": reason, "samples_per_sec": None,
            "loss_finite": None, "config": request.config, "baseline": request.baseline, **extra}


def hung_reason(timeout_s: float) -> str:
    return f"hung: no result within the trial time limit of {timeout_s:.0f} s"


STALL_FACTOR = 10.0  # a trial that has stepped is hung after max(measure.stall_limit_s, this x its slowest gap)


def stall_limit(gaps: list[float], floor_s: float) -> float | None:
    """How long a trial may go without a word once it has stepped: ``gaps`` are the times
    between its progress messages (one before each warm-up step, one after each window),
    so the first gap holds the first step, compile included; ``floor_s`` is
    ``measure.stall_limit_s``. None before any step: the trial time limit is the only
    limit then."""
    return max(floor_s, STALL_FACTOR * max(gaps)) if gaps else None


def hang_limits(request: TrialRequest) -> tuple[float, float]:
    """(idle, stall): the request's ``measure.idle_limit_s`` and ``measure.stall_limit_s``,
    read through ``MeasureSettings`` as the trial's own process reads its settings."""
    from tuner.settings import MeasureSettings

    settings = MeasureSettings(**request.measure)
    return settings.idle_limit_s, settings.stall_limit_s


@contextlib.contextmanager
def _main_left_behind() -> Iterator[None]:
    """A spawned child runs its parent's main script again (as ``__mp_main__``) unless
    the main module is named ``__main__``. In a Ray worker that script is Ray's
    ``default_worker.py``: every trial would import Ray (its time, and its memory in the
    trial's peak) that the user's training never holds. The trial needs nothing from it (its
    target is ``tuner.trial._child``, its workload loaded by path), so the main module
    is given that name for the start."""
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)
    try:
        yield
    finally:
        main.__spec__ = spec


# Before its first step is over, a trial whose processes did nothing for
# ``measure.idle_limit_s`` is hung (a DataLoader worker blocked for good, the process
# waiting on it): a compile, a dataset being opened, workers starting are all busy. After
# the first step, its progress says (``stall_limit``).
LOOK_S = 2.0  # how often the parent looks at an idle-looking trial before its first step


@dataclass
class Vigil:
    """What the parent knows of a running trial: its progress messages, the phase it said
    it reached, and, before its first step is over, whether its processes do anything
    (``activity``; None where idling tells nothing: a rank of a multi-rank trial waits
    idle in a collective while another rank compiles)."""

    t0: float
    timeout_s: float
    activity: Any  # hostload.TreeActivity, or None
    idle_s: float  # measure.idle_limit_s
    stall_s: float  # measure.stall_limit_s
    last: float | None = None  # the last progress message
    gaps: list[float] = field(default_factory=list)  # between progress messages
    phase: str = "starting its process"
    phase_at: float = 0.0

    def hung(self, now: float, request: TrialRequest) -> Record | None:
        """The record of a trial found hung at ``now``, or None."""
        limit = stall_limit(self.gaps, self.stall_s)
        if limit is not None and self.last is not None and now - self.last >= limit:
            # a hang is found by its progress: a DataLoader worker blocked for good, a
            # deadlock in the loss, costs a few times the trial's own step, not the limit
            return infeasible("timeout", f"hung: no step for {now - self.last:.0f} s (limit: measure.stall_limit_s, "
                              f"or 10x the slowest gap between steps)", request)
        if not self.gaps and self.activity is not None and (idle := self.activity.idle_for(now)) >= self.idle_s:
            waited = now - (self.phase_at or self.t0)
            return infeasible("timeout", f"hung: no step after {now - self.t0:.0f} s, its processes idle for "
                              f"{idle:.0f} s ({self.phase}, for {waited:.0f} s; limit: measure.idle_limit_s)", request,
                              hung_phase=self.phase, hung_wait_s=waited)
        if now - self.t0 >= self.timeout_s:
            return infeasible("timeout", hung_reason(self.timeout_s), request, hung_phase=self.phase,
                              hung_wait_s=now - (self.phase_at or self.t0))
        return None

    def wait_s(self, now: float) -> float:
        """How long the parent may block before it has to look again."""
        until = self.t0 + self.timeout_s
        limit = stall_limit(self.gaps, self.stall_s)
        if limit is not None and self.last is not None:
            until = min(until, self.last + limit)
        if not self.gaps and self.activity is not None:
            until = min(until, now + LOOK_S)
        return max(0.0, until - now)

    def heard(self, msg: tuple, now: float, progress: Callable[[str], None] | None) -> None:
        if msg[0] == "phase":
            self.phase, self.phase_at = msg[1], now
            return
        if self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now
        if progress:
            progress(msg[1])


def out_of_descriptors(pid: int) -> str | None:
    """Why a hung trial may have stopped, where one of its processes holds (nearly) every
    file descriptor its limit allows (``ulimit -n``), or None. DataLoader workers hand each
    tensor of a batch over as a descriptor (PyTorch's default sharing on Linux), held
    until the batch is consumed: a batch of per-item tensors (detection targets, say)
    times the batches in flight can pass the limit, and the worker whose handover fails
    leaves the loader waiting for ever. (The process that hit it closes a few as its
    failed handover unwinds: ``FD_SLACK``.)"""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    for p in procs:
        try:
            soft, hard = p.rlimit(psutil.RLIMIT_NOFILE)
            held = p.num_fds()
        except (psutil.Error, AttributeError, OSError):  # no rlimit or num_fds on this OS
            continue
        if 0 < soft <= held + FD_SLACK:
            unlimited = hard == psutil.RLIM_INFINITY
            raise_to = (f"ulimit -n {65536 if unlimited else hard}" if unlimited or hard > soft else
                        "the hard limit too: limits.conf, or a container's --ulimit nofile")
            who = "the trial's process" if p.pid == pid else f"a process of the trial (pid {p.pid})"
            return (f"{who} holds {held} of the {soft} open files its limit allows: DataLoader workers hand each "
                    f"tensor of a batch over as one; raise the limit ({raise_to}) or put fewer tensors in a batch")
    return None


def killed(code: int | None, kills_before: int | None) -> tuple[str, str]:
    """(error kind, reason) of a trial process that ended without a result. Killed by
    SIGKILL while the kernel's OOM killer ended a process (its count went up), it ran out
    of memory: at its cgroup's limit (a container's, a job's), named where there is one,
    since a config that fits the host may not fit it, or at the host's. That is a result
    of the config, not retried; any other death may be a chance one."""
    if code == -9:
        if _oom_killed_since(kills_before):
            return "oom", f"out of memory: the kernel's OOM killer ended the trial's process ({_memory_held()})"
        return "died", f"trial process died: killed by signal 9 (out of memory? {_memory_held()})"
    why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return "died", f"trial process died: {why}"


def _oom_killed_since(kills_before: int | None) -> bool:
    from tuner.hardware import oom_kills

    after = oom_kills()
    return kills_before is not None and after is not None and after > kills_before


def _memory_held() -> str:
    """The memory a trial is held to: its cgroup's limit where there is one, else the host's."""
    from tuner.hardware import memory_limit

    limit = memory_limit()
    return f"this process's cgroup holds it and the trial to {limit[0] / 2**20:,.0f} MB" if limit else "the host's memory"


def worker_killed(exc: BaseException, kind: str, reason: str, kills_before: int | None) -> tuple[str, str]:
    """(kind, reason) of a trial whose DataLoader worker ended without a word (PyTorch
    raises "DataLoader worker (pid(s) N) exited unexpectedly", from "... is killed by
    signal: Killed."): out of memory where the kernel's OOM killer ended a process
    meanwhile, as the trial's own process would be."""
    chain = [str(e).lower() for e in exception_chain(exc)]
    worker = any("dataloader worker" in t and ("exited unexpectedly" in t or "killed by signal" in t) for t in chain)
    if kind != "oom" and worker and _oom_killed_since(kills_before):
        return "oom", f"out of memory: the kernel's OOM killer ended a DataLoader worker ({_memory_held()}): {reason}"
    return kind, reason


# A process within this many descriptors of its limit counts as out of them.
FD_SLACK = 8


def _run_once(request: TrialRequest, timeout_s: float, progress: Callable[[str], None] | None,
              output: str | None = None) -> Record:
    from tuner.hardware import oom_kills
    from tuner.hostload import TreeActivity

    kills = oom_kills()
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, request, output), daemon=False)
    t0 = time.perf_counter()
    with _main_left_behind():
        proc.start()
    send.close()
    vigil = Vigil(t0, timeout_s, TreeActivity(proc.pid, request.env.get("CUDA_VISIBLE_DEVICES")
                                               if request.device != "cpu" else None), *hang_limits(request))
    result: Record | None = None
    while result is None:
        now = time.perf_counter()
        result = vigil.hung(now, request)
        if result is not None:
            if why := out_of_descriptors(proc.pid):
                result["reason"] += f"; {why}"
            kill_tree(proc.pid)
            break
        try:
            # Blocks until the child writes (once per window) or a limit: the parent
            # wakes for nothing else while the trial measures.
            if not recv.poll(vigil.wait_s(now)):
                continue
            msg = recv.recv()
        except (EOFError, OSError):
            proc.join(5)
            result = infeasible(*killed(proc.exitcode, kills), request)
            break
        if msg[0] in ("progress", "phase"):
            vigil.heard(msg, time.perf_counter(), progress)
        elif msg[0] == "result":
            result = msg[1]
        else:
            _, kind, reason, tb, refused = msg
            result = infeasible(kind, reason, request, traceback=tb, **({"refused": refused} if refused else {}))
    proc.join(10)
    if proc.is_alive():
        kill_tree(proc.pid)
    result["trial_wall_s"] = time.perf_counter() - t0
    return result


def run_isolated(request: TrialRequest, timeout_s: float = 600.0,
                 progress: Callable[[str], None] | None = None, retries: int = 1,
                 output: str | None = None) -> Record:
    """Measure ``request`` in a fresh process; never raises for a failing trial.

    A process that dies (a signal, not an exception) is retried ``retries`` times; one
    the kernel's OOM killer ended is out of memory, not retried (``killed``).
    ``output``: a file the process's stdout and stderr are appended to (the workload's
    own prints, warnings and progress bars), instead of this process's.
    """
    for attempt in range(retries + 1):
        result = _run_once(request, timeout_s, progress, output)
        if result.get("error_kind") != "died" or attempt == retries:
            result["attempts"] = attempt + 1
            return result
        if progress:
            progress(f"{result['reason']}; retrying")
    raise AssertionError("unreachable")
