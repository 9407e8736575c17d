"""The replay that judges the search (``benchmarks/search_replay.py``): what it reports
beside each pick, on a recorded landscape."""

import sys
from pathlib import Path

import optuna
import pytest

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


def test_an_addition_whose_rows_a_later_one_replaces_is_no_longer_listed(tmp_path, monkeypatch):
    """The results page lists each addition to the replay's JSON; one whose every row a
    later addition replaced (the tuner replayed again on the same landscapes) would say
    the page's figures came from rules that no longer made them."""
    import json

    out = tmp_path / "search_replay.json"
    out.write_text(json.dumps({"landscapes": {}, "results": {}, "added": [
        {"landscapes": ["lstm"], "strategies": ["tuner"], "rules_at": "old"},
        {"landscapes": ["lstm", "mlp"], "strategies": ["oracle", "tuner"], "rules_at": "old"},
        {"landscapes": ["lstm"], "rules_at": "before strategies were listed: every one"}]}))
    monkeypatch.setattr(sr, "_commit", lambda: "new")
    sr._add(out, ["lstm"], {"lstm": {"tuner": {"12": {"median": 1.0}}}}, 1.0, ["tuner"])
    data = json.loads(out.read_text())
    assert [(a["landscapes"], a.get("strategies"), a["rules_at"]) for a in data["added"]] == [
        (["lstm", "mlp"], ["oracle", "tuner"], "old"),  # its mlp rows and oracle rows stand
        (["lstm"], None, "before strategies were listed: every one"),
        (["lstm"], ["tuner"], "new")]
    assert data["results"]["lstm"]["tuner"]["12"]["median"] == 1.0 and data["landscapes"]["lstm"]["configs"] > 0


def test_the_results_page_says_under_which_rules_each_held_out_landscape_was_recorded():
    """A held-out landscape is judged apart only as long as no rule was chosen from it: the
    page names the rules each was recorded under, and a rule chosen later with held-out
    figures in view, with the landscapes it saw."""
    import render

    data = {"landscapes": {"a": {"rules_at": "c1"}, "b": {"rules_at": "c1"}, "c": {"rules_at": "c3"}},
            "held_out_seen": [{"commit": "c2", "seen": ["a", "b"], "why": "a retry rule read lower there."}]}
    [text, _] = render._held_out_provenance(data, ["a", "b", "c"])
    assert "commit c1 (a, b); c3 (c)." in text
    assert "Commit c2 chose a rule with the figures of a, b in view, held out until then: a retry rule read " \
        "lower there. They are counted with the landscapes the rules were chosen on since." in text
    assert render._held_out_provenance({"landscapes": {}}, []) == []


def test_a_picks_shortfall_is_told_as_lost_in_the_rounds_or_no_contender_and_held_out_landscapes_stay_out(
        monkeypatch, capsys):
    landscape, space, ctx = sr._load("lstm")
    canon, ss = Canonical(space, ctx), SearchSpace(space, ctx)
    machine = sr.Machine(landscape, canon, ss, 0, sr.measure_settings(space))
    ranked = sorted(machine.rate, key=lambda k: -machine.rate[k])
    best, worse = ranked[0], next(k for k in ranked if machine.rate[k] < 0.9 * machine.rate[ranked[0]])

    def rec(key, phase="search", **more):
        return {"phase": phase, "status": "ok", "key": key, **more}

    assert sr.shortfall([rec(best), rec(best, "confirm")], machine, best) == "none"
    assert sr.shortfall([rec(best), rec(worse), rec(best, "confirm"), rec(worse, "confirm")], machine,
                        worse) == "lost in the rounds"
    assert sr.shortfall([rec(best), rec(worse), rec(worse, "confirm")], machine, worse) == "no contender"
    # screened, the best was never measured in full: the pick is the best the search measured
    assert sr.shortfall([rec(best, screened=True), rec(worse), rec(worse, "confirm")], machine, worse) == "none"

    # ``tuned`` replays the landscapes the rules are chosen on, never a held-out one
    replayed = []
    monkeypatch.setattr(sr, "_tuned_job", lambda args: (replayed.append(args[0]) or args[0], {
        "pick": 1.0, "explored": 1.0, "measurements": 20, "shortfall": "none", "false_negatives": []}))
    sr.tuned(12, 1, 0, 1)
    held = {p.stem for p in sr.LANDSCAPES.glob("*.json") if sr._load(p.stem)[0].get("held_out")}
    assert held and replayed and not held & set(replayed)
    assert "lstm" in replayed and "mean median 1.0000" in capsys.readouterr().out


def test_a_cpu_landscape_says_whether_its_trials_reported_the_cores_they_used():
    """Replayed without the cores its trials and their workers used, a landscape cannot show
    the split starts taking the threads those cores leave: the page marks it."""
    import render

    facts = {name: sr._landscape_facts(name)["cores_recorded"] for name in ("files_stages", "files_xeon", "gpu_resnet50")}
    assert facts == {"files_stages": True, "files_xeon": False, "gpu_resnet50": None}  # a GPU has no split starts
    info = {"configs": 1, "repeat_cv": 0.0, "hardware": {"cpu": "x", "cpu_count": 2}, "measured": "now"}
    data = {"budgets": [12], "seeds": 1, "gp_seeds": 1, "results": {}, "landscapes": {}}
    for name, recorded in facts.items():
        data["landscapes"][name] = {**info, "cores_recorded": recorded}
        data["results"][name] = {"tuner": {"12": {"median": 1.0, "p10": 1.0}}}
    marked = [line.split("**")[1] for line in render._search_replay(data) if "cores used not recorded)" in line]
    assert marked == ["files_xeon"]


def test_repeat_s_band_is_set_by_the_judged_best_not_a_lucky_first_figure():
    """A best first figure of 100 whose repeats read 80 and 84: the judged best is the
    mean of its three (88), above any other config's figure, so configs within 0.9 of 88
    (79.2 and up) are the contenders that need their repeats, not those within 0.9 of 100."""
    grid = [{"config": {"b": b}, "samples_per_sec": v} for b, v in ((1, 100.0), (2, 86.0), (3, 80.0), (4, 70.0))]
    landscape = {"grid": grid}
    assert sr._judged_best(landscape) == 100.0  # before its repeats, the first figure stands
    landscape["repeats"] = [{"config": {"b": 1}, "samples_per_sec": [100.0, 80.0, 84.0]}]
    assert sr._judged_best(landscape) == 88.0
    landscape["repeats"].append({"config": {"b": 2}, "samples_per_sec": [86.0, 96.0, 94.0]})
    assert sr._judged_best(landscape) == 92.0  # a contender's mean above the first best's
    landscape["repeats"].append({"config": {"b": 3}, "samples_per_sec": [80.0, None, 70.0]})
    assert sr._judged_best(landscape) == 92.0  # a failed repeat is left out of its mean
    assert sr.repeat_band({"grid": grid, "repeats": landscape["repeats"][:1]}) == pytest.approx(0.9 * 88.0)
    # the best's repeats read higher (the machine drifted up): the band stays where the
    # judge asks for every config's repeats, 0.9 of the best first figure, not of the mean
    drift = {"grid": grid, "repeats": [{"config": {"b": 1}, "samples_per_sec": [100.0, 114.0, 116.0]}]}
    assert sr._judged_best(drift) == 110.0 and sr.repeat_band(drift) == pytest.approx(90.0)


def test_a_replayed_baseline_runs_as_long_as_an_eager_trial_not_the_grids_median():
    """The baseline is the plain loop, eager: on a landscape with compile, whose compiled
    trials take three times an eager one's wall, a replayed baseline as long as the grid's
    median left a short time budget no room for any config, where a live search has it."""
    import statistics

    from tuner.policy import Phase, Task

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    landscape, space, ctx = sr._load("gpt2")
    canon, ss = Canonical(space, ctx), SearchSpace(space, ctx)
    machine = sr.Machine(landscape, canon, ss, 0, sr.measure_settings(space))
    eager = [g["trial_wall_s"] for g in landscape["grid"] if g["config"]["compile"] == "off"]
    wall = machine.measure(Task(0, Phase.BASELINE, space.baseline_config(), None, None, 0.0))["trial_wall_s"]
    assert wall == statistics.median(eager) < 0.7 * machine.typical_wall
    run = sr.replay(landscape, space, ctx, "tuner", 0, 100, time_s=100.0)
    assert run["configs"] >= 3 and run["wall_s"] <= 100.0


def test_a_landscape_says_whether_its_repeats_tell_its_best_from_the_runner_up():
    """The replay takes each repeated config's mean as exact: the page says how far the
    landscape's own figures separate its best from the next, and names a landscape whose
    median pick is that runner-up where they do not (p 0.05 or more)."""
    import render

    apart = {"repeats": [{"config": {"b": 1}, "samples_per_sec": [100.0, 101.0, 99.0]},
                         {"config": {"b": 2}, "samples_per_sec": [90.0, 91.0, 89.0]},
                         {"config": {"b": 3}, "samples_per_sec": [50.0, None]}]}  # one figure: not repeated
    close = {"repeats": [{"config": {"b": 1}, "samples_per_sec": [100.0, 120.0, 80.0]},
                         {"config": {"b": 2}, "samples_per_sec": [90.0, 110.0, 70.0]}]}
    a, c = sr.runner_up(apart), sr.runner_up(close)
    assert a["ratio"] == c["ratio"] == 0.9 and a["figures"] == [3, 3]
    assert a["p"] < 0.001 and c["p"] > 0.5
    assert sr.runner_up({"repeats": apart["repeats"][:1]}) is None
    assert sr.runner_up({"repeats": [{"config": {}, "samples_per_sec": [5.0, 5.0]},
                                     {"config": {}, "samples_per_sec": [4.0, 4.0]}]})["p"] == 0.0

    info = {"configs": 1, "repeat_cv": 0.0, "hardware": {"cpu": "x", "cpu_count": 2}, "measured": "now"}
    data = {"budgets": [12], "seeds": 1, "gp_seeds": 1, "results": {}, "landscapes": {}}
    for name, second, median in (("apart", a, 0.9), ("close", c, 0.9), ("elsewhere", c, 0.8), ("above", c, 1.0)):
        data["landscapes"][name] = {**info, "runner_up": second}
        data["results"][name] = {s: {"12": {"median": median, "p10": median}} for s in ("tuner", "oracle")}
    text = "\n".join(render._search_replay(data))
    assert f"do not tell from its best (Welch's t-test, p 0.05 or more): close (p {c['p']:.2f})." in text
    assert "runner-up 0.900 of the best, Welch p 0.00 over their 3 and 3 figures" in text


def test_a_replay_of_every_landscape_is_named_as_such_and_one_of_a_few_by_their_names():
    """The page says which landscapes an addition replayed: "Every landscape (N)" and the
    command without the names where it replayed all of them (a rule's change replays them
    all: fifty names say nothing), the names where it replayed a few."""
    import render

    info = {"configs": 1, "repeat_cv": 0.0, "hardware": {"cpu": "x", "cpu_count": 2}, "measured": "now"}
    data = {"budgets": [12], "seeds": 1, "gp_seeds": 1, "results": {}, "landscapes": {}, "added": []}
    for name in ("a", "b", "c"):
        data["landscapes"][name] = info
        data["results"][name] = {s: {"12": {"median": 1.0, "p10": 1.0}} for s in ("tuner", "oracle")}
    for names in (["a", "b", "c"], ["b"]):
        data["added"].append({"landscapes": names, "date": "now", "rules_at": "abc", "strategies": ["tuner"],
                              "command": f"python benchmarks/search_replay.py --add --strategies tuner "
                                         f"--landscapes {' '.join(names)} --jobs 2"})
    text = "\n".join(render._search_replay(data))
    assert "Every landscape (3): replayed now with the rules of commit abc (tuner; the other strategies' rows " \
           "stand) (`python benchmarks/search_replay.py --add --strategies tuner --landscapes <every one> " \
           "--jobs 2`)" in text
    assert "\nb: replayed now" in text and "--landscapes b --jobs 2" in text
    assert "a, b, c: replayed" not in text


def test_a_figure_fitted_on_its_batches_lengths_is_replayed_at_its_repeats_spread_not_its_windows():
    """Batches grouped by length make a trial's windows read many-fold apart by design, and
    its figure is fitted on the batches' lengths, not their windows' average: replayed from
    its windows drawn again, such a config read whichever draw came, and a search lost a
    winner it would not lose live. A recorded ``steady_from`` of "batch lengths" replays
    the figure at the config's rate, spread as the repeats spread; any other keeps its
    windows' draws."""
    import copy
    import statistics

    from tuner.policy import Phase, Task

    landscape, space, ctx = sr._load("lstm")
    canon, ss = Canonical(space, ctx), SearchSpace(space, ctx)
    apart = [178.0, 335.0, 392.0, 283.0, 270.0, 448.0, 88.0, 427.0, 403.0, 284.0, 55.0, 415.0]

    def figures(steady_from):
        scape = copy.deepcopy(landscape)
        row = next(g for g in scape["grid"] if g["samples_per_sec"])
        row.update(windows=apart, steady_from=steady_from)
        out = []
        for seed in range(40):
            machine = sr.Machine(scape, canon, ss, seed, sr.measure_settings(space))
            config = ss.active(row["config"])
            rate = machine.rate[canon(config)]
            r = machine.measure(Task(1, Phase.SEARCH, config))
            out.append(r["samples_per_sec"] / rate)
        return out, machine.cv

    fitted, cv = figures("batch lengths")
    drawn, _ = figures("steady windows")
    assert statistics.stdev(fitted) < 2 * cv
    assert statistics.stdev(drawn) > 3 * statistics.stdev(fitted)


def test_a_config_measured_as_three_trials_is_replayed_at_their_spread_not_its_windows():
    """A config's windows can hold stalls that its trial's figure sets apart (epoch
    boundaries, a host's neighbours): windows 84-206 samples/s whose three trials read
    143, 144 and 143. Drawn again from those windows, the best config read anywhere in
    +-17% and lost the confirm rounds to a config 6% slower. Where a config was repeated,
    its figure is drawn at the repeats' spread; a config that was not keeps its windows'
    draws."""
    import copy
    import statistics

    from tuner.policy import Phase, Task

    landscape, space, ctx = sr._load("lstm")
    canon, ss = Canonical(space, ctx), SearchSpace(space, ctx)
    stalls = [112.0, 143.0, 142.0, 206.0, 84.0, 146.0, 148.0, 139.0, 187.0, 85.0, 134.0, 138.0]

    def figures(repeated):
        scape = copy.deepcopy(landscape)
        row = next(g for g in scape["grid"] if g["samples_per_sec"] and not g.get("steady_from"))
        row["windows"] = stalls
        same = [r for r in scape["repeats"] if canon(ss.active(r["config"])) == canon(ss.active(row["config"]))]
        for r in same:
            scape["repeats"].remove(r)
        if repeated:
            scape["repeats"].append({"config": row["config"], "samples_per_sec": [row["samples_per_sec"]] * 3})
        config = ss.active(row["config"])
        out = []
        for seed in range(40):
            machine = sr.Machine(scape, canon, ss, seed, sr.measure_settings(space))
            r = machine.measure(Task(1, Phase.SEARCH, config))
            out.append(r["samples_per_sec"] / machine.rate[canon(config)])
        return out, machine.cv

    repeated, cv = figures(True)
    drawn, _ = figures(False)
    assert statistics.stdev(repeated) < 2 * cv
    assert statistics.stdev(drawn) > 3 * statistics.stdev(repeated)


def test_a_trace_tells_each_measurement_of_the_search_the_replay_judges_and_refuses_a_held_out_landscape():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    landscape, space, ctx = sr._load("lstm")
    judged = sr.replay(landscape, space, ctx, "tuner", 3, 8)
    lines = sr.trace("lstm", 3, 8)
    # the same search as the replay's: a line for each of its measurements, then its pick
    assert lines[0].startswith(f"lstm, seed 3, 8 configs: {judged['measurements']} measurements")
    told = lines[1:-2]
    assert len(told) == judged["measurements"]
    assert told[0].split()[0] == "baseline" and {x.split()[0] for x in told} <= {"baseline", "search", "confirm"}
    assert lines[-2] == f"pick: {judged['pick']:.3f} of the best, " + lines[-2].split(" of the best, ")[1]
    assert lines[-1].startswith("best: ") and "ended: " in lines[-1]
    held_out = next(n for n in sorted(p.stem for p in sr.LANDSCAPES.glob("*.json")) if sr._load(n)[0].get("held_out"))
    with pytest.raises(SystemExit, match="held out"):
        sr.trace(held_out, 0, 8)
