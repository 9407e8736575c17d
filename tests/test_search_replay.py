"""The replay that judges the search (``benchmarks/search_replay.py``): what it reports
beside each pick, on a recorded landscape."""

import sys
from pathlib import Path

import optuna

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import search_replay as sr  # noqa: E402

from tuner.spec import Canonical, SearchSpace  # noqa: E402


def test_the_oracle_measures_the_best_configs_first_and_the_pick_is_told_apart_from_exploration():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    landscape, space, ctx = sr._load("lstm")
    canon, ss = Canonical(space, ctx), SearchSpace(space, ctx)
    rates, _ = sr.judged_rates(landscape, canon, ss)
    best_first = sorted(rates, key=lambda k: -rates[k])
    oracle = sr.Oracle(landscape, rates, canon, ss)
    assert [canon(c) for c in oracle.order[:3]] == best_first[:3]
    for seed in range(3):
        run = sr.replay(landscape, space, ctx, "oracle", seed, 6)
        assert run["explored"] == 1.0  # it measured the best config in full: what it lost is noise
        assert 0 < run["pick"] <= run["explored"]
        tuner = sr.replay(landscape, space, ctx, "tuner", seed, 6)
        assert 0 < tuner["pick"] <= tuner["explored"] <= 1.0
    # a search measured nothing in full but the baseline: it explored nothing
    machine = sr.Machine(landscape, canon, ss, 0, sr.measure_settings(space))
    assert sr.explored([{"phase": "baseline", "status": "ok", "key": best_first[0]}], machine) == 0.0
    assert sr.explored([{"phase": "search", "status": "ok", "screened": True, "key": best_first[0]},
                        {"phase": "search", "status": "ok", "key": best_first[1]}], machine) == \
        rates[best_first[1]] / rates[best_first[0]]
