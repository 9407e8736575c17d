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
from tuner.errors import ResultsUnwritable
from tuner.records import objective_values, read_trials, sampler_attrs
from tuner.spec import Canonical, SearchSpace
from tuner.tables import Progress

JOURNAL = "optuna.journal"  # the Optuna study's journal, in the results folder


def cannot_write(path: Path, exc: OSError, kept: int, out: Path) -> ResultsUnwritable:
    """A results file (``trials.jsonl``, the journal) that a full or read-only disk
    refused, in one line: what is kept, and how to go on."""
    return ResultsUnwritable(f"{path}: cannot write ({exc.strerror or exc}); the {kept} measurements before "
                             f"it are kept; make room, then `python -m tuner resume {out}`")


class Recorder:
    """Appends every measurement to trials.jsonl as it lands (fsync'd: a kill loses
    nothing). ``previous``: the records already there (a resumed search); a torn last
    line, which a kill mid-write leaves, is cut before anything is appended."""

    def __init__(self, path: Path):
        self.path = path
        self.previous: list[dict] = []
        self.written = 0
        self.failure: ResultsUnwritable | None = None  # raised where Tune would wrap it
        if path.exists():
            self.previous = read_trials(path)
            text = path.read_bytes()
            if text and not text.endswith(b"\n"):
                with path.open("r+b") as f:
                    f.truncate(text.rfind(b"\n") + 1)

    def add(self, record: dict) -> dict:
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
            self.failure = cannot_write(self.path, exc, len(self.previous) + self.written, self.path.parent)
            raise self.failure from None
        self.written += 1
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


def make_sampler(space: spec.Space, ctx: knobs.Context, start: list[dict], splits: list[dict] = ()) -> Any:
    import optuna

    m = space.model
    seed = m.seed
    if m.sampler == "guided":
        direction = "maximize" if spec.OBJECTIVE_METRICS[m.objective.metric] == "max" else "minimize"
        from tuner.sampler import GuidedSampler

        return GuidedSampler(space.searched, start, Canonical(space, ctx), direction=direction, seed=seed,
                             cores=ctx.cpu_count if ctx.device == "cpu" else None, fixed=space.fixed,
                             splits=list(splits), throughput=m.objective.metric == "samples_per_sec",
                             grow_batch=ctx.device == "cuda")
    if m.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if m.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if m.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    if m.sampler == "grid":
        return optuna.samplers.RandomSampler(seed=seed)  # the grid's points are enqueued (policy)
    raise AssertionError(m.sampler)


def make_study(space: spec.Space, ctx: knobs.Context, storage: Any = None, previous: list[dict] = (),
               sampler: Any = None) -> Any:
    """The Optuna study a search keeps: its sampler (``make_sampler``, unless one is given)
    and direction(s), in ``storage`` (None: in memory). A resumed search's study is
    repaired from its ``previous`` search records first (``repair_study``)."""
    import optuna

    study = optuna.create_study(storage=storage, study_name=space.model.name, directions=_directions(space),
                                load_if_exists=storage is not None)
    if previous:
        repair_study(space, ctx, study, previous)
    # the search's own sampler from here on (repairing asks no sampler anything)
    study.sampler = sampler or make_sampler(space, ctx, space.start_points(ctx), space.split_starts(ctx))
    return study


def _directions(space: spec.Space) -> list[str]:
    m = space.model
    directions = ["maximize" if spec.OBJECTIVE_METRICS[m.objective.metric] == "max" else "minimize"]
    if m.objective.memory:
        directions.append("minimize")
    return directions


def open_journal(out: Path, progress: Progress) -> Any:
    """The Optuna study's journal storage in the results folder ``out``. ``trials.jsonl``
    is the record of truth: a journal that cannot be read (a torn or edited line) is moved
    aside and the study rebuilt from the records (``make_study``), with one line to say so.
    The caller holds the folder's writer lock (``records.writer_lock``)."""
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
    return JournalStorage(JournalFileBackend(str(path)))


def repair_study(space: spec.Space, ctx: knobs.Context, study: Any, previous: list[dict]) -> None:
    """After a kill: close the trials the kill cut, and tell Optuna every measured trial it
    missed (a record is written before Optuna is told, and an unreadable journal is
    rebuilt from the records), so none is run twice."""
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(t.number, state=TrialState.FAIL)
    # Points queued and never asked (a grid's, the starts): this run queues what is still
    # to measure again, and Optuna would hand out a stale one first. Asked, a queued point
    # takes its queued parameters (nothing is sampled) and can be told.
    for _ in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        study.tell(study.ask(), state=TrialState.FAIL)
    canon, search_space = Canonical(space, ctx), SearchSpace(space, ctx)
    known = {canon(t.params) for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))}
    for r in previous:
        if r["key"] in known:
            continue
        params = search_space.active({k: r["config"].get(k) for k in space.searched})
        values = list(objective_values(r, space.model.objective).values())
        # with the figures the sampler reads (a screened figure weighs less; the cores the
        # workers used), as the live trial told them
        attrs = sampler_attrs(r)
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions={k: CategoricalDistribution(space.searched[k]) for k in params},
            values=values, user_attrs=attrs))
        known.add(r["key"])
