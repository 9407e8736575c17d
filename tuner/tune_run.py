"""The Tune run of a search: one Tune trial per config, each measured in its own process
(``tuner.trial.run_isolated``), with OptunaSearch choosing and the records written as
they land."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner import knobs, spec
from tuner.capacity import Watch
from tuner.errors import UserError
from tuner.localray import ray_internal_replaced
from tuner.records import aggregate, apply_constraints, logged_metrics, objective_values, rank
from tuner.screening import BOARD_KEY, Board, rescreen, with_compile_cost
from tuner.settings import HUSH_ENV
from tuner.study import JOURNAL, Canonical, Recorder, SearchSpace, cannot_write, make_sampler
from tuner.tables import Progress


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


@dataclass
class Placement:
    """What Ray gave the Tune trial that hands its measurement to another worker
    (``_measure``): that worker holds no GPU and no CPU of its own."""

    gpu_ids: list[str]
    visible: str | None  # CUDA_VISIBLE_DEVICES
    holder: int  # the trial actor's process, idle beside the trial: not load


def measure_config(knob_config: dict, job: TrialJob, baseline: bool = False, screen: dict | None = None,
                   placement: Placement | None = None) -> dict:
    """Measure one config in a child process, or through Ray Train when it has several
    ranks; returns the record (never raises). ``placement``: the resources of the Tune
    trial this measures for, when that is not this process."""
    from tuner.trial import make_request, run_isolated

    env = {}
    cpus = job.cpus_per_trial(knob_config)
    env["OMP_NUM_THREADS"] = str(int(cpus))
    visible = placement.visible if placement else os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    if job.hush_dir:
        env[HUSH_ENV] = job.hush_dir
    request = make_request(workload=job.workload, workload_args=job.workload_args,
                           base_dir=job.base_dir, config=knob_config, baseline=baseline,
                           device=job.device, measure=job.measure, run=job.run,
                           seed=job.seed, env=env,
                           observers=[os.getpid(), *([placement.holder] if placement else []), *job.observers],
                           screen=screen,
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
        record["gpu_ids"] = placement.gpu_ids if placement else [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # outside Ray (tests of this function)
        record["node"], record["gpu_ids"] = None, []
    record["cpus_reserved"] = cpus if world == 1 else world * knobs.process_cpus(knob_config)
    record["compile_group"] = compile_group_key(knob_config, job.workload, job.workload_args)
    record["workload"] = {"ref": job.workload, "args": job.workload_args}
    hw = record.get("hardware") or {}
    record["gpu_model"] = hw.get("gpu")
    return apply_constraints(record, job.constraints)


def _measure(knob_config: dict, job: TrialJob, screen: dict | None = None) -> dict:
    """``measure_config`` for a Tune trial, run by an idle worker of this node rather
    than by the trial's actor: the worker that measured the baseline, so that the
    baseline, the trials and the confirm rounds start their processes from one worker,
    in one environment. It takes no resources: the actor holds the trial's. A config
    with several ranks is driven from the actor, through Ray Train."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if int(knob_config.get("world_size", 1)) > 1:
        return measure_config(knob_config, job, screen=screen)
    placement = Placement(gpu_ids=[str(g) for g in ray.get_gpu_ids()],
                          visible=os.environ.get("CUDA_VISIBLE_DEVICES"), holder=os.getpid())
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    task = ray.remote(measure_config).options(num_cpus=0, max_retries=0, scheduling_strategy=here)
    return ray.get(task.remote(knob_config, job, screen=screen, placement=placement))


def _trainable(config: dict, job: TrialJob) -> None:
    from ray import tune

    knob_config = job.knob_config(config)
    board = json.loads(config.get(BOARD_KEY) or "{}")
    screen, cold = board.get("screen"), board.get("cold") or {}
    report: dict = {}
    if screen and screen.get("recheck"):
        # the incumbent again first: the threshold as the machine runs now
        recheck = with_compile_cost(_measure(screen["recheck"], job), cold)
        recheck["phase"] = "recheck"
        screen = rescreen(screen, recheck)
        report["recheck"] = json.dumps(recheck, default=str)
    record = with_compile_cost(_measure(knob_config, job, screen=screen), cold)
    record["phase"] = "search"
    record["trial_id"] = tune.get_context().get_trial_id()
    report.update(objective_values(record, job.objective))
    report.update(logged_metrics(record))
    report["record"] = json.dumps(record, default=str)
    tune.report(report)


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
    watch: Watch  # that the cluster still has a node a trial fits on
    failure: Exception | None = None  # raised in a Tune callback, where Tune would wrap it

    def bundle(self, config: dict) -> dict:
        return driver_bundle(config, self.job.cpus_per_trial, self.job.gpus_per_rank)

    def measure_all(self, batch: list[tuple[dict, bool]]) -> list[dict]:
        """Measure each (config, is_baseline) of ``batch`` as Ray tasks at once."""
        refs = [self.remote_measure(c, baseline=b) for c, b in batch]
        return self.watch.get(refs, [self.bundle(c) for c, _ in batch], len(self.recorder.records))

    def remote_measure(self, config: dict, baseline: bool = False) -> Any:
        """A Ray task that measures ``config`` (the baseline and the confirm rounds)."""
        import ray

        bundle = self.bundle(config)
        return ray.remote(measure_config).options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_retries=1,
        ).remote(config, self.job, baseline)



def fit(run: SearchRun, start: list[dict], storage: Any, remaining: int, previous: list[dict],
        ray_name: str) -> None:
    """Tune's trials, ``remaining`` of them, with Optuna choosing (``start`` first)."""
    from ray import tune

    m = run.space.model
    points, remaining = first_points(run.space, run.ctx, start, previous, remaining)
    if remaining == 0:
        return
    searcher = _searcher(run, start, storage, remaining, previous, points)

    def resources(config: dict) -> Any:
        bundle = run.bundle(run.job.knob_config(config))
        # Tune refuses an empty bundle: a multi-rank trial's driver holds one byte.
        return tune.PlacementGroupFactory([bundle or {"memory": 1}])

    # Tune warns of a step callback that takes over 0.5 s; this one sleeps on purpose
    logging.getLogger("ray.tune.utils.util").addFilter(_quiet_about_sleeping)
    # The records are trials.jsonl; Tune's own per-trial result files are not written, and
    # its ResultGrid would warn, once per trial, that it found none.
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)
    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(_trainable, job=run.job), resources=resources),
        # room for the screened configs measured again in full (the searcher finishes
        # once ``remaining`` distinct configs were tried)
        tune_config=tune.TuneConfig(search_alg=searcher, num_samples=remaining + retry_room(remaining),
                                    max_concurrent_trials=run.concurrent, time_budget_s=_time_left(run),
                                    reuse_actors=True, trial_dirname_creator=trial_dirname),
        run_config=tune.RunConfig(name=ray_name, storage_path=str(run.out), verbose=0,
                                  callbacks=[_on_result(run), *logger_callbacks(m.log_to, run.out, m.name)],
                                  log_to_file=True,
                                  failure_config=tune.FailureConfig(max_failures=1)),
    )
    try:
        with _callbacks_uncounted(), _actors_in_the_job_env():
            tuner.fit()
    except Exception:
        if (run.recorder.failure or run.failure) is None:
            raise
    # raised in a Tune callback: Tune wraps it, or logs it and goes on
    failure = run.recorder.failure or run.failure
    if failure is not None:
        raise failure from None


def _callbacks_uncounted() -> contextlib.AbstractContextManager:
    """Tune without its usage count of the callbacks: to count them it imports every
    logger integration it knows, MLflow's among them, which imports MLflow itself where
    it is installed (0.6-0.9 s here), between the baseline and each search's first
    trial. The count only feeds Ray's usage report."""
    try:
        from ray.air._internal import usage
    except ImportError:  # another Ray: it counts, as it would
        return contextlib.nullcontext()
    return ray_internal_replaced(usage, "tag_callbacks", lambda callbacks: False)


def _actors_in_the_job_env() -> contextlib.AbstractContextManager:
    """Tune's trial actors without the environment variable Tune gives them by default
    (``PL_DISABLE_FORK``, for Lightning's own Trainer, which no trial runs: the trial
    processes run the tuner's loop). With a runtime env of its own, an actor cannot
    take one of the workers Ray starts ahead, idle, on every node: it waited for a new
    one to boot (1.3 s before each search's first trial here), and its trials ran in
    another environment than the baseline's and the confirm rounds'."""
    try:
        from ray.tune.execution import class_cache
    except ImportError:  # another Ray: its actors get Tune's defaults
        return contextlib.nullcontext()
    return ray_internal_replaced(class_cache, "DEFAULT_ENV_VARS", {})


def first_points(space: spec.Space, ctx: knobs.Context, start: list[dict], previous: list[dict],
                 remaining: int) -> tuple[list[dict], int]:
    """The points Tune's searcher runs first, and the configs left to try. A grid: every
    distinct config once, in a fixed order (Optuna's GridSampler may repeat points under
    Ray's ask/tell), skipping what a resumed search already measured. Samplers other than
    the guided one (which starts there itself): defaults, then the guides' advice."""
    m = space.model
    canon, search_space = Canonical(space, ctx), SearchSpace(space, ctx)
    points: list[dict] = []
    if m.sampler == "grid":
        seen = {r["key"] for r in previous}
        for values in itertools.product(*space.searched.values()):
            point = search_space.active(dict(zip(space.searched, values, strict=True)))
            key = canon(point)
            if key not in seen:
                seen.add(key)
                points.append(point)
        return points, min(remaining, len(points))
    if m.sampler != "guided" and not previous:
        keys: list[str] = []
        for point in start:
            if canon(point) not in keys:
                keys.append(canon(point))
                points.append(search_space.active(point))
    return points, remaining


def _searcher(run: SearchRun, start: list[dict], storage: Any, remaining: int, previous: list[dict],
              points: list[dict]) -> Any:
    """OptunaSearch that ends after ``remaining`` distinct configs, hands each trial the
    Board's state, and keeps each trial's figures and status as the Optuna trial's user
    attributes (what optuna-dashboard shows; the sampler reads ``screened``)."""
    from ray.tune.search.optuna import OptunaSearch

    space, ctx, m = run.space, run.ctx, run.space.model
    mode = spec.OBJECTIVE_METRICS[m.objective.metric]
    metric_names, modes = (["objective", "memory"], [mode, "min"]) if m.objective.memory else ("objective", mode)
    canon = Canonical(space, ctx)
    done = {r["key"] for r in previous}
    tried = set(done)  # distinct configs: ``remaining`` more, then the searcher is finished
    screened = {r["key"] for r in previous if r.get("screened")}

    class Searcher(OptunaSearch):
        # Each of these writes to the journal (``journal_write``).
        def on_trial_result(self, trial_id: str, result: dict) -> None:
            journal_write(run, super().on_trial_result, trial_id, result)

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
            journal_write(run, self._tell, trial_id, result, error)

        def _tell(self, trial_id: str, result: dict | None, error: bool) -> None:
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
            if run.failure is not None or len(tried) >= remaining + len(done):
                return Searcher.FINISHED  # N configs tried: Tune's extra samples are for retries
            recheck = run.board.recheck_due() and next_trial_fits(run, recheck=True)
            if not recheck and not next_trial_fits(run, recheck=False):
                # a trial that cannot end within the budget would be stopped by Tune and
                # its measurement lost: the time goes to the confirm round instead (a
                # recheck of the incumbent that does not fit is left out)
                return Searcher.FINISHED
            config = journal_write(run, super().suggest, trial_id)
            if run.failure is not None:
                return Searcher.FINISHED
            if isinstance(config, dict):  # the Board as it stands when this trial starts
                key = canon({k: v for k, v in config.items() if k != BOARD_KEY})
                tried.add(key)
                config[BOARD_KEY] = run.board.state(screen=key not in screened, recheck=recheck)
            return config

    return Searcher(space=SearchSpace(space, ctx), metric=metric_names, mode=modes,
                    sampler=make_sampler(space, ctx, start), storage=storage, study_name=m.name,
                    points_to_evaluate=points or None, seed=m.seed)


def journal_write(run: SearchRun, write: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``write(*args, **kwargs)``, a searcher call that writes to the Optuna journal,
    inside Tune: where a full or read-only disk refuses it, Tune would log the raise as a
    traceback and go on, or end in its own error. The failure is kept instead (None is
    returned, and no later write is tried) and the next step ends the fit with one line
    (``on_step_end``)."""
    if run.failure is not None:
        return None
    try:
        return write(*args, **kwargs)
    except OSError as exc:
        run.failure = cannot_write(run.out / JOURNAL, exc, len(run.recorder.records), run.out)
        return None


def _on_result(run: SearchRun) -> Any:
    """The Tune callback that records each result as it lands and keeps the Board current."""
    from ray import tune

    recorder, progress, m = run.recorder, run.progress, run.space.model

    def lost(trial: Any, reason: str, then: str) -> None:
        # Ray lost the trial with its node or worker: said in trials.jsonl and by `show`,
        # never a result (a search record would keep `resume` from the config)
        rec = {"phase": "lost", "status": "lost", "config": run.job.knob_config(trial.config),
               "reason": f"{reason}; {then}", "samples_per_sec": None}
        recorder.add(rec)
        progress.update(msg=f"a trial was lost ({rec['reason']})")

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

            wait_while_timed(run.job.hush_dir)  # Tune's loop otherwise wakes 10 times a second
            if run.failure is not None:  # kept by the searcher (the study cannot be written)
                raise run.failure
            waiting = [t.placement_group_factory.required_resources for t in trials if t.status == "PENDING"]
            try:
                run.watch.check(waiting, len(recorder.records))
            except Exception as exc:
                run.failure = exc
                raise

        def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            lost(trial, ray_failure(trial), "tried again")  # Tune runs it again

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            reason = ray_failure(trial)
            if reason.startswith("lost:"):  # lost again after Tune's retry: the node's fault, not the config's
                lost(trial, reason, "run again on resume")
                return
            rec = {"phase": "search", "status": "infeasible", "reason": reason,
                   "config": run.job.knob_config(trial.config), "samples_per_sec": None}
            recorder.add(rec)
            progress.update(rec)

    return OnResult()


def ray_failure(trial: Any) -> str:
    """Why Ray ended a trial, in one line: a lost node or worker named as such (the trial
    itself reports its own errors as records; what reaches Tune is Ray's)."""
    text = ""
    with contextlib.suppress(OSError, TypeError):
        text = Path(trial.error_file).read_text()[-4000:]
    lost = ("NodeDiedError", "node has died", "node died", "ActorDiedError", "WorkerCrashedError",
            "actor died", "OwnerDiedError", "ActorUnavailableError", "is unavailable", "RpcError")
    if any(s in text for s in lost):
        last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")
        return f"lost: Ray's node or worker running the trial died ({last[:160]})"
    return f"trial crashed in Ray: {trial.error_file}"


def _time_left(run: SearchRun) -> float | None:
    """Tune's time budget for the search proper: ``budget.time_s`` less what was spent, less
    room for the confirm round (``_confirm_reserve``): a winner picked on one figure is
    what the budget would otherwise buy."""
    m = run.space.model
    if m.budget.time_s is None:
        return None
    return max(1.0, m.budget.time_s - (time.time() - run.t_search) - _confirm_reserve(run))


def _confirm_reserve(run: SearchRun) -> float:
    """The first confirm round's time if the search ended now (a later round runs only
    where it fits, ``round_fits``): the top ``confirm.top`` configs re-measured in full
    and the baseline, each as long as its own full measurement took (the contenders are
    often the slow ones to measure: workers to start, larger batches), a config not yet
    found as long as a typical full trial."""
    m = run.space.model
    if not m.confirm_measurements():
        return 0.0
    records = run.recorder.records
    full = [r for r in records if r.get("status") == "ok" and not r.get("screened") and r.get("trial_wall_s")]
    typical = _median_wall(full) or 0.0
    walls = [_own_wall(records, row["config"]) or typical
             for row in rank(aggregate(records, m.objective.metric), m.objective.metric)[: m.confirm.top]]
    walls += [typical] * (m.confirm.top - len(walls))
    base = [r["trial_wall_s"] for r in full if r.get("phase") == "baseline"]
    return sum(walls) + (base[-1] if base else typical)


def next_trial_fits(run: SearchRun, recheck: bool = False) -> bool:
    """Whether a trial started now ends within the search proper's time (always, without
    a time budget): a typical trial's wall, and with ``recheck`` (the Board has it
    measure the incumbent again first) that measurement's too."""
    left, need = _time_left(run), _median_wall(run.recorder.records)
    if left is None or need is None:
        return True
    if recheck:
        need += _own_wall(run.recorder.records, run.board.incumbent) or need
    return left >= need


def _own_wall(records: list[dict], config: dict | None) -> float | None:
    """The median wall of a config's own full measurements (None if it has none)."""
    own = [r["trial_wall_s"] for r in records if r.get("config") == config and r.get("status") == "ok"
           and not r.get("screened") and r.get("trial_wall_s")]
    return statistics.median(own) if own else None


def round_fits(run: SearchRun) -> bool:
    """Whether another confirm round ends within ``budget.time_s`` (always, without one)."""
    m = run.space.model
    return m.budget.time_s is None or time.time() - run.t_search + _confirm_reserve(run) <= m.budget.time_s


def _median_wall(records: list[dict]) -> float | None:
    """The median wall of a search trial (and the baseline's), screened ones included
    where ``records`` hold them: what the next trial costs."""
    walls = [r["trial_wall_s"] for r in records if r.get("phase") in ("baseline", "search") and r.get("trial_wall_s")]
    return statistics.median(walls) if walls else None


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
