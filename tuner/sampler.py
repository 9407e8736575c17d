"""GuidedSampler: an Optuna sampler that starts from the guides' advice and exploits
that knob effects are largely separable.

Strategy (DESIGN.md, "Searching well with few trials"): the first trials are the
given starting points (PyTorch's defaults, then the guides' recommended config).
Each next trial is an untried one- or two-knob change of the best config so far:
the one a separable model scores highest. The model is log-throughput as a sum of
one effect per (knob, value), fitted by ridge regression on every trial so far,
plus an exploration bonus for values never measured. Knob effects are largely
separable, so a value that helped in one trial is combined with one that helped in
another (a two-knob move) instead of being rediscovered; among equal scores, knobs
of larger usual impact go first (the knob table's ``priority``). When no neighbour is left, any untried config is
taken (Optuna's TPE only for spaces too large to enumerate); when every config has
been measured, TPE's proposals re-measure configs.
Noise is handled after the search, by re-measuring the top configs.

It is a plain ``optuna.samplers.BaseSampler``: Optuna stays the engine (study,
storage, Ray's OptunaSearch), only the choice of the next point is ours.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from tuner import knobs


class GuidedSampler(optuna.samplers.BaseSampler):
    """Starting points first, then the one- or two-knob move from the incumbent that the
    separable model scores highest; any untried config when no move is left.

    Args:
        domain: the searched knobs and their values (every list has 2+ values).
        start: the first config to try (values from ``domain``), or a list of them, in order.
        canonical: maps a config to the hashable key of what actually runs (inactive
            knobs dropped), so that equivalent configs are not measured twice.
        direction: "maximize" or "minimize" the study's single objective.
    """

    def __init__(self, domain: dict[str, list], start: dict | list[dict], canonical: Callable[[dict], Any],
                 direction: str = "maximize", seed: int | None = None):
        self.domain = dict(sorted(domain.items(), key=lambda kv: knobs.KNOBS[kv[0]].priority
                                  if kv[0] in knobs.KNOBS else 99))
        starts = start if isinstance(start, list) else [start]
        self.starts = [{k: s[k] for k in self.domain} for s in starts]
        self.start = self.starts[-1]  # fills knobs a trial was not asked (inactive ones)
        self.canonical = canonical
        self.sign = 1.0 if direction == "maximize" else -1.0
        self.seed = seed or 0
        self.fallback = optuna.samplers.TPESampler(seed=seed)
        self._plans: dict[int, dict | None] = {}

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
        # A FAIL from an earlier session is a trial cut by a kill or a Ray crash: it may run again.
        seen |= {self.canonical(self._complete(t.params)) for t in trials
                 if t.state in (TrialState.COMPLETE, TrialState.PRUNED)}
        for start in self.starts:
            if self.canonical(start) not in seen:
                return dict(start)
        done = [(self._complete(t.params), t.values[0]) for t in trials
                if t.state == TrialState.COMPLETE and t.values]
        if not done:
            return next((c for c in self._candidates(self.start) if self.canonical(c) not in seen),
                        self._untried(seen, number))
        model = SeparableModel(self.domain, done, self.sign)
        incumbent = max(done, key=lambda cv: self.sign * cv[1])[0]
        best, best_score = None, -math.inf
        for candidate in self._candidates(incumbent):  # in priority order: ties keep the first
            if self.canonical(candidate) in seen:
                continue
            score = model.score(candidate)
            if score > best_score + 1e-12:
                best, best_score = candidate, score
        return best if best is not None else self._untried(seen, number)

    def _untried(self, seen: set, number: int) -> dict | None:
        """Any config not measured yet (a seeded random order), for when the neighbourhood
        is exhausted; None (TPE chooses) only for spaces too large to enumerate."""
        import random

        if math.prod(len(v) for v in self.domain.values()) > 20000:
            return None
        configs = [dict(zip(self.domain, values, strict=True)) for values in itertools.product(*self.domain.values())]
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


class SeparableModel:
    """log(objective) ~ intercept + sum of one effect per (knob, value); ridge-regularized.

    ``score`` adds ``bonus`` for each of a config's values that no trial has measured
    (optimism: an untried value may help as much as a typical good knob does).
    Infeasible trials (objective 0 or the minimize penalty) count as much worse than
    the worst feasible one, so their values are avoided.
    """

    def __init__(self, domain: dict[str, list], done: list[tuple[dict, float]], sign: float,
                 ridge: float = 0.3, bonus: float = math.log(1.15)):
        self.columns = {(k, _hashable(v)): i for i, (k, v) in
                        enumerate((k, v) for k, vs in domain.items() for v in vs)}
        self.bonus = bonus
        feasible = [sign * math.log(v) for _, v in done if 0 < v < 1e17]
        floor = (min(feasible) if feasible else 0.0) - math.log(2.0)
        y = np.array([sign * math.log(v) if 0 < v < 1e17 else floor for _, v in done])
        x = np.array([self._row(c) for c, _ in done])
        self.counts = x.sum(axis=0)
        self.mean = float(y.mean())
        a = x.T @ x + ridge * np.eye(x.shape[1])
        self.w = np.linalg.solve(a, x.T @ (y - self.mean))

    def _row(self, config: dict) -> np.ndarray:
        row = np.zeros(len(self.columns))
        for k, v in config.items():
            i = self.columns.get((k, _hashable(v)))
            if i is not None:
                row[i] = 1.0
        return row

    def score(self, config: dict) -> float:
        row = self._row(config)
        unexplored = float(((row > 0) & (self.counts == 0)).sum())
        return self.mean + float(row @ self.w) + self.bonus * unexplored


def _hashable(v: Any) -> Any:
    return "__none__" if v is None else v
