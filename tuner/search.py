"""``tuner run``: the search, with Ray Tune scheduling trials and Optuna choosing them.

Order of a search:

1. validate the space and import the workload (errors before Ray starts);
2. start Ray (in-process) or attach to ``--address``;
3. measure the baseline (the plain PyTorch loop) as a Ray task;
4. ``Tuner.fit`` with ``OptunaSearch`` (our ``GuidedSampler`` by default, Optuna's
   study kept in a journal file); the first trials are PyTorch's defaults in the
   optimized loop and the guides' recommended config; one trial per config,
   resources from the config;
   every trial runs in its own process (``tuner.trial.run_isolated``) so that a
   hang, crash or OOM is a result, and is written to ``trials.jsonl`` as it lands;
5. re-measure the top configs (``confirm``), interleaved with the baseline, and choose
   the winner on the median of all of its measurements (``budget.trials`` counts these
   re-measurements: ``SpaceModel.search_trials`` configs are tried, the rest confirm);
6. write ``summary.json`` and print the top configs against the baseline.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tuner import knobs, spec
from tuner.distributed import cluster_shape
from tuner.errors import ResultsUnwritable, Stopped, UserError
from tuner.records import (
    aggregate,
    apply_constraints,
    baseline_of,
    best_of,
    cold_compile_of,
    logged_metrics,
    no_winner_reason,
    objective_values,
    pareto_front,
    rank,
    read_trials,
    speedup,
    winner_first,
    with_cold_compile,
    within_noise,
    writer_lock,
)
from tuner.tables import Progress

# ---- keys of what a config really runs ---------------------------------------------------


def canonical(config: dict, ctx: knobs.Context) -> str:
    """A key of what a config really runs: inactive knobs held at their default."""
    full, _ = knobs.resolve(config, ctx, strict=False)
    return json.dumps(full, sort_keys=True)


# ---- the trial, as Ray runs it -----------------------------------------------------------


@dataclass
class TrialJob:
    """What every measurement of one search shares: the trainable, the baseline and
    the confirm tasks get it from Ray (so it holds nothing that cannot be pickled)."""

    workload: str
    workload_args: dict
    base_dir: str
    device: str  # as the space asks: auto, cpu or cuda
    measure: dict
    run: dict
    seed: int
    trial_timeout_s: float
    constraints: Any
    objective: Any
    fixed: dict
    derive: Callable[[dict], dict]  # searched knobs -> the config a trial runs (spec.Space.derive)
    cpus_per_trial: Callable[[dict], float]
    gpus_per_rank: int
    spread_ranks: bool = False
    ddp_backend: str = "gloo"
    observers: list[int] = field(default_factory=list)  # the tuner's own processes beside a trial
    compile_root: str | None = None  # one inductor cache per compile group under it
    hush_dir: str | None = None  # where a trial in its timed windows says so (``measure.hushed``)
    nice: int = 0  # the driver's niceness: trials run at it, not at Ray's worker niceness

    def knob_config(self, searched: dict) -> dict:
        """The full config a trial runs, from the knobs the sampler chose (the Board's
        state that the driver adds to a Tune trial's config left out)."""
        return self.derive({**self.fixed, **{k: v for k, v in searched.items() if k != BOARD_KEY}})


def _compile_cache(knob_config: dict, job: TrialJob) -> str | None:
    key = compile_group_key(knob_config, job.workload, job.workload_args)
    if key is None or not job.compile_root:
        return None
    return os.path.join(job.compile_root, key)  # on the node that runs the trial


def compile_group_key(knob_config: dict, workload: str, workload_args: dict) -> str | None:
    """The compile group of a config (None when it does not compile)."""
    if knob_config.get("compile", "off") == "off":
        return None
    import hashlib

    what = [workload, workload_args, knobs.compile_group(knob_config)]
    return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _measure(knob_config: dict, job: TrialJob, baseline: bool = False, screen: dict | None = None) -> dict:
    """Measure one config in a child process, or through Ray Train when it has several
    ranks; returns the record (never raises)."""
    from tuner.trial import make_request, run_isolated

    env = {}
    cpus = job.cpus_per_trial(knob_config)
    env["OMP_NUM_THREADS"] = str(int(cpus))
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    if job.hush_dir:
        from tuner.measure import HUSH_ENV

        env[HUSH_ENV] = job.hush_dir
    request = make_request(workload=job.workload, workload_args=job.workload_args,
                           base_dir=job.base_dir, config=knob_config, baseline=baseline,
                           device=job.device, measure=job.measure, run=job.run,
                           seed=job.seed, env=env,
                           observers=[os.getpid(), *job.observers], screen=screen,
                           compile_cache=_compile_cache(knob_config, job), nice=job.nice)
    started = time.time()
    world = int(knob_config.get("world_size", 1))
    if world > 1:
        from tuner.distributed import run_ranks

        record = run_ranks(request, timeout_s=job.trial_timeout_s, spread=job.spread_ranks,
                           use_gpu=job.gpus_per_rank > 0, backend=job.ddp_backend)
    else:
        record = run_isolated(request, timeout_s=job.trial_timeout_s)
    record.update(started_at=started, ended_at=time.time())
    record.pop("traceback", None)
    try:
        import ray

        record["node"] = ray.get_runtime_context().get_node_id()
        record["node_ip"] = ray.util.get_node_ip_address()
        record["gpu_ids"] = [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # outside Ray (tests of this function)
        record["node"], record["gpu_ids"] = None, []
    record["cpus_reserved"] = cpus if world == 1 else world * knobs.process_cpus(knob_config)
    record["compile_group"] = compile_group_key(knob_config, job.workload, job.workload_args)
    record["workload"] = {"ref": job.workload, "args": job.workload_args}
    hw = record.get("hardware") or {}
    record["gpu_model"] = hw.get("gpu")
    return apply_constraints(record, job.constraints)


BOARD_KEY = "tuner_board"  # the Board's state in a Tune trial's config (JSON)


class Board:
    """What a trial needs to know of the search so far, for screening: the incumbent's
    figure and the noise seen so far; and the cold compile cost of each compile group.
    The driver holds it, updates it as results land, and hands its state to each Tune
    trial in the trial's config (``BOARD_KEY``) as Optuna's suggestion is made, just
    before the trial starts (the trainable's parameters are fixed when Tune starts).
    It was once a Ray actor that trials asked: an idle actor's process used 0.006-0.011
    cores beside every trial here (Ray's core worker timers), out of the trial's cores.

    The rule is Optuna's ThresholdPruner with a threshold that moves with the
    incumbent, applied inside the trial process between windows (``measure``), where
    stopping costs nothing: a Tune scheduler would stop the trial by killing its actor,
    and with it the process that measures.

    The threshold is a figure from the past. After ``recheck_after`` screened trials in
    a row, the next trial first measures the incumbent again (phase ``recheck``), and
    that figure becomes the threshold: on a machine that slowed since, the incumbent
    reads lower too. (In a conv search here the VM slowed 30% after the first trial and
    screened out the 10 trials after it, among them the config a stock search picked,
    which re-measured 1.3x the tuner's pick.)
    """

    def __init__(self, min_margin: float = 0.05, screening: bool = True, recheck_after: int = 0):
        self.best: float | None = None
        self.incumbent: dict | None = None  # the config behind ``best``
        self.errors: list[float] = []
        self.min_margin = min_margin
        self.screening = screening
        self.recheck_after = recheck_after
        self.screened_in_a_row = 0
        self.cold: dict[str, float] = {}  # compile group -> the compile its first trial paid
        self.best_error = 0.0

    def update(self, record: dict) -> None:
        if record.get("compile_cache") == "cold" and record.get("compile_s") is not None:
            self.cold.setdefault(record.get("compile_group"), record["compile_s"])
        ok = record.get("status") == "ok" and not record.get("disturbed")
        value = record.get("samples_per_sec")
        if record.get("phase") == "recheck":
            if ok and value is not None:
                self.best = value  # the incumbent as the machine runs it now
            return
        if ok and record.get("screened"):
            self.screened_in_a_row += 1
        if not ok or record.get("screened"):
            return
        self.screened_in_a_row = 0
        if value is not None and (self.best is None or value > self.best):
            self.best, self.incumbent = value, record.get("config")
            self.best_error = record.get("samples_per_sec_error") or 0.0
        if record.get("samples_per_sec_error") is not None:
            self.errors.append(record["samples_per_sec_error"])

    def screen(self) -> dict | None:
        """The threshold for the next trial, or None before any full measurement.
        The allowance is 3x the median window error seen so far, at least min_margin
        (run-to-run drift on a shared machine exceeds one measurement's own error),
        plus twice the incumbent's own error.
        ``recheck``: the incumbent's config, to measure before the trial (once per run
        of ``recheck_after`` screened trials)."""
        if self.best is None or not self.screening:
            return None
        margin = max(self.min_margin, 3 * statistics.median(self.errors)) if self.errors else 2 * self.min_margin
        # The incumbent is the highest of several noisy figures, so likely one read high:
        # its own error widens the allowance (replayed, this took the share of screened
        # configs within 3% of the pick from 4-10% to at most 3.4% on every landscape).
        margin += 2 * self.best_error
        out: dict = {"below": self.best, "margin": margin}
        if self.recheck_after and self.screened_in_a_row >= self.recheck_after and self.incumbent is not None:
            out["recheck"] = self.incumbent
            self.screened_in_a_row = 0  # asked once: concurrent trials do not all re-measure it
        return out

    def state(self, screen: bool = True) -> str:
        """What a trial gets (``BOARD_KEY``): the screen (none for a config measured in
        full again after it was screened), and the cold compile costs."""
        return json.dumps({"screen": self.screen() if screen else None, "cold": self.cold})


def _with_compile_cost(record: dict, cold: dict[str, float]) -> dict:
    """A warm-cache trial's record with its group's cold compile cost (``projected_run_s``
    keeps what a user's first run pays)."""
    if record.get("compile_cache") == "warm":
        return with_cold_compile(record, cold.get(record.get("compile_group") or ""))
    if record.get("compile_cache") == "cold":
        return with_cold_compile(record, None)
    return record


def rescreen(screen: dict, recheck: dict) -> dict:
    """The screen after the incumbent was measured again (``Board.update`` on a recheck,
    done in the trial: the incumbent as the machine runs it now, where that
    measurement is sound)."""
    screen = {k: v for k, v in screen.items() if k != "recheck"}
    value = recheck.get("samples_per_sec")
    if recheck.get("status") == "ok" and not recheck.get("disturbed") and value is not None:
        screen["below"] = value
    return screen


def _trainable(config: dict, job: TrialJob) -> None:
    from ray import tune

    knob_config = job.knob_config(config)
    board = json.loads(config.get(BOARD_KEY) or "{}")
    screen, cold = board.get("screen"), board.get("cold") or {}
    report: dict = {}
    if screen and screen.get("recheck"):
        # the incumbent again first: the threshold as the machine runs now
        recheck = _with_compile_cost(_measure(screen["recheck"], job), cold)
        recheck["phase"] = "recheck"
        screen = rescreen(screen, recheck)
        report["recheck"] = json.dumps(recheck, default=str)
    record = _with_compile_cost(_measure(knob_config, job, screen=screen), cold)
    record["phase"] = "search"
    record["trial_id"] = tune.get_context().get_trial_id()
    report.update(objective_values(record, job.objective))
    report.update(logged_metrics(record))
    report["record"] = json.dumps(record, default=str)
    tune.report(report)


# ---- the search ------------------------------------------------------------------------


class Recorder:
    """Appends every measurement to trials.jsonl as it lands (fsync'd: a kill loses nothing)."""

    def __init__(self, path: Path, ctx: knobs.Context):
        self.path, self.ctx = path, ctx
        self.records: list[dict] = []
        self.failure: ResultsUnwritable | None = None  # raised where Tune would wrap it
        if path.exists():
            self.records = read_trials(path)
            text = path.read_bytes()
            if text and not text.endswith(b"\n"):  # a torn last line: cut it before appending
                with path.open("r+b") as f:
                    f.truncate(text.rfind(b"\n") + 1)

    def add(self, record: dict) -> dict:
        if "key" not in record:
            try:
                record["key"] = canonical(record["config"], self.ctx)
            except UserError:  # a config that cannot run here (its record says why)
                record["key"] = json.dumps(record["config"], sort_keys=True, default=str)
        record["time"] = time.time()
        line = (json.dumps(record, default=str) + "\n").encode()
        size = self.path.stat().st_size if self.path.exists() else 0
        try:
            with self.path.open("ab") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            with contextlib.suppress(OSError):  # no torn line left behind
                os.truncate(self.path, size)
            self.failure = ResultsUnwritable(
                f"{self.path}: cannot write ({exc.strerror or exc}); the {len(self.records)} measurements before "
                f"it are kept; make room, then `python -m tuner resume {self.path.parent}`")
            raise self.failure from None
        self.records.append(record)
        return record


@contextlib.contextmanager
def _writable(out: Path) -> Iterator[None]:
    """A results folder that cannot be created or written (read-only, full) is one line."""
    try:
        yield
    except OSError as exc:
        about_out = exc.filename is not None and str(exc.filename).startswith(str(out))
        if not (about_out or exc.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT)):
            raise
        raise ResultsUnwritable(f"{exc.filename or out}: cannot write the results folder "
                                f"({exc.strerror or exc})") from None


@contextlib.contextmanager
def _keep_sigterm() -> Iterator[None]:
    """Keep the command's SIGTERM handler (a stop that cleans up and says to resume)
    through ``ray.init``: Ray installs its own, in Python (exit 15, or 1 after killing
    the node's processes) and then in its core worker (a crash report, exit 15)."""
    handler = signal.getsignal(signal.SIGTERM)
    if not callable(handler) or threading.current_thread() is not threading.main_thread():
        yield
        return
    import ray._private.utils as ray_utils

    setter = getattr(ray_utils, "set_sigterm_handler", None)
    ray_utils.set_sigterm_handler = lambda _handler: None
    try:
        yield
    finally:
        if setter is not None:
            ray_utils.set_sigterm_handler = setter
        signal.signal(signal.SIGTERM, handler)  # over the core worker's


def _start_ray(address: str | None) -> bool:
    """Start a local Ray, or attach to ``address``; True when this call started it."""
    import ray

    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the old engine honours verbose=0
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    if ray.is_initialized():
        return False
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
            start_local_ray(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
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
# disk-full check, and its culling of idle workers; they woke it about a hundred times a
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
}
# The dashboard agent's, read from the environment it starts in: its reporter reads every
# process's stats each 5 s for the dashboard, and it checks that the raylet lives every
# 0.4 s (0.0055-0.006 cores beside a trial with the config above; 0.0015-0.002 with these).
QUIET_RAY_ENV = {"REPORTER_UPDATE_INTERVAL_MS": "60000", "RAY_DASHBOARD_AGENT_CHECK_PARENT_INTERVAL_S": "2"}


# What ``ray.init`` starts on a head node that a local search has no use for, and has no
# switch for (``ray start`` has flags for both): the log monitor, which reads Ray's log
# files every 0.1 s for drivers that want workers' output (0.010 cores beside a trial),
# and the autoscaler's monitor, which has nothing to scale on one machine and no reader
# for its status without ``ray status`` (0.002 cores, 18 wake-ups a second).
QUIET_RAY_PARAMS: dict[str, Any] = {"include_log_monitor": False, "no_monitor": True}


def start_local_ray(**kwargs: Any) -> None:
    """``ray.init`` of a Ray on this machine for a search or a bench: no dashboard, no
    log monitor or autoscaler monitor (``QUIET_RAY_PARAMS``), metrics and task events off
    or rare, the raylet's timers rarer (``QUIET_RAY_CONFIG``, ``QUIET_RAY_ENV``).
    ``ray.init`` has no switch for the two monitors; the parameters it builds are given
    ``QUIET_RAY_PARAMS`` as defaults, each where Ray's version has that field, and Ray's
    own defaults otherwise."""
    import ray

    kwargs.setdefault("include_dashboard", False)
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

    parameter.RayParams = _Quiet
    try:
        ray.init(**kwargs)
    finally:
        parameter.RayParams = base


def _can_raise_priority() -> bool:
    """Whether a process of this user may lower its niceness back to 0."""
    import resource

    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


def _link_ray_logs(out: Path) -> None:
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


def meta_created(out: Path) -> str:
    """When the search in ``out`` was created (meta.json), to tell searches of one name apart."""
    try:
        return str(json.loads((out / "meta.json").read_text()).get("created"))
    except (OSError, ValueError):
        return ""


def _attached() -> bool:
    """Whether this driver attached to a cluster it did not start."""
    try:
        import ray

        return ray._private.worker._global_node is None or not ray._private.worker._global_node.head
    except Exception:
        return True


def plan_resources(space: spec.Space, shape: dict) -> tuple[str, Callable[[dict], float], int, int]:
    """(device, cpus_per_trial(config), gpus_per_trial, max_concurrent)."""
    requested = space.model.device
    gpus_total = shape["gpus"]
    device = "cuda" if (requested == "cuda" or (requested == "auto" and gpus_total > 0)) else "cpu"
    if device == "cuda" and gpus_total == 0:
        raise UserError("device: 'cuda' was asked for but the Ray cluster has no GPUs")
    node_cpus = max(1, shape["max_node_cpus"])
    gpt = space.model.resources.gpus_per_trial if device == "cuda" else 0
    if device == "cuda" and gpt == 0:
        raise UserError("resources.gpus_per_trial: a GPU search needs at least 1 GPU per trial")
    if gpt > gpus_total:
        raise UserError(f"resources.gpus_per_trial: {gpt} GPUs per trial but the cluster has {gpus_total}")
    if space.model.resources.max_concurrent:
        concurrent = space.model.resources.max_concurrent
    elif device == "cuda":
        concurrent = max(1, gpus_total // gpt)  # one trial per GPU (or GPU group)
    else:
        concurrent = 1  # CPU trials disturb each other's timing: one at a time
    exclusive = device == "cpu" and concurrent == 1

    def cpus_per_trial(config: dict) -> float:
        if exclusive:
            return node_cpus  # the trial owns the machine; its threads may use every core
        return min(node_cpus, knobs.process_cpus(config))

    return device, cpus_per_trial, gpt, concurrent


def driver_bundle(config: dict, cpus_per_trial: Callable[[dict], float], gpus_per_trial: int) -> dict:
    """What the Ray task or Tune trial that measures ``config`` reserves: the trial's
    CPUs and GPUs; nothing for several ranks, which reserve their own through Ray
    Train (``tuner.distributed``) beside the trial that drives them."""
    if config.get("world_size", 1) > 1:
        return {}
    bundle = {"CPU": cpus_per_trial(config)}
    if gpus_per_trial:
        bundle["GPU"] = gpus_per_trial
    return bundle


class SearchSpace:
    """Optuna's define-by-run space: conditional knobs asked only where they apply.

    A class rather than a closure: Ray pickles the searcher into its experiment folder.
    """

    def __init__(self, space: spec.Space, ctx: knobs.Context):
        self.searched, self.fixed, self.ctx = space.searched, space.fixed, ctx
        # knobs that others depend on (num_workers) are asked first
        self.order = sorted(self.searched, key=lambda k: (knobs.KNOBS[k].inactive is not None, k))

    def _applies(self, name: str, chosen: dict) -> bool:
        inactive = knobs.KNOBS[name].inactive
        return inactive is None or not inactive({**knobs.defaults(), **chosen}, self.ctx)

    def __call__(self, trial: Any) -> None:
        chosen: dict[str, Any] = dict(self.fixed)
        for name in self.order:
            if self._applies(name, chosen):
                chosen[name] = trial.suggest_categorical(name, self.searched[name])

    def active(self, config: dict) -> dict:
        """The searched params that apply to ``config`` (what Optuna would be asked)."""
        chosen: dict[str, Any] = dict(self.fixed)
        out = {}
        for name in self.order:
            if self._applies(name, {**chosen, **config}):
                out[name] = chosen[name] = config[name]
        return out


class Canonical:
    """Picklable ``config -> key`` for the guided sampler (fixed knobs and derivations applied)."""

    def __init__(self, space: spec.Space, ctx: knobs.Context):
        self.space, self.ctx = space, ctx

    def __call__(self, config: dict) -> str:
        return canonical(self.space.derive({**self.space.fixed, **config}), self.ctx)


def make_sampler(space: spec.Space, ctx: knobs.Context, start: list[dict]) -> Any:
    import optuna

    m = space.model
    seed = m.seed
    if m.sampler == "guided":
        direction = "maximize" if spec.OBJECTIVE_METRICS[m.objective.metric] == "max" else "minimize"
        from tuner.sampler import GuidedSampler

        return GuidedSampler(space.searched, start, Canonical(space, ctx), direction=direction, seed=seed,
                             cores=ctx.cpu_count if ctx.device == "cpu" else None)
    if m.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if m.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if m.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    if m.sampler == "grid":
        return optuna.samplers.RandomSampler(seed=seed)  # the grid's points are enqueued in _fit
    raise AssertionError(m.sampler)


def run_search(space: spec.Space, *, results_root: Path, address: str | None = None,
               resume: bool = False, quiet: bool = False) -> dict:
    """Run the search and write results/<name>/; returns the summary."""
    import ray

    m = space.model
    spec.check_name(m.name)
    out = (results_root / m.name).resolve()
    with _writable(out), writer_lock(out):  # one writer per results folder: a second run/resume is refused
        trials_path = out / "trials.jsonl"
        if trials_path.exists() and not resume:
            raise UserError(f"name: results for '{m.name}' already exist in {out}; continue them with "
                            f"`python -m tuner resume {out}` or pick another --name")
        if resume and not trials_path.exists():
            raise UserError(f"{out} holds no search to resume (no trials.jsonl)")
        if not resume:
            # The resolved space (CLI overrides applied) and where its workload lives: resume reads these.
            (out / "space.yaml").write_text(yaml.safe_dump(m.model_dump(mode="json"), sort_keys=False))
            (out / "meta.json").write_text(json.dumps({
                "space_file": str(space.path) if space.path else None, "base_dir": str(space.base_dir),
                "created": time.time(), "tuner": __import__("tuner").__version__}, indent=1))
            trials_path.touch()  # a search stopped before its first trial is resumed like any other
        sessions = len([p for p in out.glob("ray*") if p.name == "ray" or p.name.startswith("ray-resume-")])

        progress = Progress(m.search_trials(), m.objective.metric, quiet)
        progress.update(msg="starting Ray")
        t_ray = time.time()
        started = False
        try:
            with _keep_sigterm():
                started = _start_ray(address)
            ray_start_s = time.time() - t_ray
            _link_ray_logs(out)
            return _search(space, out, progress, ray_start_s, sessions)
        except KeyboardInterrupt as exc:
            # Every trial in flight is cut; what was measured is on disk (each record is
            # written as it lands), and resume runs the rest.
            signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
            raise Stopped(signum, str(out)) from None
        finally:
            progress.close()
            if (started or ray.is_initialized()) and not address:
                ray.shutdown()  # ends the trials' actors, and with them their processes


def _search(space: spec.Space, out: Path, progress: Progress, ray_start_s: float, sessions: int) -> dict:
    import optuna
    import ray

    m = space.model
    trials_path = out / "trials.jsonl"
    shape = cluster_shape(ray)
    device, cpus_per_trial, gpus_per_trial, concurrent = plan_resources(space, shape)

    from tuner.trial import make_request, resolve_config

    # The knob context of the trial machines: device kind, cores, whether the workload has sources.
    workload = resolve_config(make_request(
        workload=m.workload, workload_args=m.workload_args, base_dir=str(space.base_dir), device="cpu")).workload
    # bf16 where the trials run (a V100 or T4 has none: the guides' bf16 start would be a
    # wasted trial), asked of a GPU node, not of this driver.
    # On CPUs: whether they run bf16 in hardware (without, the guides' bf16 start ran conv at
    # 18 samples/s against fp32's 293 here, and that one trial made the search's model
    # blame every other knob of that start).
    bf16_ok, cuda_ok, bf16_native = True, device == "cuda", True
    if device == "cuda":
        bf16_ok, cuda_ok = ray.get(ray.remote(num_gpus=gpus_per_trial)(_gpu_facts).remote())
    else:
        bf16_native = ray.get(ray.remote(num_cpus=1)(_cpu_facts).remote())
    ctx = knobs.Context(device=device, cpu_count=shape["max_node_cpus"], has_groups=workload.groups is not None,
                        bf16_ok=bf16_ok, bf16_native=bf16_native)
    for name, values in space.domain.items():  # a GPU knob searched on CPUs is a wasted trial
        if knobs.KNOBS[name].gpu_only and device != "cuda" and len(values) > 1:
            raise UserError(f"knobs.{name}: a GPU knob, but this search runs on CPUs; remove it or fix it")
    # The first trials: PyTorch's defaults in the optimized loop, then the guides' advice.
    start = space.start_points(ctx)

    recorder = Recorder(trials_path, ctx)
    local_ray = ray_start_s > 0 and not _attached()  # a Ray started here, on this machine only
    screening = m.objective.metric == "samples_per_sec" and not m.objective.memory and m.measure.screen_windows > 0
    job = TrialJob(
        workload=m.workload, workload_args=m.workload_args, base_dir=str(space.base_dir),
        device=m.device, measure=search_measure(space), run=m.run.model_dump(), seed=m.seed,
        trial_timeout_s=m.budget.trial_timeout_s, constraints=m.constraints, objective=m.objective,
        fixed=space.fixed, derive=space.derive, cpus_per_trial=cpus_per_trial, gpus_per_rank=gpus_per_trial,
        spread_ranks=m.resources.spread_ranks, ddp_backend="nccl" if cuda_ok else "gloo",
        observers=tuner_processes(local=local_ray),
        # One inductor cache per compile group, per node, for this search (kept for resume).
        compile_root=os.path.join(tempfile.gettempdir(), "tuner-compile-" + hashlib.sha1(
            f"{out}:{meta_created(out)}".encode()).hexdigest()[:12]),
        # one trial at a time: the driver's loop sleeps through its timed windows
        hush_dir=tempfile.mkdtemp(prefix="tuner-hush-") if concurrent == 1 else None,
        nice=os.getpriority(os.PRIO_PROCESS, 0),
    )
    board = Board(screening=screening, recheck_after=m.measure.recheck_after)
    try:
        for r in recorder.records:  # a resumed search: what was measured before
            if r.get("phase") in ("search", "recheck", "confirm"):
                board.update(r)
        run = SearchRun(space, ctx, job, out, recorder, progress, concurrent, t_search=time.time(), board=board)

        previous = [r for r in recorder.records if r.get("phase") == "search"]
        baseline_rec = next((r for r in recorder.records if r.get("phase") == "baseline"), None)
        if baseline_rec is None:
            progress.update(msg="measuring the baseline (plain PyTorch loop)")
            baseline_rec = ray.get(run.remote_measure(space.baseline_config(), baseline=True))
            baseline_rec["phase"] = "baseline"
            recorder.add(baseline_rec)
        if baseline_rec.get("status") == "ok" and not baseline_rec.get("disturbed"):
            # (a baseline measured on a disturbed machine would inflate every "x baseline";
            # the summary's comes from all of its rounds)
            progress.baseline = baseline_rec.get(m.objective.metric)

        # -- the search proper
        remaining = max(0, m.search_trials() - len({r["key"] for r in previous}))
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = _open_journal(space, out, progress)
        if previous:
            _repair_study(space, ctx, storage, previous)
        if remaining > 0:
            _fit(run, start, storage, remaining, previous,
                 ray_name="ray" if sessions == 0 else f"ray-resume-{sessions}")

        # -- confirm: re-measure the top configs in interleaved rounds (A B C base, A B C
        #    base: a drift of the machine hits every contender and the baseline alike) and
        #    choose on the median of all measurements.
        if confirms(space):
            _confirm(run, baseline_rec)
        search_wall_s = time.time() - run.t_search

        summary = summarize(space, recorder.records, baseline_of(recorder.records, m.objective.metric) or baseline_rec,
                            describe_cluster=shape,
                            search_wall_s=search_wall_s, ray_start_s=ray_start_s, device=device, out_folder=out)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        return summary
    finally:
        if job.hush_dir:
            shutil.rmtree(job.hush_dir, ignore_errors=True)


@dataclass
class SearchRun:
    """One search as the driver holds it, for the phases that follow the baseline."""

    space: spec.Space
    ctx: knobs.Context
    job: TrialJob
    out: Path
    recorder: Recorder
    progress: Progress
    concurrent: int  # trials at once
    t_search: float  # when the search (baseline included) started
    board: Board  # the screening state, handed to each Tune trial (BOARD_KEY)

    def bundle(self, config: dict) -> dict:
        return driver_bundle(config, self.job.cpus_per_trial, self.job.gpus_per_rank)

    def remote_measure(self, config: dict, baseline: bool = False) -> Any:
        """A Ray task that measures ``config`` (the baseline and the confirm rounds)."""
        import ray

        bundle = self.bundle(config)
        return ray.remote(_measure).options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_retries=1,
        ).remote(config, self.job, baseline)


def confirms(space: spec.Space) -> bool:
    """Whether the search ends with confirm rounds."""
    return space.model.confirm_measurements() > 0


def search_measure(space: spec.Space) -> dict:
    """How a search measures each config: the space's ``measure`` settings, except that
    with confirm rounds to follow every measurement stops at ``min_windows``. Precision
    then comes from repeats: the contenders and the baseline are measured again in
    interleaved rounds and their figures pooled, which a drift of the machine hits
    alike, where more windows in one go would not. On this 2-core VM a window's figure
    spreads 10-15%, so the 1% error target sent every contender to ``max_windows``: a
    third of a search's time for a precision the confirm rounds then re-measured."""
    settings = space.model.measure.model_dump()
    if confirms(space):
        settings["max_windows"] = settings["min_windows"]
    return settings


def _confirm(run: SearchRun, baseline_rec: dict) -> None:
    """Interleaved rounds over the contenders and the baseline (A B C base, A B C base:
    a drift of the machine hits every contender and the baseline alike).

    The contenders are the top ``confirm.top`` configs still within noise of the leader;
    after each round the ranking is redone, and the rounds stop once a single contender
    is left within noise (the order is clear), after ``confirm.repeats`` rounds, or once
    the confirm rounds' share of ``budget.trials`` is spent (a round that does not fit
    whole keeps its best contenders and the baseline). A round's measurements run
    concurrently where trials can (several GPUs), one after the other on a CPU machine,
    in order. No round starts after the time budget.
    """
    import ray

    m, recorder, progress = run.space.model, run.recorder, run.progress
    metric = m.objective.metric
    # A resumed search: what the rounds already measured is spent, and the last round
    # they reached is taken up again (it may have been cut short) with what is left.
    done = [r for r in recorder.records if r.get("confirm_round")]
    left = m.confirm_measurements() - len(done)
    reached = max((r["confirm_round"] for r in done), default=0)
    for rnd in range(reached - 1 if reached and left > 0 else reached, m.confirm.repeats):
        if m.budget.time_s is not None and time.time() - run.t_search >= m.budget.time_s:
            progress.update(msg="time budget spent: no more confirm rounds")
            break
        contenders = within_noise(rank(aggregate(recorder.records, metric), metric), metric)[: m.confirm.top]
        if left < 1 or not contenders or (rnd > 0 and len(contenders) < 2):
            break  # the first round always runs: the winner is chosen on repeated figures
        with_base = baseline_rec.get("status") == "ok" and left >= 2
        batch = [(row["config"], False) for row in contenders[: left - with_base]]
        if with_base:
            batch.append((baseline_rec["config"], True))
        left -= len(batch)
        progress.update(msg=f"confirm round {rnd + 1}/{m.confirm.repeats}: re-measuring {len(batch) - with_base} "
                            f"contender(s) within noise of the leader" + (" and the baseline" if with_base else "")
                            + ", interleaved")
        step = max(1, run.concurrent)
        for i in range(0, len(batch), step):
            group = batch[i:i + step]
            for (_, is_base), rec in zip(group, ray.get([run.remote_measure(c, baseline=b) for c, b in group]),
                                         strict=True):
                rec["phase"] = "baseline" if is_base else "confirm"
                rec["confirm_round"] = rnd + 1
                recorder.add(with_cold_compile(rec, cold_compile_of(recorder.records, rec.get("compile_group"))))


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
            if _is_ray_worker(name) or any(_is_ray_worker(a) for a in cmd[:1]):
                continue  # a worker (an idle one may run the next trial)
            if any(_is_ray_worker(q.name()) for q in parents):
                continue  # under a worker: a trial's own processes
        except psutil.Error:
            continue
        pids.append(p.pid)
        if name != "raylet":
            _lower_priority(p.pid)
    return pids


# Ray's per-node agents take a "ray::" process title as its workers do, but are daemons:
# at nice 0 and left out, the dashboard agent alone used 0.006-0.016 cores beside a trial
# here (its metrics), counted as interference rather than as the tuner's own.
_RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _is_ray_worker(name: str) -> bool:
    return name.startswith("ray::") and not name.startswith(_RAY_AGENTS)


def _lower_priority(pid: int, nice: int = 10) -> None:
    """``pid`` at nice 10 and every thread of it at SCHED_IDLE: it runs on a core the
    trial leaves idle, and does not preempt the trial when it wakes. Measured on 2 cores
    beside a 2-thread loop (``benchmarks/ray_cost.py``, 3 runs): Ray's processes with the
    daemons at nice 10 cost the loop 4-6% against the same processes stopped, 2.5-3.4%
    with them at SCHED_IDLE. Threads the daemon starts later inherit the policy; its
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


def _gpu_facts() -> tuple[bool, bool]:
    """On the GPU a trial gets: (bf16 supported, CUDA there at all). Logical GPUs (Ray's
    num_gpus on a CPU machine, as the tests declare) have no CUDA: bf16 runs on the CPU,
    and the ranks of a multi-rank trial talk over gloo, not NCCL."""
    import torch

    if not torch.cuda.is_available():
        return True, False
    return bool(torch.cuda.is_bf16_supported()), True


def _cpu_facts() -> bool:
    """On a trial node's CPU: whether it runs bf16 in hardware. A plain function, because
    Ray's remote() takes functions and classes, not the lru_cache wrapper."""
    from tuner.hardware import cpu_has_bf16

    return cpu_has_bf16()


def _open_journal(space: spec.Space, out: Path, progress: Progress) -> Any:
    """The Optuna study's journal storage. ``trials.jsonl`` is the record of truth: a
    journal that cannot be read (a torn or edited line) is moved aside and the study
    rebuilt from the records (``_repair_study``), with one line to say so."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = out / "optuna.journal"
    try:
        storage = JournalStorage(JournalFileBackend(str(path)))
        storage.get_all_studies()  # replays the whole log: a bad line raises here
        return storage
    except Exception as exc:  # noqa: BLE001 - whatever Optuna raises, the records rebuild it
        aside = path.with_name(f"optuna.journal.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
        path.rename(aside)
        progress.close()  # a line of its own, also with --quiet
        print(f"note: {path}: unreadable ({type(exc).__name__}: {str(exc)[:80]}); moved to "
              f"{aside.name}, the study is rebuilt from trials.jsonl", file=sys.stderr, flush=True)
    storage = JournalStorage(JournalFileBackend(str(path)))
    m = space.model
    directions = [("maximize" if spec.OBJECTIVE_METRICS[m.objective.metric] == "max" else "minimize")]
    if m.objective.memory:
        directions.append("minimize")
    optuna.create_study(storage=storage, study_name=m.name, directions=directions)
    return storage


def _repair_study(space: spec.Space, ctx: knobs.Context, storage: Any, previous: list[dict]) -> None:
    """After a kill: close the trials the kill cut, and tell Optuna every measured trial it
    missed (a record is written before Optuna is told), so none is run twice."""
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState

    try:
        study = optuna.load_study(study_name=space.model.name, storage=storage)
    except KeyError:
        return  # killed before the study was created: Ray's searcher will create it
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING)):
        study.tell(t.number, state=TrialState.FAIL)
    canon, search_space = Canonical(space, ctx), SearchSpace(space, ctx)
    known = {canon(t.params) for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))}
    for r in previous:
        if r["key"] in known:
            continue
        params = search_space.active({k: r["config"].get(k) for k in space.searched})
        values = list(objective_values(r, space.model.objective).values())
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions={k: CategoricalDistribution(space.searched[k]) for k in params},
            values=values))
        known.add(r["key"])


def _fit(run: SearchRun, start: list[dict], storage: Any, remaining: int, previous: list[dict],
         ray_name: str) -> None:
    """Tune's trials, ``remaining`` of them, with Optuna choosing (``start`` first)."""
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    space, ctx, job, recorder, progress = run.space, run.ctx, run.job, run.recorder, run.progress
    m = space.model
    mode = spec.OBJECTIVE_METRICS[m.objective.metric]
    metric_names, modes = (["objective", "memory"], [mode, "min"]) if m.objective.memory else ("objective", mode)
    sampler = make_sampler(space, ctx, start)
    search_space = SearchSpace(space, ctx)
    done = {r["key"] for r in previous}
    canon = Canonical(space, ctx)
    tried = set(done)  # distinct configs: ``remaining`` more, then the searcher is finished
    screened = {r["key"] for r in previous if r.get("screened")}
    points = []
    if m.sampler == "grid":
        # Every distinct config once, in a fixed order (Optuna's GridSampler may repeat
        # points under Ray's ask/tell), skipping what a resumed search already measured.
        seen = set(done)
        for values in itertools.product(*space.searched.values()):
            point = search_space.active(dict(zip(space.searched, values, strict=True)))
            key = canon(point)
            if key not in seen:
                seen.add(key)
                points.append(point)
        remaining = min(remaining, len(points))
        if remaining == 0:
            return
    elif m.sampler != "guided" and not previous:
        # The same first trials as the guided sampler's: defaults, then the guides' advice.
        keys = []
        for point in start:
            if canon(point) not in keys:
                keys.append(canon(point))
                points.append(search_space.active(point))

    class Searcher(OptunaSearch):
        """OptunaSearch that also keeps each trial's figures and status as the Optuna
        trial's user attributes (what optuna-dashboard shows)."""

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
            ot = self._ot_trials.get(trial_id)
            if ot is not None and result and "record" in result:
                rec = json.loads(result["record"])
                for k, v in logged_metrics(rec).items():
                    ot.set_user_attr(k, v)
                ot.set_user_attr("status", rec.get("status"))
                if rec.get("screened"):  # the sampler weighs a screening figure less
                    ot.set_user_attr("screened", True)
                    screened.add(canon(ot.params))  # the result carries no key: the Recorder adds it
                if rec.get("reason"):
                    ot.set_user_attr("reason", str(rec["reason"])[:500])
            super().on_trial_complete(trial_id, result=result, error=error)

        def suggest(self, trial_id: str) -> dict | str | None:
            if len(tried) >= remaining + len(done):
                return Searcher.FINISHED  # N configs tried: Tune's extra samples are for retries
            config = super().suggest(trial_id)
            if isinstance(config, dict):  # the Board as it stands when this trial starts
                key = canon({k: v for k, v in config.items() if k != BOARD_KEY})
                tried.add(key)
                config[BOARD_KEY] = run.board.state(screen=key not in screened)
            return config

    searcher = Searcher(space=search_space, metric=metric_names, mode=modes,
                        sampler=sampler, storage=storage, study_name=m.name,
                        points_to_evaluate=points or None, seed=m.seed)

    class OnResult(tune.Callback):
        def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
            if "recheck" in result:  # the incumbent re-measured before this trial
                rec = recorder.add(json.loads(result["recheck"]))
                run.board.update(rec)
                progress.update(msg=f"the incumbent re-measured at {rec.get('samples_per_sec') or 0:.1f} "
                                    f"samples/s after {m.measure.recheck_after} screened trials in a row")
            if "record" in result:
                rec = json.loads(result["record"])
                rec["trial_number"] = len([r for r in recorder.records if r.get("phase") == "search"])
                recorder.add(rec)
                progress.update(rec)
                run.board.update(rec)

        def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
            from tuner.measure import wait_while_timed

            wait_while_timed(job.hush_dir)  # Tune's loop otherwise wakes 10 times a second

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            rec = {"phase": "search", "status": "infeasible", "reason": f"trial crashed in Ray: {trial.error_file}",
                   "config": job.knob_config(trial.config), "samples_per_sec": None}
            recorder.add(rec)
            progress.update(rec)

    def resources(config: dict) -> Any:
        bundle = run.bundle(job.knob_config(config))
        # Tune refuses an empty bundle: a multi-rank trial's driver holds one byte.
        return tune.PlacementGroupFactory([bundle or {"memory": 1}])

    # Tune warns of a step callback that takes over 0.5 s; this one sleeps on purpose
    logging.getLogger("ray.tune.utils.util").addFilter(_quiet_about_sleeping)
    time_left = None
    if m.budget.time_s is not None:
        # the confirm round's measurements, each about as long as the baseline's, are
        # left room: a winner picked on one figure is what the budget would otherwise buy
        walls = [r["trial_wall_s"] for r in recorder.records if r.get("phase") == "baseline" and r.get("trial_wall_s")]
        reserve = m.confirm_measurements() * statistics.median(walls) if walls else 0.0
        time_left = max(1.0, m.budget.time_s - (time.time() - run.t_search) - reserve)
    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(_trainable, job=job), resources=resources),
        # room for the screened configs measured again in full (the searcher finishes
        # once ``remaining`` distinct configs were tried)
        tune_config=tune.TuneConfig(search_alg=searcher, num_samples=remaining + retry_room(remaining),
                                    max_concurrent_trials=run.concurrent, time_budget_s=time_left,
                                    reuse_actors=True, trial_dirname_creator=trial_dirname),
        run_config=tune.RunConfig(name=ray_name, storage_path=str(run.out), verbose=0,
                                  callbacks=[OnResult(), *logger_callbacks(m.log_to, run.out, m.name)],
                                  log_to_file=True,
                                  failure_config=tune.FailureConfig(max_failures=1)),
    )
    try:
        tuner.fit()
    except Exception:
        if recorder.failure is not None:  # raised in a Tune callback, and wrapped by Tune
            raise recorder.failure from None
        raise
    if recorder.failure is not None:
        raise recorder.failure


def retry_room(configs: int) -> int:
    """Tune trials beyond ``configs`` for screened configs measured again in full."""
    return max(2, configs // 4)


def _quiet_about_sleeping(record: logging.LogRecord) -> bool:
    return "callbacks.on_step_end" not in record.getMessage()


def trial_dirname(trial: Any) -> str:
    """A trial's folder under ``ray/``: Tune's name (trainable, id, the knobs' tag) with
    the Board's state left out of the tag."""
    import re

    tag = re.sub(rf",?{BOARD_KEY}=[^,]*", "", trial.experiment_tag)
    return f"{trial.trainable_name}_{trial.trial_id}_{tag}"[:120]


def logger_callbacks(log_to: list[str], out: Path, name: str) -> list:
    """Ray Tune's own logger callbacks for ``log_to``: TensorBoard event files in each
    trial's folder under ``out/ray*/``, an MLflow store in ``out/mlflow.db``."""
    callbacks = []
    for target in log_to:
        if target == "tensorboard":
            from ray.tune.logger import TBXLoggerCallback

            callbacks.append(TBXLoggerCallback())
        elif target == "mlflow":
            try:
                import mlflow  # noqa: F401
                from ray.air.integrations.mlflow import MLflowLoggerCallback
            except ImportError as e:
                raise UserError("log_to: mlflow needs MLflow: pip install mlflow-skinny (or the [mlflow] extra)") from e
            # a local SQLite store (MLflow 3 keeps its file store in maintenance mode)
            callbacks.append(MLflowLoggerCallback(tracking_uri=f"sqlite:///{out / 'mlflow.db'}",
                                                  experiment_name=name, save_artifact=False))
    return callbacks


def summarize(space: spec.Space, records: list[dict], baseline: dict, *, describe_cluster: dict,
              search_wall_s: float, ray_start_s: float, device: str, out_folder: Path | str = "") -> dict:
    """summary.json: best (config + metrics), baseline, speedup, pareto, hardware, search figures."""
    m = space.model
    metric = m.objective.metric
    rows = aggregate(records, metric)
    ranked = rank(rows, metric)
    best = best_of(ranked)
    base_value = baseline.get(metric) if baseline.get("status") == "ok" else None
    best_speedup = speedup(best[metric], base_value, metric) if best is not None else None
    in_trial = sum(r.get("trial_wall_s") or 0.0 for r in records)
    search = [r for r in records if r.get("phase") == "search"]
    verdict = None
    if best_speedup is not None and best_speedup < 1.0:
        verdict = (f"the chosen config measured {best_speedup:.2f}x the baseline (the plain PyTorch loop): "
                   f"on this machine no config searched beat the plain loop; keep your current setup")
    disturbed = sum(1 for r in records if r.get("disturbed"))
    summary = {
        "name": m.name,
        "verdict": verdict,
        "disturbed_measurements": disturbed,
        "objective": m.objective.model_dump(),
        "best": _public(best) if ranked else None,
        "no_winner": None if best is not None else no_winner_reason(records, metric, str(out_folder)),
        "baseline": {k: baseline.get(k) for k in ("config", "status", "reason", "samples_per_sec",
                                                     "samples_per_sec_spread", "projected_run_s",
                                                     "peak_host_memory_mb", "peak_device_memory_mb",
                                                     "measurements", "disturbed")},
        "speedup_vs_baseline": best_speedup,
        "top": [_public(r) for r in winner_first(ranked, best)[:5]],
        "pareto": [_public(r) for r in pareto_front(rows, metric)] if m.objective.memory else None,
        "infeasible": [{"config": r["config"], "reason": r["reason"]} for r in rows if not r["feasible"]],
        "trials": len(search),
        "measurements": len(records),
        "device": device,
        "cluster": describe_cluster,
        "hardware": (best or {}).get("hardware") or baseline.get("hardware"),
        "search_wall_s": search_wall_s,
        "ray_start_s": ray_start_s,
        "in_trial_s": in_trial,
        "overhead_ratio": search_wall_s / in_trial if in_trial > 0 else None,
        "sampler": m.sampler,
        "workload": {"ref": m.workload, "args": m.workload_args},
    }
    if ranked:
        by_model: dict[str, dict] = {}
        for r in ranked:
            by_model.setdefault(r["device_model"], _public(r))
        summary["best_per_device_model"] = by_model
    return summary


def _public(row: dict | None) -> dict | None:
    if row is None:
        return None
    return {k: v for k, v in row.items() if k not in ("key",)}
