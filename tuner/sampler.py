"""GuidedSampler: an Optuna sampler that starts from the guides' advice and then measures
the config a model of the measurements so far expects to improve on the best one most.

Strategy (DESIGN.md, "Searching well with few trials"): the first trials are the given
starting points (PyTorch's defaults, the guides' recommended config, on CPUs the same in
fp32 and the advice with the other splits of the cores between intra-op threads and
DataLoader workers: ``Space.start_points``); where two measured starts differ in one knob
alone, the starts after them take the value of that pair that read faster, and once a
trial's workers reported the cores they used, the splits' threads are what those cores
leave (``LoaderUse``). On GPUs, once the starts are asked and one config is measured in
full, the best so far is measured at the largest micro-batch its measured device memory
fits (``_grown``); on CPUs, where the advice starts at the largest micro-batch, it is
measured at the batch listed nearest half the largest, and at each next halving while
the last one won; where the defaults at the smallest batch beat every start, the walk goes
down from the best start at the largest, and where a halving loses first, that start is
measured at the smallest batch (``_halved``). Each next trial is the untried
config of highest expected improvement under a Bayesian ridge model of log-throughput:
one effect per (knob, value), one per pair of knob values, and, on CPUs, a term for
intra-op threads that DataLoader workers leave without cores (``oversubscription``); for a samples/s
objective the model is the step's rate, held to the loading's measured rate
(``Pipeline``). Pairs are shrunk harder than single knobs, so that with few trials the
model stays near the additive one and departs from it where the data disagree; the
posterior's spread is what makes an unmeasured value worth a trial.
Every config of the space is scored (spaces of more than ``SCORE_ALL`` configs: the one-
and two-knob moves from the best so far): a local search from the incumbent stays on the
side of the cores' split that its start had.

A screened trial (stopped after a few windows as out of the running) counts for less
in the fit, and once the model, fitted on full measurements alone, still predicts it
within reach of the incumbent, it is measured again in full (once). When every config
has been measured, TPE's proposals re-measure configs. Noise is handled after the
search, by re-measuring the top configs (``tuner.policy``).

It is a plain ``optuna.samplers.BaseSampler``: Optuna stays the engine (the study, its
storage, ask and tell), only the choice of the next point is ours.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from tuner import knobs, spec
from tuner.records import stage_rates


class GuidedSampler(optuna.samplers.BaseSampler):
    """Starting points first, then the untried config of highest expected improvement
    under ``InteractionModel``; any untried config when none is left to score.

    Args:
        domain: the searched knobs and their values (every list has 2+ values).
        start: the first config to try (values from ``domain``), or a list of them, in order.
        canonical: maps a config to the hashable key of what actually runs (inactive
            knobs dropped), so that equivalent configs are not measured twice.
        direction: "maximize" or "minimize" the study's single objective.
        cores: the CPU cores a trial has, on a CPU search (threads and workers share
            them); None on GPUs.
        fixed: the knobs the space holds at one value (a fixed thread or worker count
            shares the cores as a searched one does).
        splits: the starts that split the cores between threads and workers
            (``Space.split_starts``): once a trial with workers has been measured, each
            takes the threads its workers leave by the cores they were measured to use
            (``LoaderUse``), not by their count.
        throughput: the objective is samples/s, so the model is one of the pipeline's
            two stages (``Pipeline``): the step's rate, fitted, and the loading's, measured.
        grow_batch: the trials run on GPUs and the micro-batch is searched: once a config
            has been measured in full, the best one is measured at the largest micro-batch
            its measured device memory says fits (``_grown``).
    """

    def __init__(self, domain: dict[str, list], start: dict | list[dict], canonical: Callable[[dict], Any],
                 direction: str = "maximize", seed: int | None = None, cores: int | None = None,
                 fixed: dict | None = None, splits: list[dict] = (), throughput: bool = False,
                 grow_batch: bool = False):
        self.domain = dict(sorted(domain.items(), key=lambda kv: knobs.KNOBS[kv[0]].priority
                                  if kv[0] in knobs.KNOBS else 99))
        starts = start if isinstance(start, list) else [start]
        self.starts = [{k: s[k] for k in self.domain} for s in starts]
        self.start = self.starts[-1]  # fills knobs a trial was not asked (inactive ones)
        self.canonical = canonical
        self.sign = 1.0 if direction == "maximize" else -1.0
        self.seed = seed or 0
        self.cores = cores
        self.fixed = dict(fixed or {})
        split_keys = {canonical({k: s[k] for k in self.domain}) for s in splits}
        self.split = [canonical(s) in split_keys for s in self.starts]
        self.throughput = throughput and direction == "maximize"
        self.grow_batch = grow_batch and self.throughput and len(self.domain.get("micro_batch_size", ())) > 1
        self.fallback = optuna.samplers.TPESampler(seed=seed)
        self._plans: dict[int, dict | None] = {}
        self._unset: int | None = None  # the threads a config without torch_threads ran with

    def advice_first(self) -> None:
        """Measure the second start (the guides' advice) before the first (PyTorch's
        defaults): where the time left holds two configs at most, the first is the config
        likeliest to be faster than what the user has, which the baseline measured."""
        if len(self.starts) > 1 and not self._plans:
            self.starts[:2], self.split[:2] = self.starts[1::-1], self.split[1::-1]

    # --- optuna's interface --------------------------------------------------------------

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        if trial.number not in self._plans:
            self._plans[trial.number] = self.plan(study, trial.number)
        plan = self._plans[trial.number]
        if plan is not None and param_name in plan:
            value = plan[param_name]
            if not isinstance(param_distribution, CategoricalDistribution) or value in param_distribution.choices:
                return value
        return self.fallback.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: list[float] | None) -> None:
        self.fallback.after_trial(study, trial, state, values)

    # --- the strategy ---------------------------------------------------------------------

    def plan(self, study: optuna.Study, number: int) -> dict | None:
        """The config trial ``number`` should run, or None to let TPE choose."""
        trials = [t for t in study.get_trials(deepcopy=False) if t.number != number]
        seen = {self.canonical(p) for n, p in self._plans.items() if p is not None and n != number}
        # A FAIL from before a resume is a trial cut by a kill or a Ray crash: it may run again.
        seen |= {self.canonical(self._complete(t.params)) for t in trials
                 if t.state in (TrialState.COMPLETE, TrialState.PRUNED)}
        complete = [t for t in trials if t.state == TrialState.COMPLETE and t.values]
        # (config, figure, screened, data wait)
        done = [(self._complete(t.params), t.values[0], bool(t.user_attrs.get("screened")),
                 t.user_attrs.get("data_wait_fraction")) for t in complete]
        figures = [({**self.fixed, **self._complete(t.params)}, t.user_attrs) for t in trials
                   if t.state == TrialState.COMPLETE]
        use = loader_use(figures) if self.cores else None
        self._unset = unset_threads(figures) if self.cores else None
        pipe = pipeline(figures, self.cores) if self.throughput else None
        for start, split in zip(self.starts, self.split, strict=True):
            if self.canonical(start) in seen:
                continue
            start = self._settled(start, done)
            if split and use is not None:
                start = self._split(start, use, seen)
                if start is None:
                    continue
            if self.canonical(start) not in seen:
                return start
        if not done:
            return next((c for c in self._candidates(self.start) if self.canonical(c) not in seen),
                        self._untried(seen, number))
        grown = self._grown(trials) if self.grow_batch else self._halved(trials)
        if grown is not None and self.canonical(grown) not in seen:
            return grown
        full = [d for d in done if not d[2]]
        retry = self._screened_contender(full, done, number, use, pipe)
        if retry is not None:
            return retry
        model = InteractionModel(self.domain, done, self.sign, self.cores, fixed=self.fixed, use=use, pipeline=pipe,
                                 unset_threads=self._unset)
        # Expected improvement over the model's own figure for the best config measured
        # so far: the best single figure is the luckiest draw of several, and chasing it
        # under-explores (the plug-in incumbent of noisy EI).
        measured = [c for c, v, *_ in (full or done) if 0 < v < 1e17]
        top = max(map(model.predict, measured)) if measured else model.mean
        pool = self._every_config()
        if pool is None:  # too many to score all: the one- and two-knob moves from the best
            incumbent = max(full or done, key=lambda d: self.sign * d[1])[0]
            pool = self._candidates(incumbent)
        best, best_score = None, -math.inf
        for candidate in pool:  # in priority order: ties keep the first
            if self.canonical(candidate) in seen:
                continue
            score = model.expected_improvement(candidate, top)
            if score > best_score + 1e-12:
                best, best_score = candidate, score
        return best if best is not None else self._untried(seen, number)

    def _grown(self, trials: list[FrozenTrial]) -> dict | None:
        """The best config measured in full so far at the largest micro-batch listed that
        its measured peak device memory, scaled with the batch, says fits (the largest
        listed where a trial reported no memory), or None once a config at that batch has
        been asked for. The guides: a GPU kept busy by larger batches spreads each step's
        fixed costs (launches, host syncs, the optimizer) over more samples. The advice
        does not start there because the largest listed may not fit, and an infeasible
        start teaches the model that every value it holds is bad; one measured config
        tells what fits, and this one move tells the model what the batch is worth."""
        best = self._best_full(trials)
        if best is None:
            return None
        config = self._complete(best.params)
        batch = config["micro_batch_size"]
        peak, total = best.user_attrs.get("peak_device_memory_mb"), best.user_attrs.get("gpu_memory_mb")
        fits = [b for b in self.domain["micro_batch_size"] if b > batch
                and not (peak and total and peak * b / batch > MEMORY_FITS * total)]
        if not fits:
            return None
        target = max(fits)
        if self._asked_at(target, trials):
            return None
        return {**config, "micro_batch_size": target}

    def _best_full(self, trials: list[FrozenTrial]) -> FrozenTrial | None:
        """The best trial measured in full (not screened, feasible), or None."""
        full = [t for t in trials if t.state == TrialState.COMPLETE and t.values
                and not t.user_attrs.get("screened") and 0 < t.values[0] < 1e17]
        return max(full, key=lambda t: self.sign * t.values[0]) if full else None

    def _asked_at(self, batch: int, trials: list[FrozenTrial], besides: set = frozenset()) -> bool:
        """Whether a config at micro-batch ``batch`` was asked for (planned or run), of those
        whose key is not in ``besides``."""
        asked = [p for p in self._plans.values() if p is not None] + [self._complete(t.params) for t in trials]
        return any(p["micro_batch_size"] == batch and self.canonical(p) not in besides for p in asked)

    def _halved(self, trials: list[FrozenTrial]) -> dict | None:
        """On a CPU, the best config measured in full so far at the micro-batch listed
        nearest half the largest (``middle_batch``); where the best is already at that
        batch or below it, at the listed batch nearest half its own (a walk down while each
        step wins). None where fewer than three are listed, once a config past the starts
        has been asked at the target batch, for an objective other than samples/s, and
        while the best config's workers bound its rate (its data wait says so:
        ``stage_rates``). Where the best sits at the smallest batch listed (PyTorch's
        defaults beat the advice), the walk goes down from the advice instead
        (``_walked_from_largest``).

        The advice starts at the largest batch listed, and the model's moves from there go
        one listed value at a time: where the rate is flat from the largest to the next, no
        move goes further down, and a faster batch below them goes unmeasured (seen on a
        1-D conv net over spectrograms). Where a step down won, the next one down is asked
        before the model's moves: on padded sequences the per-sample cost grows with the
        batch (its longest item grows with it) all the way down (seen on a transformer over
        long-tailed turns), and one listed value per model move comes down too slowly."""
        batches = self.domain.get("micro_batch_size", ())
        middle = middle_batch(batches) if self.cores and self.throughput else None
        top = self._best_full(trials) if middle is not None else None
        if top is None:
            return None
        if self._complete(top.params)["micro_batch_size"] == min(batches):
            return self._walked_from_largest(trials, middle)
        step = self._half_of(top, middle)
        starts = {self.canonical(s) for s in self.starts}
        if step is None or self._asked_at(step["micro_batch_size"], trials, starts):
            return None
        return step

    def _half_of(self, trial: FrozenTrial, middle: int) -> dict | None:
        """``trial``'s config one halving down (to ``middle`` from above it, else to the
        batch listed nearest half its own), or None where none is listed below it or its
        workers bound its rate (its data wait says so: no batch loads faster, and the
        model's moves come first)."""
        config, wait = self._complete(trial.params), trial.user_attrs.get("data_wait_fraction")
        batch = config["micro_batch_size"]
        target = middle if batch > middle else nearest([b for b in self.domain["micro_batch_size"] if b < batch],
                                                       batch / 2)
        if target is None:
            return None
        workers = int({**self.fixed, **config}.get("num_workers") or 0)
        if workers and wait is not None and stage_rates(trial.values[0], wait, workers, self.cores)[1] is not None:
            return None
        return {**config, "micro_batch_size": target}

    def _walked_from_largest(self, trials: list[FrozenTrial], middle: int) -> dict | None:
        """The walk down from the best config measured at the largest batch listed (the
        advice's), for where PyTorch's defaults at the smallest batch beat every start:
        that config at each halving, and each next halving while the last one read faster
        than the config it halved; once one lost, the config it halved at the smallest
        batch listed (the defaults'), once; None while a step is asked and not measured yet.
        Screened figures count: the starts at a slow largest batch are screened, and the
        walk asks whether the batch is what made them slow.

        The defaults differ from the advice in several knobs at once, so their win does not
        tell the model the batch's part in it, and its one- and two-knob moves from the
        defaults rarely reach the advice's other knobs at a small batch (padded sequences
        with long tails, whose per-sample cost fell several-fold from the largest batch to
        the smallest: there, searches that never measured the advice at the small batch
        picked configs at half its rate or less). A lost halving does not say that no
        smaller batch wins: a cost per sample that falls off a cliff between two listed
        batches (a recurrent net over token lists, several times slower per sample at the
        two largest batches than at the two smallest), or a screened step's noise, ends the
        walk above the batches where the advice beats the defaults. The advice at the
        defaults' batch differs from them in the other knobs alone, and tells the model
        whether those are what lost."""
        done = {self.canonical(self._complete(t.params)): t for t in trials if t.state == TrialState.COMPLETE
                and t.values and 0 < t.values[0] < 1e17}
        largest = max(self.domain["micro_batch_size"])
        at_largest = [t for t in done.values() if self._complete(t.params)["micro_batch_size"] == largest]
        if not at_largest:
            return None
        node = max(at_largest, key=lambda t: self.sign * t.values[0])
        asked = {self.canonical(p) for p in self._plans.values() if p is not None}
        asked |= {self.canonical(self._complete(t.params)) for t in trials}
        while (step := self._half_of(node, middle)) is not None:
            key = self.canonical(step)
            if key not in done:
                return None if key in asked else step
            if self.sign * (done[key].values[0] - node.values[0]) <= 0:
                break  # the halving lost: the walk ends
            node = done[key]
        else:
            return None
        smallest = {**self._complete(node.params), "micro_batch_size": min(self.domain["micro_batch_size"])}
        return None if self.canonical(smallest) in asked else smallest

    def _settled(self, start: dict, done: list) -> dict:
        """``start`` with each knob that two measured starts settled between them: where
        two starts differ in that knob alone, the later starts take the value that read
        better (a start holding the loser's value takes the winner's). The starts pair
        the guides' advice with one knob changed where the guides' value wins on some
        hosts and loses on others (bf16 on a CPU: faster than fp32 on one host, slower on
        another with the same AVX512-BF16 flag); the starts after the pair then measure
        their own question (the split of the cores) on the side the pair found faster."""
        figures: dict = {}
        for c, v, *_ in done:  # a start's first figure: a later re-measurement that flips the
            figures.setdefault(self.canonical(c), v)  # pair must not bring back a start it replaced
        measured = {k: figures[k] for k in map(self.canonical, self.starts) if k in figures}
        settled = dict(start)
        for a, b in itertools.combinations(self.starts, 2):
            diff = [k for k in self.domain if a[k] != b[k]]
            va, vb = measured.get(self.canonical(a)), measured.get(self.canonical(b))
            if len(diff) != 1 or va is None or vb is None or va == vb:
                continue
            k = diff[0]
            loser, winner = (a, b) if self.sign * (vb - va) > 0 else (b, a)
            if settled[k] == loser[k]:
                settled[k] = winner[k]
        return settled

    def _split(self, start: dict, use: LoaderUse, seen: set) -> dict | None:
        """A split start with the threads its workers leave by the cores they use
        (``use``), or None where it was measured at any thread count: the question it
        asks (this many workers) is answered."""
        threads = self.domain["torch_threads"]
        if any(self.canonical({**start, "torch_threads": t}) in seen for t in threads):
            return None
        workers = {**self.fixed, **start}.get("num_workers") or 0
        return {**start, "torch_threads": spec.threads_left(threads, round(use.cores(workers)), self.cores)}

    def _every_config(self, limit: int | None = None) -> list[dict] | None:
        """Every config of the domain, or None for a domain of more than ``limit``
        (default ``SCORE_ALL``)."""
        if math.prod(len(v) for v in self.domain.values()) > (limit or SCORE_ALL):
            return None
        return [dict(zip(self.domain, values, strict=True)) for values in itertools.product(*self.domain.values())]

    def _screened_contender(self, full: list, done: list, number: int, use: LoaderUse | None,
                            pipe: Pipeline | None) -> dict | None:
        """A screened config to measure again in full: of those screened once and not
        measured since (nor on their way to be), the one the model of full measurements
        predicts best, if within ``RETRY_WITHIN`` of the best full figure. A candidate that
        holds a knob value no full measurement holds (bf16 on a host without bf16
        instructions, a compile: every config with it screened) is predicted with its own
        screened figure heard too, at the weight a screened figure has in the search's
        model: the full measurements alone know nothing of that value, and would rate a
        config that screened at a tenth of the incumbent as high as any."""
        feasible = [self.sign * math.log(v) for _, v, *_ in full if 0 < v < 1e17]
        if len(full) < 3 or not feasible:
            return None
        measured = Counter(self.canonical(c) for c, *_ in done)
        planned = Counter(self.canonical(p) for n, p in self._plans.items() if p is not None and n != number)
        candidates = [d for d in done if d[2] and measured[k := self.canonical(d[0])] == 1 and planned[k] <= 1]
        if not candidates:
            return None
        model = InteractionModel(self.domain, full, self.sign, self.cores, fixed=self.fixed, use=use, pipeline=pipe,
                                 unset_threads=self._unset)
        known = {(k, _hashable(c[k])) for c, *_ in full for k in self.domain}

        def predicted(d: tuple) -> float:
            if all((k, _hashable(d[0][k])) in known for k in self.domain):
                return model.predict(d[0])
            told = InteractionModel(self.domain, [*full, d], self.sign, self.cores, fixed=self.fixed, use=use,
                                    pipeline=pipe, unset_threads=self._unset)
            return told.predict(d[0])

        scores = [predicted(d) for d in candidates]
        best = scores.index(max(scores))  # the first of equals, as max() takes it
        return dict(candidates[best][0]) if scores[best] >= max(feasible) - math.log(RETRY_WITHIN) else None

    def _untried(self, seen: set, number: int) -> dict | None:
        """Any config not measured yet (a seeded random order), for when the neighbourhood
        is exhausted; None (TPE chooses) only for spaces too large to enumerate."""
        import random

        configs = self._every_config(limit=20000)
        if configs is None:
            return None
        random.Random(self.seed + number).shuffle(configs)
        return next((c for c in configs if self.canonical(c) not in seen), None)

    def _candidates(self, incumbent: dict) -> Iterator[dict]:
        return itertools.chain(self.neighbors(incumbent, 1), self.neighbors(incumbent, 2))

    def _complete(self, params: dict) -> dict:
        """A trial's params with the knobs it was not asked (inactive ones) filled in."""
        return {k: params.get(k, self.start[k]) for k in self.domain}

    def neighbors(self, config: dict, changes: int) -> Iterator[dict]:
        """Configs that differ from ``config`` in ``changes`` knobs; nearer values first,
        and at each distance, knobs in priority order."""
        names = list(self.domain)
        max_dist = max(len(v) for v in self.domain.values())
        for dist in range(1, max_dist):
            for combo in itertools.combinations(names, changes):
                options = [self._at_distance(k, config[k], dist) for k in combo]
                for values in itertools.product(*options):
                    yield {**config, **dict(zip(combo, values, strict=True))}

    def _at_distance(self, knob: str, value: Any, dist: int) -> list:
        values = self.domain[knob]
        i = values.index(value) if value in values else 0
        return [values[j] for j in (i + dist, i - dist) if 0 <= j < len(values)]


def middle_batch(batches: Sequence[int]) -> int | None:
    """The micro-batch listed nearest half the largest (by ratio), of those strictly
    between the smallest and the largest; None where there is none (two listed)."""
    if len(batches) < 3:
        return None
    return nearest([b for b in batches if min(batches) < b < max(batches)], max(batches) / 2)


def nearest(values: Sequence[int], target: float) -> int | None:
    """The value nearest ``target`` by ratio; None where there is none."""
    return min(values, key=lambda b: abs(math.log(b / target))) if values else None


# A micro-batch "fits" where the peak device memory measured at a smaller one, scaled in
# proportion to the batch (an overestimate: weights and optimizer state do not grow with
# it), stays within this share of the device's memory (the allocator's fragmentation and
# cuDNN's workspaces take the rest).
MEMORY_FITS = 0.8

# Spaces up to this many configs have every config scored for the next trial.
SCORE_ALL = 5000

# A screened config predicted within this of the incumbent is measured in full: ridge
# shrinks the predictions of the best configs towards the mean, a few percent below their
# figures, so a much narrower band would never fire.
RETRY_WITHIN = 1.08


class InteractionModel:
    """log(objective) ~ intercept + one effect per (knob, value) + one per pair of values of
    two knobs + (CPU) an ``oversubscription`` term; Bayesian ridge regression: the
    penalties are noise² / prior variance, pairs shrunk ``pair_ridge / ridge`` times
    harder than single knobs, ``noise`` the scale of the posterior's spread (log units).

    ``unset_threads``: the threads a config without ``torch_threads`` ran with (as the
    module's ``unset_threads`` reads them from the trials), for the oversubscription term;
    None reads every core.

    ``done``: (config, value, screened[, data wait]) tuples. A screened figure (a few
    windows) weighs ``screened_weight``. Infeasible trials (objective 0 or the minimize
    penalty) count as much worse than the worst feasible one, so their values are avoided.

    With a ``pipeline`` (a throughput objective), the model is the step's rate (each
    figure with its data wait taken out), and a config's throughput is the step's rate
    through the loading's measured limit (``Pipeline.limit``): what only more loading
    processes can raise, no other knob is credited with.
    """

    def __init__(self, domain: dict[str, list], done: list[tuple], sign: float, cores: int | None = None, *,
                 fixed: dict | None = None, use: LoaderUse | None = None, pipeline: Pipeline | None = None,
                 unset_threads: int | None = None, ridge: float = 0.3, pair_ridge: float = 1.5,
                 screened_weight: float = 0.3, noise: float = 0.1):
        names = list(domain)
        self.cores, self.fixed, self.use, self.pipeline = cores, dict(fixed or {}), use, pipeline
        self.unset_threads = unset_threads
        if pipeline is not None:
            done = [(d[0], pipeline.step_rate(d[1], d[3] if len(d) > 3 else None), *d[2:]) for d in done]
        self.columns: dict[tuple, int] = {}
        for k, vs in domain.items():
            for v in vs:
                self.columns[(k, _hashable(v))] = len(self.columns)
        self.n_main = len(self.columns)
        self.pairs = list(itertools.combinations(names, 2))
        for a, b in self.pairs:
            for va, vb in itertools.product(domain[a], domain[b]):
                self.columns[(a, _hashable(va), b, _hashable(vb))] = len(self.columns)
        self.over = len(self.columns) if cores else None
        n = len(self.columns) + (1 if cores else 0)
        feasible = [sign * math.log(d[1]) for d in done if 0 < d[1] < 1e17]
        floor = (min(feasible) if feasible else 0.0) - math.log(2.0)
        y = np.array([sign * math.log(d[1]) if 0 < d[1] < 1e17 else floor for d in done])
        x = np.array([self._row(d[0], n) for d in done])
        w = np.array([screened_weight if len(d) > 2 and d[2] else 1.0 for d in done])
        self.mean = float((w * y).sum() / w.sum())
        penalty = np.full(n, pair_ridge)
        penalty[:self.n_main] = ridge
        if cores:
            penalty[self.over] = ridge / 3  # a physical effect, not a guess: little shrinkage
        a = x.T @ (w[:, None] * x) + np.diag(penalty)
        self.w = np.linalg.solve(a, x.T @ (w * (y - self.mean)))
        self.a_inv = np.linalg.inv(a)
        self.noise = noise
        self.n = n

    def posterior(self, config: dict) -> tuple[float, float]:
        """The fitted figure's posterior mean and spread (log units): with a pipeline, the
        step's rate; otherwise the objective's."""
        row = self._row(config)
        return self.mean + float(row @ self.w), self.noise * math.sqrt(max(1e-12, float(row @ self.a_inv @ row)))

    def _through(self, config: dict, mu: float, sd: float) -> tuple[float, float, float]:
        """The objective's mean and spread from the step's (``mu``, ``sd``), and the most
        it can be (inf where the loading's limit is not known): without workers the
        training process loads, then steps (their times add); with workers, the slower
        stage sets the rate."""
        limit = self.pipeline.limit({**self.fixed, **config}) if self.pipeline is not None else None
        if limit is None:
            return mu, sd, math.inf
        serial, rate = limit
        cap = math.log(rate)
        if not serial:
            return min(mu, cap), sd, cap
        step = math.exp(mu)
        return -math.log(1 / step + 1 / rate), sd * rate / (step + rate), cap

    def _row(self, config: dict, n: int | None = None) -> np.ndarray:
        row = np.zeros(n or self.n)
        for k, v in config.items():
            i = self.columns.get((k, _hashable(v)))
            if i is not None:
                row[i] = 1.0
        for a, b in self.pairs:
            i = self.columns.get((a, _hashable(config.get(a)), b, _hashable(config.get(b))))
            if i is not None:
                row[i] = 1.0
        if self.over is not None:
            row[self.over] = oversubscription({**self.fixed, **config}, self.cores, self.use, self.unset_threads)
        return row

    def predict(self, config: dict) -> float:
        mu = self.mean + float(self._row(config) @ self.w)
        return self._through(config, mu, 0.0)[0] if self.pipeline is not None else mu

    def expected_improvement(self, config: dict, top: float) -> float:
        """log E[max(0, f(config) - top)] under the posterior (a log, so that the far
        tails still rank); f held under the loading's limit where it is known:
        E[max(0, min(f, cap) - top)] = EI(top) - EI(cap)."""
        mu, sd = self.posterior(config)
        mu, sd, cap = self._through(config, mu, sd)
        z = (min(mu, cap) - top) / sd
        ei = _ei(mu, sd, top) - (_ei(mu, sd, cap) if cap < math.inf else 0.0)
        return math.log(ei) if ei > 1e-300 else -700.0 + z  # ordered by z past underflow


def _ei(mu: float, sd: float, top: float) -> float:
    z = (mu - top) / sd
    return (mu - top) * _phi_cdf(z) + sd * _phi_pdf(z)


def oversubscription(config: dict, cores: int | None, use: LoaderUse | None = None,
                     unset: int | None = None) -> float:
    """Intra-op threads that DataLoader workers leave without a core of their own, as a
    fraction of the cores. Threads unset run the user's own default (their OMP_NUM_THREADS,
    else PyTorch's choice: the physical cores), which a trial reports (``unset``, from
    ``unset_threads``); before one has, they are read as every core, the most a trial's
    default takes. Workers tolerate sharing cores; a multi-threaded op stalls at its
    barriers while one of its threads waits for a core. The workers take the cores they
    were measured to use (``use``), else one each."""
    if not cores:
        return 0.0
    threads = config.get("torch_threads") or unset or cores
    if threads <= 1:
        return 0.0
    workers = int(config.get("num_workers") or 0)
    busy = use.cores(workers) if use is not None else workers
    return max(0.0, threads + busy - cores) / cores


def unset_threads(trials: list[tuple[dict, dict]]) -> int | None:
    """The intra-op threads the trials without ``torch_threads`` ran with (the records'
    ``intra_op_threads``: the user's OMP_NUM_THREADS, else PyTorch's own choice, at most
    the CPUs the trial reserved), from measured trials ((config, figures) pairs); None
    before one reported them."""
    seen = [int(f["intra_op_threads"]) for c, f in trials
            if not c.get("torch_threads") and (f.get("intra_op_threads") or 0) >= 1]
    return round(statistics.median(seen)) if seen else None


@dataclass(frozen=True)
class LoaderUse:
    """What the DataLoader workers cost the cores, measured: the core-seconds their loading
    takes per sample, and the rate the search aims at (the best figure so far). Workers
    feeding that rate use ``per_sample x rate`` cores between them, at most one each: a
    worker that decodes uses its core, one that waits on a disk or a queue leaves most of
    it to the intra-op threads (the first stage of a pipeline model, in the manner of
    Plumber's and tf.data's accounting of one CPU budget among the stages)."""

    per_sample: float
    rate: float

    def cores(self, workers: int) -> float:
        """The cores ``workers`` workers use at the target rate."""
        return min(float(workers), self.per_sample * self.rate) if workers > 0 else 0.0


def loader_use(trials: list[tuple[dict, dict]]) -> LoaderUse | None:
    """``LoaderUse`` from measured trials ((config, figures) pairs: a trial's full config
    and its logged figures): the median of loader_cpu_cores / samples_per_sec over the
    trials with workers, and the best unscreened samples_per_sec; None before a trial
    with workers reported the cores they used."""
    per_sample, best = [], 0.0
    for config, figures in trials:
        rate = figures.get("samples_per_sec")
        if not rate or rate <= 0:
            continue
        if not figures.get("screened"):
            best = max(best, rate)
        used = figures.get("loader_cpu_cores")
        if (config.get("num_workers") or 0) > 0 and used is not None:
            per_sample.append(used / rate)
    if not per_sample or best <= 0:
        return None
    return LoaderUse(statistics.median(per_sample), best)


# Loader knobs that change one loading process's work per sample. The worker count, the
# queue's depth and the workers' lifetime change how many load at once, not each one's work;
# a sample's loading costs about the same in a batch of any size.
_LOADING_ALIKE = ("num_workers", "prefetch_factor", "persistent_workers", "micro_batch_size")


def _loads_as(config: dict) -> tuple:
    """The group of configs whose loading processes do the same work per sample."""
    return tuple((k, _hashable(config.get(k))) for k, knob in sorted(knobs.KNOBS.items())
                 if knob.loader and k not in _LOADING_ALIKE)


@dataclass(frozen=True)
class Pipeline:
    """The input pipeline's loading stage, measured: how many samples/s one loading process
    delivers, per group of configs that load alike (Plumber's model of a pipeline: stages
    with measured rates, the slowest one setting the pace). Without workers the training
    process loads between its steps (a trial's data wait over its time is the loading's
    share: its rate is the figure over that share); with workers, where they were the
    bottleneck, a worker's rate is the figure over the workers. A worker does the loading
    the training process did, so until workers were seen bound, the training process's own
    loading rate stands for a worker's, and a rate the workers were seen to keep up with
    is the least a worker can do."""

    main: dict  # loading group -> samples/s of the training process's own loading
    worker: dict  # loading group -> samples/s of one worker, where the workers bound the rate
    kept_up: dict  # loading group -> the most samples/s per worker that workers kept up with
    cores: int | None  # the cores a trial has (None on GPUs: one core per worker assumed)

    @staticmethod
    def step_rate(value: float, wait: float | None) -> float:
        """A figure with its data wait taken out: the rate of the steps alone."""
        if not wait or not 0 < value < 1e17:
            return value
        return stage_rates(value, min(wait, 0.9), 0)[0]  # a wait near 1 would put the step past any fit

    def limit(self, config: dict) -> tuple[bool, float] | None:
        """(serial, samples/s): what the loading allows ``config``, serial where the
        training process loads between its steps; None where no loading of its group was
        seen to bind."""
        group = _loads_as(config)
        workers = int(config.get("num_workers") or 0)
        if workers == 0:
            rate = self.main.get(group)
            return (True, rate) if rate else None
        rate = self.worker.get(group) or self.main.get(group)
        if not rate:
            return None
        return False, max(rate, self.kept_up.get(group, 0.0)) * min(workers, self.cores or workers)


def pipeline(trials: list[tuple[dict, dict]], cores: int | None) -> Pipeline | None:
    """``Pipeline`` from measured trials ((config, figures) pairs: a trial's full config and
    its logged figures); None before any trial's loading showed in its data wait."""
    main: dict = {}
    worker: dict = {}
    kept_up: dict = {}
    for config, figures in trials:
        rate, wait = figures.get("samples_per_sec"), figures.get("data_wait_fraction")
        if not rate or rate <= 0 or wait is None:
            continue
        group, workers = _loads_as(config), int(config.get("num_workers") or 0)
        _, load = stage_rates(rate, wait, workers, cores)
        if load is not None:
            (worker if workers else main).setdefault(group, []).append(load)
        elif workers:
            kept_up[group] = max(kept_up.get(group, 0.0), rate / workers)
    if not main and not worker:
        return None
    return Pipeline({g: statistics.median(v) for g, v in main.items()},
                    {g: statistics.median(v) for g, v in worker.items()}, kept_up, cores)


def _phi_pdf(z: float) -> float:
    return math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _phi_cdf(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def _hashable(v: Any) -> Any:
    return "__none__" if v is None else v
