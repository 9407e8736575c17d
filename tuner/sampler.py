"""GuidedSampler: an Optuna sampler that starts from the guides' advice and exploits
that knob effects are largely separable.

Strategy (DESIGN.md, "Searching well with few trials"): the first trials are the
given starting points (PyTorch's defaults, then the guides' recommended config);
each next trial is an untried one-knob change of the best
config so far (adjacent values first, knobs in order of their usual impact),
so the search moves to the best and repeats; when every one-knob change of the
incumbent was tried, two-knob changes follow, then Optuna's TPE takes over.
Noise is handled after the search, by re-measuring the top configs.

It is a plain ``optuna.samplers.BaseSampler``: Optuna stays the engine (study,
storage, Ray's OptunaSearch), only the choice of the next point is ours.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

# Knobs in the order of their usual impact on throughput: changes to earlier ones are tried first.
PRIORITY = ["precision", "num_workers", "micro_batch_size", "batch_grouping", "compile", "torch_threads",
            "persistent_workers", "channels_last", "fused_optimizer", "prefetch_factor", "pin_memory",
            "non_blocking", "cudnn_benchmark", "tf32", "grad_accum_steps", "activation_checkpointing"]


class GuidedSampler(optuna.samplers.BaseSampler):
    """Starting points first, then one-knob moves from the incumbent; TPE when those run out.

    Args:
        domain: the searched knobs and their values (every list has 2+ values).
        start: the first config to try (values from ``domain``), or a list of them, in order.
        canonical: maps a config to the hashable key of what actually runs (inactive
            knobs dropped), so that equivalent configs are not measured twice.
        direction: "maximize" or "minimize" the study's single objective.
    """

    def __init__(self, domain: dict[str, list], start: dict | list[dict], canonical: Callable[[dict], Any],
                 direction: str = "maximize", seed: int | None = None):
        order = {k: i for i, k in enumerate(PRIORITY)}
        self.domain = dict(sorted(domain.items(), key=lambda kv: order.get(kv[0], len(order))))
        starts = start if isinstance(start, list) else [start]
        self.starts = [{k: s[k] for k in self.domain} for s in starts]
        self.start = self.starts[-1]  # fills knobs a trial was not asked (inactive ones)
        self.canonical = canonical
        self.sign = 1.0 if direction == "maximize" else -1.0
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
        seen |= {self.canonical(self._complete(t.params)) for t in trials
                 if t.state in (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)}
        for start in self.starts:
            if self.canonical(start) not in seen:
                return dict(start)
        done = [t for t in trials if t.state == TrialState.COMPLETE and t.values]
        incumbent = self.start
        if done:
            best = max(done, key=lambda t: (self.sign * t.values[0], -t.number))
            incumbent = self._complete(best.params)
        for candidate in itertools.chain(self.neighbors(incumbent, 1), self.neighbors(incumbent, 2)):
            key = self.canonical(candidate)
            if key not in seen:
                return candidate
        return None

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
