"""What a search keeps: ``trials.jsonl`` (``Recorder``, the record of truth), the Optuna
study in its journal (rebuilt from the records when unreadable), and the mapping between
knob configs, Optuna's parameters and the sampler."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tuner import knobs, spec
from tuner.errors import ResultsUnwritable, UserError
from tuner.records import objective_values, read_trials
from tuner.tables import Progress

JOURNAL = "optuna.journal"  # the Optuna study's journal, in the results folder


def cannot_write(path: Path, exc: OSError, kept: int, out: Path) -> ResultsUnwritable:
    """A results file (``trials.jsonl``, the journal) that a full or read-only disk
    refused, in one line: what is kept, and how to go on."""
    return ResultsUnwritable(f"{path}: cannot write ({exc.strerror or exc}); the {kept} measurements before "
                             f"it are kept; make room, then `python -m tuner resume {out}`")


def canonical(config: dict, ctx: knobs.Context) -> str:
    """A key of what a config really runs: inactive knobs held at their default."""
    full, _ = knobs.resolve(config, ctx, strict=False)
    return json.dumps(full, sort_keys=True)



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
            self.failure = cannot_write(self.path, exc, len(self.records), self.path.parent)
            raise self.failure from None
        self.records.append(record)
        return record


@contextlib.contextmanager
def writable_results(out: Path) -> Iterator[None]:
    """A results folder that cannot be created or written (read-only, full) is one line."""
    try:
        yield
    except OSError as exc:
        about_out = exc.filename is not None and str(exc.filename).startswith(str(out))
        if not (about_out or exc.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT)):
            raise
        raise ResultsUnwritable(f"{exc.filename or out}: cannot write the results folder "
                                f"({exc.strerror or exc})") from None


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
        return optuna.samplers.RandomSampler(seed=seed)  # the grid's points are enqueued in fit
    raise AssertionError(m.sampler)


def open_journal(space: spec.Space, out: Path, progress: Progress) -> Any:
    """The Optuna study's journal storage. ``trials.jsonl`` is the record of truth: a
    journal that cannot be read (a torn or edited line) is moved aside and the study
    rebuilt from the records (``repair_study``), with one line to say so. The caller
    holds the folder's writer lock (``records.writer_lock``)."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = out / JOURNAL
    # A search killed during a journal write leaves Optuna's lock (a link beside the
    # journal) behind, and Optuna breaks a lock only after 30 s, logging a warning every
    # 10 s. No other process writes this journal: the caller holds the folder's lock.
    path.with_name(JOURNAL + ".lock").unlink(missing_ok=True)
    try:
        storage = JournalStorage(JournalFileBackend(str(path)))
        storage.get_all_studies()  # replays the whole log: a bad line raises here
        return storage
    except Exception as exc:  # noqa: BLE001 - whatever Optuna raises, the records rebuild it
        aside = path.with_name(f"{JOURNAL}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
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


def repair_study(space: spec.Space, ctx: knobs.Context, storage: Any, previous: list[dict]) -> None:
    """After a kill: close the trials the kill cut, and tell Optuna every measured trial it
    missed (a record is written before Optuna is told), so none is run twice."""
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState

    try:
        study = optuna.load_study(study_name=space.model.name, storage=storage)
    except KeyError:
        return  # killed before the study was created: Ray's searcher will create it
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(t.number, state=TrialState.FAIL)
    # Points queued for Tune's searcher and never asked (a grid's, the starts): this run
    # queues what is still to measure again, and Optuna would hand out a stale one first.
    # A WAITING trial cannot be told; its storage can close it.
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
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
