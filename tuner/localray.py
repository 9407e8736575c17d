"""The local Ray a search starts (quiet: no dashboard, no log monitor, slow timers) or
the cluster it attaches to, the processes that are Ray's rather than a trial's, and the
SIGTERM handler kept through ``ray.init``."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tuner.errors import UserError
from tuner.hardware import usable_cores


@contextlib.contextmanager
def ray_internal_replaced(module: Any, name: str, stand_in: Any) -> Iterator[None]:
    """``module.name`` (one of Ray's internals) replaced by ``stand_in`` for the block and
    put back after; left alone where this Ray has no such attribute."""
    original = getattr(module, name, None)
    if original is None:
        yield
        return
    setattr(module, name, stand_in)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def keep_sigterm() -> Iterator[None]:
    """Keep the command's SIGTERM handler (a stop that cleans up and says to resume)
    through ``ray.init``: Ray installs its own, in Python (exit 15, or 1 after killing
    the node's processes) and then in its core worker (a crash report, exit 15)."""
    handler = signal.getsignal(signal.SIGTERM)
    if not callable(handler) or threading.current_thread() is not threading.main_thread():
        yield
        return
    import ray._private.utils as ray_utils

    try:
        with ray_internal_replaced(ray_utils, "set_sigterm_handler", lambda _handler: None):
            yield
    finally:
        signal.signal(signal.SIGTERM, handler)  # over the core worker's


def shutdown_ray(log: Path) -> None:
    """``ray.shutdown()``, with what this process writes to its stderr meanwhile kept in
    ``log`` (left only where something was written). The driver's core worker logs from
    C++ straight to file descriptor 2: a trial cut by a stop fails as the GCS goes, and
    the core worker reports it can no longer say so ("Failed to push error to driver"),
    a line that would sit above the stop's own one-line message."""
    import ray

    sys.stderr.flush()
    try:
        sink = open(log, "ab")
    except OSError:  # an unwritable results folder: Ray's lines go where they would
        ray.shutdown()
        return
    saved = os.dup(2)
    try:
        os.dup2(sink.fileno(), 2)
        try:
            ray.shutdown()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
    finally:
        os.close(saved)
        sink.close()
        with contextlib.suppress(OSError):
            if log.stat().st_size == 0:
                log.unlink()


def check_address(address: str | None) -> None:
    """Refuse an address the search cannot run against, before anything starts."""
    if address and address.startswith("ray://"):
        # Ray Client moves Tune's loop into a task on the cluster: the search's decisions and
        # its results would be made there, away from this process and its results folder.
        raise UserError(f"--address {address}: Ray Client (ray://) is not supported; submit the search "
                        f"as a Ray Job (`python -m tuner submit SPACE --address http://HEAD:8265 --wait`), "
                        f"or run it on a node of the cluster with --address HEAD:6379")


def start_ray(address: str | None, state_api: bool = True) -> bool:
    """Start a local Ray, or attach to ``address``; True when this call started it.
    ``state_api``: a local Ray starts the head process that answers Ray's state API,
    which Ray Train reads (multi-rank trials); see ``start_local_ray``."""
    import ray

    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the old engine honours verbose=0
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    if ray.is_initialized():
        return False
    check_address(address)
    if not address and not _can_raise_priority():
        # Ray starts its workers at nice 15; a trial that cannot put itself back at the
        # user's niceness (tuner.trial.run_at_niceness) would be preempted by everything.
        os.environ.setdefault("RAY_worker_niceness", "0")
    kwargs: dict[str, Any] = {"logging_level": logging.ERROR, "log_to_driver": False,
                              "configure_logging": True}
    try:
        if address:
            ray.init(address=address, **kwargs)
        else:
            start_local_ray(state_api=state_api, **kwargs)
    except (ConnectionError, RuntimeError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not address and "AF_UNIX path" in first:
            # Ray puts its sockets in a session folder under RAY_TMPDIR, else TMPDIR
            first = f"set RAY_TMPDIR (or TMPDIR) to a shorter folder: {first}"
        raise UserError(f"--address {address}: cannot connect to Ray ({first})" if address
                        else f"cannot start a local Ray: {first}") from None
    return True


# Ray's bookkeeping that a local search has no reader for (no dashboard, no logs sent to
# the driver, no metrics scraped, no state API), which runs beside every trial on the
# cores it measures: with Ray's defaults the log monitor reads its files every 0.1 s and
# the dashboard agent gathers metrics from every process (``benchmarks/tuner_cpu.py``
# measures what each costs beside a trial). The raylet's own timers, from 0.1-0.2 s to
# 1 s: its check of the object store's memory pressure (to ask workers for a GC), the
# object manager's tick (pulls and pushes between nodes: a local Ray is one node), its
# disk-full check, and its culling of idle workers; together they wake it many times a
# second beside a sleeping trial. Its resource reports to the GCS (0.1 s) are left:
# placement groups, one per trial, are scheduled from them. So is its memory monitor
# (0.25 s): Ray's OOM killer, which a trial that runs away with memory needs.
QUIET_RAY_CONFIG: dict[str, Any] = {
    "enable_metrics_collection": False,
    "metrics_report_interval_ms": 60_000,
    "task_events_report_interval_ms": 10_000,
    "raylet_check_gc_period_milliseconds": 1000,
    "object_manager_timer_freq_ms": 1000,
    "local_fs_monitor_interval_ms": 1000,
    "kill_idle_workers_interval_ms": 1000,
    # An idle worker beyond Ray's soft limit (one per CPU) is ended after 1 s by default:
    # on a small machine the worker that measured the baseline was, during the Tune run,
    # and the confirm rounds paid a new worker's start. Kept an hour, the confirm rounds
    # run where the baseline ran.
    "idle_worker_killing_time_threshold_ms": 3_600_000,
    # Ray's memory monitor ends Ray workers (a trial's actor and task) once the node's
    # memory passes its threshold, and Ray Tune stops the whole search on that error.
    # Without it, the kernel's OOM killer ends the process that holds the memory (the
    # trial's own, or a rank's), which the search records as out of memory and goes past.
    "memory_monitor_refresh_ms": 0,
}


# The dashboard agent's, read from the environment it starts in: its reporter reads every
# process's stats each 5 s for the dashboard, and it checks that the raylet lives every
# 0.4 s: CPU beside every trial.
QUIET_RAY_ENV = {"REPORTER_UPDATE_INTERVAL_MS": "60000", "RAY_DASHBOARD_AGENT_CHECK_PARENT_INTERVAL_S": "2"}


# What ``ray.init`` starts on a head node that a local search has no use for, and has no
# switch for (``ray start`` has flags for both): the log monitor, which reads Ray's log
# files every 0.1 s for drivers that want workers' output, and the autoscaler's monitor,
# which has nothing to scale on one machine and no reader for its status without
# ``ray status`` (``benchmarks/tuner_cpu.py`` measures what each costs beside a trial).
QUIET_RAY_PARAMS: dict[str, Any] = {"include_log_monitor": False, "no_monitor": True}


def _no_api_server(node: Any, **_: Any) -> None:
    """``Node.start_api_server`` of a local search whose trials have one rank: none.
    Without the dashboard, Ray still starts its head process, for its state API and the
    usage-stats report, and waits for it to register (part of every start); it then holds
    memory and wakes several times a second beside every trial. Ray
    Train reads the state API (its placement-group cleaner asks whether the run's
    controller lives, and waits 10 s for an answer that never comes without it), so a
    search with several ranks keeps it."""


def start_local_ray(state_api: bool = True, **kwargs: Any) -> None:
    """``ray.init`` of a Ray on this machine for a search or a bench: no dashboard (nor
    its head process without ``state_api``: ``_no_api_server``), no log monitor or
    autoscaler monitor (``QUIET_RAY_PARAMS``), metrics and task events off or rare, the
    raylet's timers rarer (``QUIET_RAY_CONFIG``, ``QUIET_RAY_ENV``).
    ``ray.init`` has no switch for the two monitors; the parameters it builds are given
    ``QUIET_RAY_PARAMS`` as defaults, each where Ray's version has that field, and Ray's
    own defaults otherwise."""
    import ray

    kwargs.setdefault("include_dashboard", False)
    # Ray counts a cgroup's CPU quota but not the process's CPU affinity: on 8 cores of a
    # 64-core node (Slurm, taskset) it would plan trials, and their threads, for 64
    kwargs.setdefault("num_cpus", usable_cores())
    # a new Ray, never one found on the machine: `ray start` or a Cluster left its address
    # file behind (a stale one, once its cluster died, failed every local search here)
    kwargs.setdefault("address", "local")
    for name, value in QUIET_RAY_ENV.items():  # what you set yourself stands
        os.environ.setdefault(name, value)
    kwargs["_system_config"] = {**QUIET_RAY_CONFIG, **(kwargs.get("_system_config") or {})}
    try:
        from ray._private import parameter
    except ImportError:  # the private module moved: Ray starts its monitors
        ray.init(**kwargs)
        return
    base = parameter.RayParams
    quiet = {k: v for k, v in QUIET_RAY_PARAMS.items() if k in base.__init__.__code__.co_varnames}
    if not quiet:
        ray.init(**kwargs)
        return

    class _Quiet(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **{**quiet, **kw})

    from ray._private import node

    parameter.RayParams = _Quiet
    try:
        with (contextlib.nullcontext() if state_api
              else ray_internal_replaced(node.Node, "start_api_server", _no_api_server)):
            ray.init(**kwargs)
    finally:
        parameter.RayParams = base


def _can_raise_priority() -> bool:
    """Whether a process of this user may lower its niceness back to 0."""
    import resource

    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


def link_ray_logs(out: Path) -> None:
    """results/<name>/ray_logs -> this Ray session's log folder (local sessions only).

    Ray's socket paths limit how long its temp dir may be, so the logs stay where Ray
    puts them and the results folder points at them; trials' own output is written into
    the experiment folder (``log_to_file``)."""
    try:
        import ray

        node = ray._private.worker._global_node  # no public API for the session dir
        link = out / "ray_logs"
        if node is not None and not link.is_symlink():
            link.symlink_to(Path(node.get_session_dir_path()) / "logs")
    except Exception:  # a remote cluster, or the private API moved: nothing to link
        pass


def attached() -> bool:
    """Whether this driver attached to a cluster it did not start."""
    try:
        import ray

        return ray._private.worker._global_node is None or not ray._private.worker._global_node.head
    except Exception:
        return True


def tuner_processes(local: bool) -> list[int]:
    """The tuner's own processes beside a trial: this driver and, for a Ray started here,
    its daemons (GCS, dashboard head and agents...; Ray's workers, which run the
    trials, excluded). Their CPU use during every timed window is recorded
    (``tuner_cpu_cores``); the daemons are also given a lower priority (SCHED_IDLE, or
    nice 10: ``_lower_priority``), so that what they still need waits for the trial
    rather than the other way round.
    The raylet keeps its priority: the workers it starts inherit it, trials included.
    Only Ray's: the driver's other children (a notebook's, a script's own, the plain loop
    that ``benchmarks/truth.py`` runs beside a trial) are neither lowered nor counted.
    """
    import psutil
    import ray

    me = psutil.Process()
    pids = [me.pid]
    if not local:
        return pids
    ray_dir = os.path.dirname(ray.__file__) + os.sep
    try:
        procs = me.children(recursive=True)
    except psutil.Error:
        return pids
    roots: set[int] = set()  # Ray's daemons: their binary or script lies in Ray's package
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if any(a.startswith(ray_dir) for a in p.cmdline()[:3]):
                roots.add(p.pid)
    for p in procs:
        try:
            name, cmd, parents = p.name(), p.cmdline(), p.parents()
            if p.pid not in roots and not any(q.pid in roots for q in parents):
                continue  # not Ray's, nor started by Ray (the raylet's agents and workers)
            if is_ray_worker(name) or any(is_ray_worker(a) for a in cmd[:1]):
                continue  # a worker (an idle one may run the next trial)
            if any(is_ray_worker(q.name()) for q in parents):
                continue  # under a worker: a trial's own processes
        except psutil.Error:
            continue
        pids.append(p.pid)
        if name != "raylet":
            _lower_priority(p.pid)
    return pids


# Ray's per-node agents take a "ray::" process title as its workers do, but are daemons:
# at nice 0 and left out, the dashboard agent's metrics used CPU beside a trial, counted as
# interference rather than as the tuner's own.
_RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def is_ray_worker(name: str) -> bool:
    """Whether a process title is a Ray worker's (a trial may run there), not a per-node agent's."""
    return name.startswith("ray::") and not name.startswith(_RAY_AGENTS)


def _lower_priority(pid: int, nice: int = 10) -> None:
    """``pid`` at nice 10 and every thread of it at SCHED_IDLE: it runs on a core the
    trial leaves idle, and does not preempt the trial when it wakes (``benchmarks/ray_cost.py``
    measures what Ray's processes cost a loop beside them, at each setting). Threads the daemon starts later inherit the policy; its
    children (no trial among them: the raylet starts the workers, and it keeps its
    priority) too. A thread may always give up priority this way: no privilege needed."""
    from tuner.trial import renice

    with contextlib.suppress(OSError):  # a daemon that ended, or one of another user
        renice(pid, nice, only_lower_priority=True)
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        with contextlib.suppress(OSError, AttributeError):  # a thread that ended; not Linux
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
