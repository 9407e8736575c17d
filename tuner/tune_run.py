"""The Tune run of a search: Ray Tune's searcher and callbacks over the search policy
(``tuner.policy``). Every measurement of the search is a Tune trial that the policy
decided (the baseline, the configs tried, the incumbent's rechecks, the confirm rounds),
measured in its own process on an idle worker of its node (``tuner.remote``); each record
is written to ``trials.jsonl`` as it lands, then the policy is told."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

from ray import tune
from ray.tune.search import Searcher

from tuner.capacity import Watch
from tuner.errors import (
    RayMemoryKill,
    ResultsUnwritable,
    UserError,
    exception_chain,
    ray_memory_kill,
)
from tuner.localray import ray_internal_replaced
from tuner.policy import Done, SearchPolicy, Task, Wait
from tuner.records import Phase, baseline_of
from tuner.remote import TrialJob, driver_bundle, task_config, trainable
from tuner.study import JOURNAL, Recorder, cannot_write
from tuner.tables import Progress, diff_from_default


class PolicySearcher(Searcher):
    """Ray Tune's searcher interface over the policy: each suggestion is the policy's next
    task, each finished trial's record goes back to it. A failure to write the results
    (a full or read-only disk) is kept, and ends the run at the next step with one line
    (``Steps``): raised inside Tune, it would be logged and the run would go on."""

    def __init__(self, policy: SearchPolicy, recorder: Recorder, progress: Progress, started: float):
        super().__init__()
        self.policy, self.recorder, self.progress, self.started = policy, recorder, progress, started
        self.tasks: dict[str, Task] = {}
        self.failure: Exception | None = None

    def suggest(self, trial_id: str) -> dict | str | None:
        decision = self._guarded(self.policy.next, time.time() - self.started)
        if self.failure is not None or isinstance(decision, Done):
            return Searcher.FINISHED
        if isinstance(decision, Wait) or decision is None:
            return None
        self.tasks[trial_id] = decision
        if decision.phase != Phase.SEARCH:
            self.progress.update(msg=_saying(decision))
        elif decision.screen is None and self.policy.record_key({"config": decision.config}) in self.policy.screened:
            self.progress.update(msg="measuring a screened config again, in full: the model of the full "
                                     "measurements puts it within reach of the leader")
        return task_config(decision)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if not error and result and "record" in result:  # an error lands through ``Steps``
            self.land(trial_id, json.loads(result["record"]))

    def land(self, trial_id: str, record: dict) -> None:
        task = self.tasks.pop(trial_id, None)
        if task is None:
            return
        rec = self._guarded(self.policy.on_result, task, record)
        if rec is not None:
            metric = self.progress.metric
            if rec["phase"] == Phase.BASELINE:
                # the baseline as the summary pools it, over all of its rounds so far, so that
                # the last "x baseline" is the table's (a disturbed one would inflate every ratio)
                base = baseline_of(self.policy.records, metric)
                if base and base.get("status") == "ok" and not base.get("disturbed"):
                    self.progress.baseline = base.get(metric)
            # the best as the summary picks it: on the confirm rounds' figures once they run
            leader = self.policy.leader()
            self.progress.best = leader.get(metric) if leader else None
            self.progress.best_disturbed = bool(leader and leader.get("disturbed"))
            self.progress.update(rec)

    def memory_killed(self, use: str, out: Path) -> RayMemoryKill:
        """Ray's memory monitor ended a trial's workers, and Tune stopped on it: the one
        trial in flight is recorded as out of memory (``resume`` does not run it again);
        with several in flight Ray does not say whose, and none is. The error says what
        happened, what is kept, and how to go on."""
        reason = f"out of memory: Ray's memory monitor ended the trial's workers ({use}, past RAY_memory_usage_threshold)"
        if len(self.tasks) == 1:
            [(trial_id, task)] = self.tasks.items()
            self.land(trial_id, {"status": "infeasible", "error_kind": "oom", "reason": reason, "config": task.config,
                                 "samples_per_sec": None})
            which = f"the trial of {diff_from_default(task.config) or 'the defaults'} (recorded as out of memory)"
        else:
            which = (f"one of the {len(self.tasks)} trials in flight (Ray does not say which: none is recorded)"
                     if self.tasks else "a trial's workers")
        return RayMemoryKill(
            f"Ray's memory monitor ended {which}: {use}, past RAY_memory_usage_threshold, and Ray Tune stops on "
            f"it; what was measured is kept in {out}; start the cluster's nodes with RAY_memory_monitor_refresh_ms=0 "
            f"(the kernel's OOM killer then ends only the trial's process, which the search records and goes past), "
            f"or set constraints.max_memory_mb, then: python -m tuner resume {out}")

    def lost(self, trial_id: str, reason: str, retried: bool) -> None:
        task = self.tasks.get(trial_id) if retried else self.tasks.pop(trial_id, None)
        if task is not None:
            rec = self._guarded(self.policy.on_lost, task, reason, retried)
            if rec is not None:
                self.progress.update(msg=f"a trial was lost ({rec['reason']})")

    def _guarded(self, call: Any, *args: Any) -> Any:
        """``call(*args)``: where it cannot write the results, the failure is kept and
        nothing more is asked of the policy."""
        if self.failure is not None:
            return None
        try:
            return call(*args)
        except ResultsUnwritable as exc:
            self.failure = exc
        except OSError as exc:  # the Optuna journal
            self.failure = cannot_write(self.recorder.path.parent / JOURNAL, exc,
                                        len(self.policy.records), self.recorder.path.parent)
        return None

    def save(self, checkpoint_path: str) -> None:
        """Nothing: the results folder is the search's state (``resume`` reads it)."""

    def restore(self, checkpoint_path: str) -> None:
        """Nothing: see ``save``."""


def _saying(task: Task) -> str:
    if task.phase == Phase.RECHECK:
        return "re-measuring the incumbent after screened trials in a row"
    if task.confirm_round is not None:
        what = "the baseline" if task.baseline else "a contender within noise of the leader"
        return f"confirm round {task.confirm_round}: re-measuring {what}, interleaved"
    return "measuring the baseline (plain PyTorch loop)"


class Steps(tune.Callback):
    """Tune's loop, step by step: asleep while a trial is in its timed windows, a lost
    node watched for, and a trial that Ray lost or that crashed in Ray recorded."""

    def __init__(self, searcher: PolicySearcher, job: TrialJob, watch: Watch):
        self.searcher, self.job, self.watch = searcher, job, watch

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        from tuner.hostload import wait_while_timed

        wait_while_timed(self.job.hush_dir)  # Tune's loop otherwise wakes 10 times a second
        if self.searcher.failure is not None:
            raise self.searcher.failure
        waiting = [t.placement_group_factory.required_resources for t in trials if t.status == "PENDING"]
        try:
            self.watch.check(waiting, len(self.searcher.policy.records))
        except Exception as exc:
            self.searcher.failure = exc
            raise

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.searcher.lost(trial.trial_id, ray_failure(trial), retried=True)  # Tune runs it again

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        reason = ray_failure(trial)
        if reason.startswith("lost:"):  # lost again after Tune's retry: the node's fault, not the config's
            self.searcher.lost(trial.trial_id, reason, retried=False)
            return
        task = self.searcher.tasks.get(trial.trial_id)
        if task is not None:
            self.searcher.land(trial.trial_id, {"status": "infeasible", "reason": reason, "config": task.config,
                                                "samples_per_sec": None})


def drive(policy: SearchPolicy, job: TrialJob, *, recorder: Recorder, progress: Progress, watch: Watch,
          concurrent: int, started: float, log_to: list[str], name: str, ray_name: str) -> None:
    """Every measurement the policy decides, as Tune trials, ``concurrent`` at once."""
    out = recorder.path.parent
    searcher = PolicySearcher(policy, recorder, progress, started)
    # Tune warns of a step callback that takes over 0.5 s; this one sleeps on purpose
    logging.getLogger("ray.tune.utils.util").addFilter(_quiet_about_sleeping)
    # The records are trials.jsonl; Tune's own per-trial result files are not written, and
    # its ResultGrid would warn, once per trial, that it found none.
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)
    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(trainable, job=job), resources=partial(_placement, job)),
        tune_config=tune.TuneConfig(search_alg=searcher, num_samples=-1, max_concurrent_trials=concurrent,
                                    reuse_actors=True, trial_dirname_creator=trial_dirname),
        run_config=tune.RunConfig(name=ray_name, storage_path=str(out), verbose=0,
                                  callbacks=[Steps(searcher, job, watch), *logger_callbacks(log_to, out, name)],
                                  log_to_file=True, failure_config=tune.FailureConfig(max_failures=1)),
    )
    try:
        with _callbacks_uncounted(), _actors_in_the_job_env():
            tuner.fit()
    except Exception as exc:
        if searcher.failure is None:
            use = next((u for e in exception_chain(exc) if (u := ray_memory_kill(str(e))) is not None), None)
            if use is not None:
                raise searcher.memory_killed(use, out) from None
            raise
    if searcher.failure is not None:
        raise searcher.failure from None


def _placement(job: TrialJob, config: dict) -> Any:
    """A Tune trial's resources: its config's CPUs and GPUs (``remote.driver_bundle``).
    Tune refuses an empty bundle: a multi-rank trial's driver holds one byte."""
    bundle = driver_bundle(config["knobs"], job.cpus_per_trial, job.gpus_per_rank)
    return tune.PlacementGroupFactory([bundle or {"memory": 1}])


def trial_dirname(trial: Any) -> str:
    """A trial's folder under ``ray/``: its phase and the knobs it runs."""
    knobs_tag = ",".join(f"{k}={v}" for k, v in sorted((trial.config.get("knobs") or {}).items()))
    return f"{trial.trial_id}_{trial.config.get('phase')}_{knobs_tag}"[:120]


def _callbacks_uncounted() -> contextlib.AbstractContextManager:
    """Tune without its usage count of the callbacks: to count them it imports every
    logger integration it knows, MLflow's among them, which imports MLflow itself where
    it is installed (most of a second), between the baseline and each search's first
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
    one to boot (over a second before each search's first trial), and its trials ran in
    another environment than the baseline's and the confirm rounds'."""
    try:
        from ray.tune.execution import class_cache
    except ImportError:  # another Ray: its actors get Tune's defaults
        return contextlib.nullcontext()
    return ray_internal_replaced(class_cache, "DEFAULT_ENV_VARS", {})


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


def _quiet_about_sleeping(record: logging.LogRecord) -> bool:
    return "callbacks.on_step_end" not in record.getMessage()


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
