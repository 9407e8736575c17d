"""The search policy: what to measure next, and which config wins. No Ray, no processes.

A search is a sequence of measurements, each decided here and measured elsewhere:

1. the baseline (the plain PyTorch loop);
2. the search proper: the configs the sampler chooses (``GuidedSampler`` by default:
   PyTorch's defaults, the guides' advice, then the config a model of the figures so far
   expects to improve most), each held against the incumbent by the screening ``Board``,
   and the incumbent measured again after screened trials in a row (``recheck``);
3. the confirm rounds: the configs still within noise of the leader measured again,
   interleaved with the baseline, as a race: each round drops those the leader has left
   behind by the noise of their figures, until one is clear of the rest;
4. the pick: the best of the re-measured configs, on their confirm rounds' figures.

The interface is the shape of Ray Tune's searchers and Optuna's samplers: ``next(now)``
gives a ``Task`` to measure (or ``Wait`` for measurements in flight, or ``Done``), and
``on_result(task, record)`` takes its record back. ``tuner.tune_run`` drives it with Ray
Tune; ``benchmarks/search_replay.py`` drives the very same object on recorded landscapes,
which is how the search is judged. Optuna keeps the study (ask and tell); the records go
to ``sink`` (``trials.jsonl``) before Optuna is told, so a kill between the two loses
nothing that ``resume`` cannot rebuild.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tuner import knobs, spec
from tuner.errors import UserError, refuses
from tuner.records import (
    Phase,
    Record,
    Status,
    aggregate,
    best_of,
    cold_compile_of,
    no_winner_reason,
    objective_values,
    rank,
    sampler_attrs,
    still_racing,
    with_cold_compile,
    within_noise,
)
from tuner.settings import PHASES
from tuner.spec import Canonical, SearchSpace
from tuner.study import make_study


class Stage(str, Enum):
    BASELINE = "baseline"
    SEARCH = "search"
    COMPILE = "compile"  # the contenders compiled (compile_late)
    CONFIRM = "confirm"
    DONE = "done"


@dataclass(frozen=True)
class Task:
    """One measurement to make: plain data (it crosses to Ray's workers)."""

    number: int  # the order in which the policy decided it
    phase: Phase
    config: dict  # the full knob config the trial runs (fixed knobs and derivations applied)
    screen: dict | None = None  # {"below": samples/sec, "margin": fraction}: screening threshold
    confirm_round: int | None = None
    decided_at: float = 0.0  # the policy's clock, in seconds since the search started

    @property
    def baseline(self) -> bool:
        return self.phase == Phase.BASELINE


@dataclass(frozen=True)
class Wait:
    """Nothing to start until measurements in flight land."""

    why: str


@dataclass(frozen=True)
class Done:
    """The search has nothing more to measure."""

    why: str


@dataclass(frozen=True)
class Pick:
    """The winner (an aggregated row), or why there is none."""

    row: dict | None
    no_winner: str | None


def measure_settings(space: spec.Space) -> dict:
    """How a search measures each config: the space's ``measure`` settings, except that
    with confirm rounds to follow every measurement stops at ``min_windows``. Precision
    then comes from repeats: the contenders and the baseline are measured again in
    interleaved rounds and their figures pooled, which a drift of the machine hits
    alike, where more windows in one go would not (and a noisy machine's windows would
    send every contender to ``max_windows`` for a precision the confirm rounds then
    measure again)."""
    settings = space.model.measure.model_dump()
    if space.model.confirm_measurements() > 0:
        settings["max_windows"] = settings["min_windows"]
    return settings


def retry_room(configs: int) -> int:
    """Measurements beyond ``configs`` for screened configs measured again in full."""
    return max(2, configs // 4)


@dataclass
class Clock:
    """The time budget: the search proper keeps room for the first confirm round, and a
    trial starts only where it is expected to end within the budget (no trial is stopped
    at the budget: one that ran past it would overrun the time the user gave, by as much
    as its estimate was short)."""

    time_s: float | None  # budget.time_s (None: no budget)
    top: int  # confirm.top: the contenders a confirm round re-measures
    confirming: bool  # whether the search ends with confirm rounds

    def left(self, now: float, records: list[dict], metric: str) -> float | None:
        """The search proper's seconds left: the budget less what was spent less room
        for the confirm round after the next trial (``reserve``); None without a budget."""
        if self.time_s is None:
            return None
        return max(1.0, self.time_s - now - self.reserve(records, metric, found_next=True))

    def reserve(self, records: list[dict], metric: str, found_next: bool = False) -> float:
        """The next confirm round's time if the search ended now (``found_next``: after
        one more trial): its contenders (the top ``confirm.top`` configs within noise of
        the leader, as ``_next_confirm`` takes them) re-measured in full and the baseline,
        each as long as its own full measurement took (the contenders are often the slow
        ones to measure: workers to start, larger batches), the next trial's config as
        long as a typical full trial. A config the search has not found, or one the
        leader has beaten beyond noise, is no contender: a budget with room for one config
        and its confirmation measures that one, and a search whose leader is clear goes on
        where reserving a whole round ahead would have stopped it."""
        if not self.confirming:
            return 0.0
        rows = leaders(records, metric)[: self.top]
        return self.round_wall(records, rows, unknown=min(int(found_next), self.top - len(rows)))

    @staticmethod
    def round_wall(records: list[dict], rows: list[dict], unknown: int = 0) -> float:
        """A confirm round's time: ``rows`` re-measured in full, each as long as its own full
        measurement took, ``unknown`` configs not found yet as long as a typical full trial,
        and the baseline."""
        typical, base = _round_walls(records)
        return sum(own_wall(records, row["config"]) or typical for row in rows) + unknown * typical + base

    def trial_fits(self, now: float, records: list[dict], metric: str, first: dict | None = None,
                   config: dict | None = None, contender: bool = False) -> bool:
        """Whether a trial started now ends within the search proper's time: ``config``'s
        (``expected_wall``), or a typical one's where the next config is not chosen yet;
        with ``first`` (a config measured before it) that config's own wall too. A
        ``contender`` (measured because it may lead) is measured again in the confirm
        round, which ``reserve`` counts only once it leads: its second wall too."""
        left = self.left(now, records, metric)
        need = median_wall(records) if config is None else expected_wall(records, config)
        if left is None or need is None:
            return True
        if contender and self.confirming:
            need *= 2
        if first is not None:
            need += own_wall(records, first) or need
        return left >= need

    def few_configs_fit(self, now: float, records: list[dict], metric: str) -> bool:
        """Whether the time left holds two typical trials and their confirmation at most
        (that one fits is ``trial_fits``). Before the first config the typical trial is the
        baseline's, and a config's own wall may run longer (workers to start, a larger
        batch): an estimate of two may hold one."""
        left, need = self.left(now, records, metric), median_wall(records)
        return left is not None and need is not None and left < 3 * need

    def fitting(self, now: float, records: list[dict], rows: list[dict], with_base: bool) -> list[dict]:
        """Of a confirm round's contenders (best first), those whose re-measurements, with
        the baseline's (``with_base``), are expected to end within the budget. The room
        kept for the round (``reserve``) counted the contenders of its time; a last trial
        that leads with a wide error brings more configs within noise of it, and the
        round then measures the best of them that fit."""
        if self.time_s is None:
            return rows
        typical, base = _round_walls(records)
        end = now + (base if with_base else 0.0)
        out = []
        for row in rows:
            end += own_wall(records, row["config"]) or typical
            if end > self.time_s:
                break
            out.append(row)
        return out

    def round_fits(self, now: float, records: list[dict], contenders: list[dict]) -> bool:
        """Whether another confirm round of ``contenders`` ends within the budget (always,
        without one)."""
        return self.time_s is None or now + self.round_wall(records, contenders) <= self.time_s


def leaders(records: list[dict], metric: str) -> list[dict]:
    """The configs still within noise of the leader, best first: the contenders of the
    first confirm round and of the compiled twins (each takes its own number of them)."""
    return within_noise(rank(aggregate(records, metric), metric), metric)


def _round_walls(records: list[dict]) -> tuple[float, float]:
    """What a confirm round's measurements cost: a typical full trial's wall (a config's
    own where it has one comes from ``own_wall``), and the baseline's last full one (a
    typical trial's before it has one)."""
    full = [r for r in records if r.get("status") == "ok" and not r.get("screened") and r.get("trial_wall_s")]
    typical = median_wall(full) or 0.0
    base = [r["trial_wall_s"] for r in full if r.get("phase") == Phase.BASELINE]
    return typical, base[-1] if base else typical


def median_wall(records: list[dict]) -> float | None:
    """The median wall of a search trial (and the baseline's), screened ones included
    where ``records`` hold them: what the next trial costs."""
    walls = [r["trial_wall_s"] for r in records if r.get("phase") in (Phase.BASELINE, Phase.SEARCH)
             and r.get("trial_wall_s")]
    return statistics.median(walls) if walls else None


def expected_wall(records: list[dict], config: dict) -> float | None:
    """What measuring ``config`` costs, known before it runs: the median wall of its own
    full measurements; else of the trials of its kind, its compile mode and its world
    size (a compiled trial pays its compile on top of an eager one's wall: on a GPU,
    several eager trials' time; a trial of several ranks pays their processes' start);
    else of its compile mode's; else of any trial."""
    own = own_wall(records, config)
    if own is not None:
        return own
    kind = _kind(config)
    for same in (lambda k: k == kind, lambda k: k[0] == kind[0], lambda k: True):
        wall = median_wall([r for r in records if same(_kind(r.get("config") or {}))])
        if wall is not None:
            return wall
    return None


def _kind(config: dict) -> tuple[str, int]:
    """What sets a trial's cost beyond its steps: its compile mode and its ranks."""
    return config.get("compile") or "off", config.get("world_size") or 1


def own_wall(records: list[dict], config: dict | None) -> float | None:
    """The median wall of a config's own full measurements (None if it has none)."""
    own = [r["trial_wall_s"] for r in records if r.get("config") == config and r.get("status") == "ok"
           and not r.get("screened") and r.get("trial_wall_s")]
    return statistics.median(own) if own else None


@dataclass
class Confirming:
    """Where the confirm rounds stand: the measurements left of their share, the next
    round, the first round of this session, and the round's measurements not started."""

    left: int
    round: int
    first: int
    queue: list[tuple[Phase, dict]] = field(default_factory=list)


# The least allowance a screening figure gets. One config's figure moves between trials
# more than its windows move within one (where its DataLoader workers land, the state of
# the allocator, the machine's drift), so a trial's own window error understates how far
# its next figure may lie. Chosen by replay (``benchmarks/search_replay.py``), where a
# smaller floor screened out configs within a few percent of the pick; the replayed
# figures are on the results page.
MIN_MARGIN = 0.10


class Board:
    """What a trial is held against, for screening: the incumbent's figure and the noise
    seen so far. The policy keeps it current as records land and hands each search trial
    its threshold (``screen``) when it starts.

    The rule is Optuna's ThresholdPruner with a threshold that moves with the
    incumbent, applied inside the trial process between windows (``measure``), where
    stopping costs nothing: a Tune scheduler would stop the trial by killing its actor,
    and with it the process that measures.

    The threshold is a figure from the past. After ``recheck_after`` screened trials in
    a row, the incumbent is measured again (phase ``recheck``), and that figure becomes
    the threshold: on a machine that slowed since, the incumbent reads lower too (a VM
    that slowed after the first trial of a search otherwise screens out every trial
    after it).
    """

    def __init__(self, min_margin: float = MIN_MARGIN, screening: bool = True, recheck_after: int = 0):
        self.best: float | None = None
        self.incumbent: dict | None = None  # the config behind ``best``
        self.errors: list[float] = []
        self.min_margin = min_margin
        self.screening = screening
        self.recheck_after = recheck_after
        self.screened_in_a_row = 0
        self.best_error = 0.0

    def update(self, record: dict) -> None:
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
        (``MIN_MARGIN``: drift between trials exceeds one measurement's own error),
        plus twice the incumbent's own error: the incumbent is the highest of several
        noisy figures, so likely one read high."""
        if self.best is None or not self.screening:
            return None
        margin = max(self.min_margin, 3 * statistics.median(self.errors)) if self.errors else 2 * self.min_margin
        return {"below": self.best, "margin": margin + 2 * self.best_error}

    def recheck_due(self) -> bool:
        """Whether the incumbent is measured again before the next trial."""
        return bool(self.screening and self.best is not None and self.recheck_after
                    and self.screened_in_a_row >= self.recheck_after and self.incumbent is not None)

    def take_recheck(self) -> dict:
        """The incumbent's config, to measure again; asked once per run of screened trials."""
        self.screened_in_a_row = 0
        return dict(self.incumbent or {})


class SearchPolicy:
    """The search, as decisions: see the module's docstring.

    Args:
        space: the validated space.
        ctx: the knob context of the machines the trials run on.
        study: the Optuna study the sampler keeps; by default ``study.make_study``'s, in
            ``storage`` (a live search's journal; None: in memory, as a replay keeps it).
        records: what earlier sessions of this search measured (resume).
        sink: called with each finished record before Optuna is told of it.
    """

    def __init__(self, space: spec.Space, ctx: knobs.Context, study: Any = None, *, storage: Any = None,
                 records: Iterable[dict] = (), sink: Callable[[dict], Any] | None = None):
        m = space.model
        self.records: list[dict] = list(records)
        previous = [r for r in self.records if r.get("phase") == Phase.SEARCH]
        if study is None:
            study = make_study(space, ctx, storage, previous)
        self.space, self.ctx, self.study, self.sink = space, ctx, study, sink
        self.metric = m.objective.metric
        self.canon, self.search_space = Canonical(space, ctx), SearchSpace(space, ctx)
        self.clock = Clock(m.budget.time_s, m.confirm.top, m.confirm_measurements() > 0)
        screening = self.metric == "samples_per_sec" and not m.objective.memory and m.measure.screen_windows > 0
        self.board = Board(screening=screening, recheck_after=m.measure.recheck_after)
        for r in self.records:
            if r.get("phase") in (Phase.SEARCH, Phase.RECHECK, Phase.CONFIRM):
                self.board.update(r)
        self.tried = {r["key"] for r in previous}  # distinct configs, earlier sessions' too
        self.tried_before = len(self.tried)
        self.screened = {r["key"] for r in previous if r.get("screened")}
        self.budget = max(0, m.search_trials() - self.tried_before)  # distinct configs still to try
        self.asked = 0  # search measurements started in this session
        self.in_flight: dict[int, Task] = {}
        self.trials: dict[int, Any] = {}  # task number -> its Optuna trial
        self.numbers = itertools.count()
        self._enqueue_first_points(previous)
        self.configs = self._distinct_configs()
        self.stage = Stage.BASELINE
        self.confirming: Confirming | None = None
        self.skipped: set[str] = set()  # configs not run: they would hang as one did, a value is refused, or held
        self.hangs: list[tuple[dict, list[str], str]] = [hang for r in self.records if (hang := _hang(r))]
        # knob values a trial refused whatever the other knobs (KnobRefused), with its reason
        self.refusals: list[tuple[dict, str]] = [(r["refused"], r.get("reason") or "") for r in self.records
                                                 if r.get("refused") and not r.get("skipped")]
        self.search_ended: str | None = None  # why the search proper started no more trials
        self.ended: str | None = None  # why the search has nothing more to measure (once it has not)
        # On a GPU under a time budget a compile costs several eager trials' time: the
        # search explores eager configs, then measures its contenders compiled.
        modes = [v for v in space.domain.get("compile", []) if v != "off"]
        self.compile_late = modes if (ctx.device == "cuda" and m.budget.time_s is not None and modes
                                      and "off" in space.domain.get("compile", [])) else []
        self.compile_queue: list[dict] | None = None
        if self.compile_late:  # the contenders' compiled twins come out of the budget
            self.budget = max(1, self.budget - min(self.budget // 3, 2 * len(self.compile_late)))

    # ---- decisions ------------------------------------------------------------------------

    def next(self, now: float) -> Task | Wait | Done:
        """What to measure next at ``now`` (seconds since the search started)."""
        if self.stage == Stage.BASELINE:
            if self.in_flight:
                return Wait("the baseline")
            if not any(r.get("phase") == Phase.BASELINE for r in self.records):
                return self._issue(Phase.BASELINE, self.space.baseline_config(), now)
            self.stage = Stage.SEARCH
        if self.stage == Stage.SEARCH:
            decision = self._next_search(now)
            if decision is not None:
                return decision
            if self.in_flight:
                return Wait("the search's last trials")
            self.stage = Stage.COMPILE if self.compile_late else Stage.CONFIRM
        if self.stage == Stage.COMPILE:
            decision = self._next_compiled(now)
            if decision is not None:
                return decision
            if self.in_flight:
                return Wait("the contenders' compiled trials")
            self.stage = Stage.CONFIRM
        if self.stage == Stage.CONFIRM and self.confirming is None:
            self.confirming = self._confirm_state()
        if self.stage == Stage.CONFIRM:
            decision = self._next_confirm(now)
            if decision is not None:
                return decision
            if self.in_flight:
                return Wait("the confirm round")
            self.stage = Stage.DONE
            self.ended = self.ended or self.search_ended or "every measurement made"
        return Done(self.ended)

    def _next_search(self, now: float) -> Task | Wait | None:
        """The search proper's next measurement; None once it has no more to start."""
        if self.search_ended or self._search_spent():
            return None
        if any(t.phase == Phase.RECHECK for t in self.in_flight.values()):
            return Wait("the incumbent's recheck")  # the threshold the next trials are held to
        if self.board.recheck_due() and self.clock.trial_fits(now, self.records, self.metric,
                                                               first=self.board.incumbent):
            return self._issue(Phase.RECHECK, self.board.take_recheck(), now)
        if not self.clock.trial_fits(now, self.records, self.metric):
            # a trial that cannot end within the budget would be stopped and its
            # measurement lost: the time goes to the confirm round instead
            self.search_ended = "time budget spent"
            return None
        if not self.asked and not self.tried_before and self.clock.few_configs_fit(now, self.records, self.metric):
            # PyTorch's defaults in the optimized loop come first so that the pick is
            # never slower than what the user has; with room for one config alone, that
            # pick would be the baseline again: the guides' advice goes first (with room
            # for two, the same two configs are measured, the defaults second)
            getattr(self.study.sampler, "advice_first", lambda: None)()
        while not self._search_spent():
            trial = self.study.ask()
            self.search_space(trial)
            config = self.space.derive({**self.space.fixed, **self._complete(trial.params)})
            key = self.canon(config)
            again = key in self.skipped  # proposed before, and not run then
            self.tried.add(key)
            screen = self.board.screen() if key not in self.screened else None  # a retry is measured in full
            task = self._issue(Phase.SEARCH, config, now, screen=screen)
            self.trials[task.number] = trial
            hang = self._hangs_like(key)
            refused = None if hang else self._refused_like(config)
            why = hang or refused or self._held_compiled(config)
            if why is None:
                if not self.clock.trial_fits(now, self.records, self.metric, config=config):
                    # its kind of trial (compiled, several ranks) costs more than a typical
                    # one, which the check above took: the time goes to the confirm round
                    self._withdraw(task)
                    self.search_ended = "time budget spent"
                    return None
                self.asked += 1
                return task
            # a config that would hang as one measured did, or has a value a trial refused,
            # is not run: it would cost the wait (or the budget's place) that found the
            # first one, and end the same way
            self.skipped.add(key)
            if again and refused:  # a refused config proposed again: out of the retry room, so proposals end
                self.asked += 1
            kind = "timeout" if hang else "invalid" if refused else "held"
            self.on_result(task, {"status": Status.INFEASIBLE, "error_kind": kind,
                                  "config": dict(config), "samples_per_sec": None, "skipped": True, "reason": why})
        return None

    def _withdraw(self, task: Task) -> None:
        """Take back a search task decided but not started: not tried, and given up."""
        self.tried.discard(self.canon(task.config))
        self._give_up(task)

    def _held_compiled(self, config: dict) -> str | None:
        """Why a compiled config is not run in the search (compile_late); its eager twin
        runs in its place, next, where it has not yet."""
        if not self.compile_late or config.get("compile", "off") == "off":
            return None
        twin = {**config, "compile": "off"}
        if self.canon(twin) not in self.tried:
            self.study.enqueue_trial(self.search_space.active(twin))
        return ("not run in the search: on a GPU under a time budget the eager configs are searched, "
                "and the contenders are then measured compiled")

    def _next_compiled(self, now: float) -> Task | None:
        """The compiled twins of the search's contenders (the top configs within noise of
        the leader), one per compile mode the space has, while the time budget fits them."""
        if self.compile_queue is None:
            rows = leaders(self.records, self.metric)
            top = [r["config"] for r in rows[: max(1, self.space.model.confirm.top - 1)]]
            self.compile_queue = [self.space.derive({**c, "compile": mode}) for c in top for mode in self.compile_late]
        while self.compile_queue:
            config = self.compile_queue.pop(0)
            key = self.canon(config)
            if key in self.tried and key not in self.skipped:
                continue
            if not self.clock.trial_fits(now, self.records, self.metric, config=config, contender=True):
                self.compile_queue = []  # its twins in the queue cost as much
                return None
            self.tried.add(key)
            self.skipped.discard(key)
            self.study.enqueue_trial(self.search_space.active(config))
            trial = self.study.ask()
            self.search_space(trial)
            task = self._issue(Phase.SEARCH, config, now)  # measured in full: never screened
            self.trials[task.number] = trial
            self.asked += 1
            return task
        return None

    def _search_spent(self) -> bool:
        """The budget's distinct configs tried (or every config the space has), or the
        room for re-measurements used up. A config not run because it would hang is not
        counted: it cost nothing."""
        tried = len(self.tried) - self.tried_before - len(self.skipped)
        if tried >= self.budget or self.asked >= self.budget + retry_room(self.budget):
            return True
        return self.configs is not None and len(self.tried) >= self.configs

    def _refused_like(self, config: dict) -> str | None:
        """Why ``config`` is not run: it has a knob value a trial refused whatever the
        other knobs were (``KnobRefused``), or None."""
        for refusal, reason in self.refusals:
            if refuses(refusal, config):
                return f"not run: {refusal['knob']}={config.get(refusal['knob'])} is refused ({reason})"
        return None

    def _hangs_like(self, key: str) -> str | None:
        """Why the config of ``key`` would hang as a measured one did (the same value of
        every knob that could matter where that one hung), or None."""
        config = json.loads(key)
        for hung, knob_names, where in self.hangs:
            same = {k: hung.get(k) for k in knob_names}
            if all(config.get(k) == v for k, v in same.items()):
                said = ", ".join(f"{k}={v}" for k, v in same.items() if v != knobs.KNOBS[k].default) \
                    or ", ".join(f"{k}={v}" for k, v in same.items())
                return f"not run: hung as a config with the same {said} did ({where})"
        return None

    def _confirm_state(self) -> Confirming:
        """The confirm rounds' share, and where a resumed search takes them up: what the
        rounds already measured is spent, and the last round they reached is taken up
        again (it may have been cut short) with what is left."""
        m = self.space.model
        done = [r for r in self.records if r.get("confirm_round")]
        left = m.confirm_measurements() - len(done)
        reached = max((r["confirm_round"] for r in done), default=0)
        first = reached - 1 if reached and left > 0 else reached
        return Confirming(left=left, round=first, first=first)

    def _next_confirm(self, now: float) -> Task | None:
        """The next measurement of a confirm round (A B C base, A B C base: a drift of the
        machine hits every contender and the baseline alike); a round is chosen once the
        one before it has landed. The first round's contenders are the top ``confirm.top``
        configs still within noise of the leader, a later round's those the rounds have
        not left behind (``_contenders``); the rounds stop once a single contender is
        left (the order is clear), after ``confirm.repeats`` rounds, once the rounds'
        share is spent (a round that does not fit whole keeps its best contenders and
        the baseline), or, under a time budget, at a round after the first that does not
        fit; a round measures the contenders whose re-measurements fit the budget, best
        first (``Clock.fitting``), and a later round only 2 or more of them."""
        c = self.confirming
        if c.queue:
            phase, config = c.queue.pop(0)
            return self._issue(phase, config, now, confirm_round=c.round)
        if self.in_flight or self.ended:
            return None
        m = self.space.model
        if c.round >= m.confirm.repeats:
            return None
        contenders = self._contenders(c.round)
        if m.budget.time_s is not None and (now >= m.budget.time_s or c.round > c.first
                                            and not self.clock.round_fits(now, self.records, contenders)):
            self.ended = "time budget spent: no more confirm rounds"
            return None
        if c.left < 1 or not contenders or (c.round > 0 and len(contenders) < 2):
            self.ended = "the order of the contenders is clear" if contenders else "no contender"
            return None
        base = next((r for r in self.records if r.get("phase") == Phase.BASELINE), None)
        with_base = base is not None and base.get("status") == "ok" and c.left >= 2
        share = contenders[: c.left - with_base]
        rows = self.clock.fitting(now, self.records, share, with_base)
        if not rows or (c.round > 0 and len(rows) < min(2, len(share))):  # a later round orders 2+
            self.ended = "time budget spent: no more confirm rounds"
            return None
        c.queue = [(Phase.CONFIRM, row["config"]) for row in rows]
        if with_base:
            c.queue.append((Phase.BASELINE, base["config"]))
        c.left -= len(c.queue)
        c.round += 1
        phase, config = c.queue.pop(0)
        return self._issue(phase, config, now, confirm_round=c.round)

    def _contenders(self, round_: int) -> list[dict]:
        """A confirm round's contenders: in the first, the top ``confirm.top`` configs within
        noise of the leader; in a later one, those the rounds have not left behind
        (``records.still_racing``)."""
        if round_ == 0:
            return leaders(self.records, self.metric)[: self.space.model.confirm.top]
        return still_racing(rank(aggregate(self.records, self.metric), self.metric), self.records, self.metric)

    def _issue(self, phase: Phase, config: dict, now: float, *, screen: dict | None = None,
               confirm_round: int | None = None) -> Task:
        task = Task(next(self.numbers), phase, dict(config), screen, confirm_round, now)
        self.in_flight[task.number] = task
        return task

    # ---- results ----------------------------------------------------------------------------

    def on_result(self, task: Task, record: Record) -> Record:
        """Take a task's record back (the trial's own, never raised): it is completed with
        what the search knows (phase, key, screen, the compile its group's first trial
        paid), handed to ``sink``, then the Board and Optuna are told. Returns it."""
        self.in_flight.pop(task.number, None)
        rec: Record = {**record, "phase": Phase(task.phase)}
        if task.confirm_round is not None:
            rec["confirm_round"] = task.confirm_round
        if task.phase == Phase.SEARCH:
            rec["trial_number"] = sum(1 for r in self.records if r.get("phase") == Phase.SEARCH)
        rec["task"], rec["decided_at"] = task.number, task.decided_at
        if task.screen is not None:
            rec["screen"] = task.screen
        rec.setdefault("key", self.record_key(rec))
        # a warm-cache trial's projection keeps what its group's first (cold) trial paid
        rec = with_cold_compile(rec, cold_compile_of(self.records, rec.get("compile_group")))
        if self.sink is not None:
            self.sink(rec)
        self.records.append(rec)
        if task.phase != Phase.BASELINE:
            self.board.update(rec)
        if rec.get("screened"):
            self.screened.add(self.canon(task.config))
        if (hang := _hang(rec)) is not None:
            self.hangs.append(hang)
        if rec.get("refused") and not rec.get("skipped"):
            self.refusals.append((rec["refused"], rec.get("reason") or ""))
        trial = self.trials.pop(task.number, None)
        if trial is not None:
            self._tell(trial, rec)
        return rec

    def on_lost(self, task: Task, reason: str, retried: bool) -> Record:
        """Ray lost the trial with its node or worker: a ``lost`` line (never a result; a
        search record would keep ``resume`` from the config). ``retried``: Ray runs the
        task again, and its record comes later; otherwise the task is given up, and
        ``resume`` measures the config."""
        rec: Record = {"phase": Phase.LOST, "status": Status.LOST, "config": dict(task.config), "samples_per_sec": None,
               "reason": f"{reason}; {'tried again' if retried else 'run again on resume'}",
               "task": task.number, "decided_at": task.decided_at}
        rec["key"] = self.record_key(rec)
        if self.sink is not None:
            self.sink(rec)
        if not retried:
            self._give_up(task)
        return rec

    def _give_up(self, task: Task) -> None:
        """A task that will bring no record: out of flight, and its Optuna trial told it
        failed (a resumed search may propose the config again)."""
        self.in_flight.pop(task.number, None)
        trial = self.trials.pop(task.number, None)
        if trial is not None:
            self.study.tell(trial, state=_optuna_state("FAIL"))

    def _tell(self, trial: Any, rec: dict) -> None:
        """Optuna is told a search record: its objective values, and its figures, status
        and reason as user attributes (what optuna-dashboard shows; the guided sampler
        weighs a screening figure less)."""
        for k, v in sampler_attrs(rec).items():
            trial.set_user_attr(k, v)
        trial.set_user_attr("status", rec.get("status"))
        if rec.get("reason"):
            trial.set_user_attr("reason", str(rec["reason"])[:500])
        values = list(objective_values(rec, self.space.model.objective).values())
        self.study.tell(trial, values if len(values) > 1 else values[0])

    # ---- the pick ---------------------------------------------------------------------------

    def leader(self) -> dict | None:
        """The best so far, as the pick will take it (an aggregated row): once the confirm
        rounds run, the best of the re-measured configs on their figures. Where every
        measurement was disturbed (none may win yet), the best of those, its row marked."""
        ranked = rank(aggregate(self.records, self.metric), self.metric)
        return best_of(ranked, finished=self.stage in (Stage.CONFIRM, Stage.DONE)) or \
            next((r for r in ranked if r.get("disturbed")), None)

    def pick(self) -> Pick:
        """The winner: the best of the re-measured configs (``records.best_of``)."""
        best = best_of(rank(aggregate(self.records, self.metric), self.metric))
        return Pick(best, None if best is not None else no_winner_reason(self.records, self.metric, ""))

    # ---- helpers ----------------------------------------------------------------------------

    def record_key(self, record: dict) -> str:
        """A record's key: what its config really runs (a config that cannot run here,
        whose record says why: its own text)."""
        try:
            return self.canon(record["config"])
        except UserError:
            return json.dumps(record["config"], sort_keys=True, default=str)

    def _complete(self, params: dict) -> dict:
        """Optuna's parameters with the knobs it was not asked (inactive ones) filled in."""
        return {k: params.get(k, v[0]) for k, v in self.space.searched.items()}

    def _enqueue_first_points(self, previous: list[dict]) -> None:
        """The points the study runs first. A grid: every distinct config once, in a fixed
        order, skipping what a resumed search already measured. Samplers other than the
        guided one (which starts there itself): PyTorch's defaults, then the guides' advice."""
        m = self.space.model
        points: list[dict] = []
        seen = {r["key"] for r in previous}
        if m.sampler == "grid":
            for values in itertools.product(*self.space.searched.values()):
                point = self.search_space.active(dict(zip(self.space.searched, values, strict=True)))
                if (key := self.canon(point)) not in seen:
                    seen.add(key)
                    points.append(point)
            self.budget = min(self.budget, len(points))
        elif m.sampler != "guided" and not previous:
            for point in self.space.start_points(self.ctx):
                if (key := self.canon(point)) not in seen:
                    seen.add(key)
                    points.append(self.search_space.active(point))
        for point in points:
            self.study.enqueue_trial(point)

    def _distinct_configs(self, limit: int = 20000) -> int | None:
        """How many distinct configs the space runs (None past ``limit``): a search never
        tries more."""
        if math.prod(len(v) for v in self.space.searched.values()) > limit:
            return None
        return len({self.canon(dict(zip(self.space.searched, values, strict=True)))
                    for values in itertools.product(*self.space.searched.values())})


def _hang(record: Record) -> tuple[dict, list[str], str] | None:
    """A hung measurement's config (every knob), the knobs that can matter where it hung,
    and where: waiting for its first batch, the input pipeline's knobs; in its first step's
    compute, every knob but those that shape the loader alone; elsewhere, all of them."""
    if record.get("error_kind") != "timeout" or record.get("skipped") or not record.get("key"):
        return None
    try:
        config = json.loads(record["key"])  # every knob, as it ran
    except ValueError:
        return None
    phase = record.get("hung_phase") or "after its first step"
    loader = [k for k in config if k in knobs.KNOBS and knobs.KNOBS[k].loader]
    if phase in PHASES[1:3]:
        names = loader
    elif phase == PHASES[3]:  # every knob but those that shape the loader alone
        names = [k for k in config if k in knobs.KNOBS and not (k in loader and not knobs.KNOBS[k].recompiles)]
    else:
        names = [k for k in config if k in knobs.KNOBS]
    return config, names, phase


def _optuna_state(name: str) -> Any:
    from optuna.trial import TrialState

    return getattr(TrialState, name)
