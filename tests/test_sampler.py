"""GuidedSampler with real Optuna studies on synthetic landscapes (no Ray, no torch runs)."""

import json

import optuna
import pytest

from tuner.sampler import GuidedSampler

DOMAIN = {"precision": ["fp32", "bf16"], "num_workers": [0, 1, 2, 4], "micro_batch_size": [16, 32, 64, 128],
          "channels_last": [False, True]}
START = {"precision": "bf16", "num_workers": 1, "micro_batch_size": 32, "channels_last": False}


def speed(c):
    """Separable: each knob multiplies the rate; optimum at bf16, 2 workers, 64, channels_last."""
    return ((2.0 if c["precision"] == "bf16" else 1.0) * {0: 0.5, 1: 0.8, 2: 1.0, 4: 0.9}[c["num_workers"]]
            * {16: 0.7, 32: 0.85, 64: 1.0, 128: 0.95}[c["micro_batch_size"]]
            * (1.05 if c["channels_last"] else 1.0))


def key(c):
    return json.dumps(c, sort_keys=True)


def _study(seed=0):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = GuidedSampler(DOMAIN, START, key, seed=seed)
    return optuna.create_study(direction="maximize", sampler=sampler), sampler


def _objective(trial):
    return speed({k: trial.suggest_categorical(k, v) for k, v in DOMAIN.items()})


def test_starts_at_recommended_then_moves_by_one_or_two_knobs():
    study, _ = _study()
    study.optimize(_objective, n_trials=8)
    params = [t.params for t in study.trials]
    assert params[0] == START
    for i in range(1, len(params)):
        incumbent = max(params[:i], key=speed)
        assert sum(params[i][k] != incumbent[k] for k in DOMAIN) in (1, 2)


def test_never_repeats_a_config_and_finds_the_optimum_fast():
    study, _ = _study()
    study.optimize(_objective, n_trials=14)
    keys = [key(t.params) for t in study.trials]
    assert len(set(keys)) == len(keys)
    best = max(speed(dict(zip(DOMAIN, v, strict=True))) for v in
               __import__("itertools").product(*DOMAIN.values()))
    assert study.best_value == pytest.approx(best)


def test_falls_back_to_tpe_when_neighbourhoods_are_exhausted():
    small = {"precision": ["fp32", "bf16"]}
    sampler = GuidedSampler(small, {"precision": "bf16"}, key, seed=1)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.optimize(lambda t: 1.0 if t.suggest_categorical("precision", ["fp32", "bf16"]) == "bf16" else 0.5,
                   n_trials=4)
    assert len(study.trials) == 4  # the third and fourth come from TPE, no error


def test_minimize_direction_moves_towards_lower_values():
    sampler = GuidedSampler(DOMAIN, START, key, direction="minimize", seed=0)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    study.optimize(lambda t: 1.0 / _objective(t), n_trials=14)
    assert study.best_value == pytest.approx(1.0 / (2.0 * 1.0 * 1.0 * 1.05))


def test_several_starting_points_come_first_in_order():
    defaults = {"precision": "fp32", "num_workers": 0, "micro_batch_size": 32, "channels_last": False}
    sampler = GuidedSampler(DOMAIN, [defaults, START], key, seed=0)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.optimize(_objective, n_trials=3)
    assert study.trials[0].params == defaults and study.trials[1].params == START
