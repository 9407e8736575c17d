"""The synthetic many-core pipelines the search is replayed on (``benchmarks/many_cores.py``):
their physics, and one replayed search on 32 cores."""

import sys
from pathlib import Path

import optuna
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import many_cores as mc  # noqa: E402


def test_the_synthetic_pipeline_needs_a_split_of_the_cores_that_no_start_has_by_count():
    """Where loading takes over half the cores' worth at the fastest step, the best config
    gives workers cores and threads the rest; the loading's data wait is its share of a
    serial step; the workers' busy cores are at most their count."""
    land = mc.landscape(32, 0.6, 0.97, 1.35, 3.0, "searched", seed=0)
    best = max(land["grid"], key=lambda g: g["samples_per_sec"])["config"]
    assert best["num_workers"] >= 8 and best["torch_threads"] < 32
    for g in land["grid"]:
        c = g["config"]
        if c["num_workers"] == 0:
            assert g["loader_cpu_cores"] is None and 0 < g["data_wait_fraction"] < 1
        else:
            assert 0 < g["loader_cpu_cores"] <= c["num_workers"]
    unset = mc.landscape(32, 0.6, 0.97, 1.35, 3.0, "unset", seed=0)
    assert all("torch_threads" not in g["config"] for g in unset["grid"])


def test_a_replayed_search_on_32_cores_finds_a_config_near_the_best():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    picks = [mc._one(((32, 0.3, 0.9, 1.35, 3.0, "searched"), "tuner", seed, 12))[3] for seed in range(3)]
    assert min(picks) == pytest.approx(1.0, abs=0.07)
