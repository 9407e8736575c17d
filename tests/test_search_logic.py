"""The search's plain parts: resources, aggregation, Pareto (no Ray)."""


import pytest

from tuner import spec
from tuner.records import aggregate, pareto_front, rank
from tuner.search import plan_resources


def _space(tmp_path, text):
    p = tmp_path / "space.yaml"
    p.write_text(text)
    return spec.load(p)


def test_plan_resources_and_aggregation(tmp_path):
    space = _space(tmp_path, "name: t\nworkload: conv\nknobs:\n  num_workers: [0, 3]\n")
    device, cpus, gpus, concurrent = plan_resources(space, {"max_node_cpus": 8, "gpus": 4, "nodes": 1})
    assert (device, gpus, concurrent) == ("cuda", 1, 4)
    assert cpus({"num_workers": 0}) == 1 and cpus({"num_workers": 3}) == 4
    device, cpus, gpus, concurrent = plan_resources(space, {"max_node_cpus": 2, "gpus": 0, "nodes": 1})
    assert (device, gpus, concurrent) == ("cpu", 0, 1) and cpus({"num_workers": 0}) == 2
    recs = [
        {"phase": "search", "key": "a", "config": {"x": 1}, "status": "ok", "samples_per_sec": 100.0,
         "peak_host_memory_mb": 50.0},
        {"phase": "confirm", "key": "a", "config": {"x": 1}, "status": "ok", "samples_per_sec": 90.0,
         "peak_host_memory_mb": 52.0},
        {"phase": "search", "key": "b", "config": {"x": 2}, "status": "ok", "samples_per_sec": 95.0,
         "peak_host_memory_mb": 10.0},
        {"phase": "search", "key": "c", "config": {"x": 3}, "status": "infeasible", "reason": "oom"},
    ]
    rows = aggregate(recs, "samples_per_sec")
    ranked = rank(rows, "samples_per_sec")
    assert [r["key"] for r in ranked] == ["a", "b"] and ranked[0]["samples_per_sec"] == 95.0
    assert ranked[0]["spread"] == pytest.approx(10 / 95)
    front = pareto_front(rows, "samples_per_sec")
    assert [r["key"] for r in front] == ["b"]  # b: as fast as a's median? no: 95 vs 95, less memory
    # a screened figure (its first windows) or a disturbed one pushes no config measured in
    # full off the front, and is not exported for a memory limit either
    for mark in ("screened", "disturbed"):
        partial = {"phase": "search", "key": "d", "config": {"x": 4}, "status": "ok", "samples_per_sec": 120.0,
                   "peak_host_memory_mb": 5.0, mark: True}
        rows = aggregate([*recs, partial], "samples_per_sec")
        assert [r["key"] for r in pareto_front(rows, "samples_per_sec")] == ["b"], mark


def test_disturbed_measurements_never_pick_the_winner():
    from tuner.records import baseline_of, best_of

    recs = [
        # the fastest figure, but measured only while the machine was disturbed
        {"phase": "search", "key": "a", "config": {"x": 1}, "status": "ok", "samples_per_sec": 200.0,
         "disturbed": True},
        {"phase": "confirm", "key": "a", "config": {"x": 1}, "status": "ok", "samples_per_sec": 190.0,
         "disturbed": True},
        {"phase": "search", "key": "b", "config": {"x": 2}, "status": "ok", "samples_per_sec": 100.0},
        # c: one quiet and one disturbed measurement: only the quiet one counts
        {"phase": "search", "key": "c", "config": {"x": 3}, "status": "ok", "samples_per_sec": 120.0},
        {"phase": "confirm", "key": "c", "config": {"x": 3}, "status": "ok", "samples_per_sec": 40.0,
         "disturbed": True},
    ]
    rows = {r["key"]: r for r in aggregate(recs, "samples_per_sec")}
    assert rows["a"]["disturbed"] and not rows["c"]["disturbed"]
    assert rows["c"]["samples_per_sec"] == 120.0
    ranked = rank(list(rows.values()), "samples_per_sec")
    assert [r["key"] for r in ranked] == ["c", "b", "a"]  # disturbed last, whatever its figure
    assert best_of(ranked)["key"] == "c"
    assert best_of([rows["a"]]) is None

    bases = [{"phase": "baseline", "config": {}, "status": "ok", "samples_per_sec": 100.0},
             {"phase": "baseline", "config": {}, "status": "ok", "samples_per_sec": 110.0},
             {"phase": "baseline", "config": {}, "status": "ok", "samples_per_sec": 10.0, "disturbed": True}]
    base = baseline_of(bases + recs, "samples_per_sec")
    assert base["samples_per_sec"] == pytest.approx(105.0) and base["measurements"] == 3


def test_a_config_screened_then_measured_again_in_full_does_not_beat_the_confirm_rounds():
    """A screened config measured again in full holds two measurements but one full figure,
    a search figure like the one that made the confirmed configs contenders. Once their
    confirm figures fall back, it would read best on that one figure: the pick is the best
    of the configs the confirm rounds measured. (A live search picked such a config.)"""
    from tuner.records import best_of

    recs = [
        {"phase": "search", "key": "a", "config": {"x": 1}, "status": "ok", "samples_per_sec": 120.0},
        {"phase": "confirm", "key": "a", "config": {"x": 1}, "status": "ok", "samples_per_sec": 90.0, "confirm_round": 1},
        {"phase": "confirm", "key": "a", "config": {"x": 1}, "status": "ok", "samples_per_sec": 92.0, "confirm_round": 2},
        {"phase": "search", "key": "b", "config": {"x": 2}, "status": "ok", "samples_per_sec": 80.0, "screened": True},
        {"phase": "search", "key": "b", "config": {"x": 2}, "status": "ok", "samples_per_sec": 95.0},
    ]
    ranked = rank(aggregate(recs, "samples_per_sec"), "samples_per_sec")
    assert [(r["key"], r["measurements"], r["samples_per_sec"]) for r in ranked] == [("b", 2, 95.0), ("a", 3, 91.0)]
    assert best_of(ranked)["key"] == "a"
    # with no confirm rounds, a config measured more than once is the pick, as before
    assert best_of(rank(aggregate([r for r in recs if not r.get("confirm_round")], "samples_per_sec"),
                        "samples_per_sec"))["key"] == "b"
    # and the table says why the row above the pick is not it
    from tuner.tables import unconfirmed

    assert "not in the confirm rounds" in unconfirmed(ranked[0], ranked[1], "samples_per_sec")


def test_screened_rows_never_win_and_confirm_takes_only_rows_within_noise():
    from tuner.records import best_of, with_cold_compile, within_noise

    recs = [
        {"phase": "search", "key": "a", "config": {"x": 1}, "status": "ok", "samples_per_sec": 100.0,
         "samples_per_sec_error": 0.01},
        {"phase": "search", "key": "b", "config": {"x": 2}, "status": "ok", "samples_per_sec": 97.0,
         "samples_per_sec_error": 0.01},
        {"phase": "search", "key": "c", "config": {"x": 3}, "status": "ok", "samples_per_sec": 60.0,
         "samples_per_sec_error": 0.01},
        # a screening figure above everyone's: it never wins, and is not a contender
        {"phase": "search", "key": "d", "config": {"x": 4}, "status": "ok", "samples_per_sec": 150.0,
         "screened": True},
    ]
    ranked = rank(aggregate(recs, "samples_per_sec"), "samples_per_sec")
    assert [r["key"] for r in ranked] == ["a", "b", "c", "d"] and ranked[-1]["screened"]
    assert best_of(ranked)["key"] == "a"
    # b is within noise of a (3% apart, 12% allowed); c is 40% behind
    assert [r["key"] for r in within_noise(ranked, "samples_per_sec")] == ["a", "b"]

    cold = with_cold_compile({"compile_cache": "cold", "compile_s": 16.0, "projected_run_s": 100.0}, None)
    assert cold["compile_s_cold"] == 16.0 and cold["projected_run_s"] == 100.0
    warm = with_cold_compile({"compile_cache": "warm", "compile_s": 4.0, "projected_run_s": 88.0}, 16.0)
    assert warm["compile_s_cold"] == 16.0 and warm["projected_run_s"] == 100.0  # the cold cost is kept


def _full(value, config, error=0.01):
    return {"phase": "search", "status": "ok", "samples_per_sec": value, "samples_per_sec_error": error,
            "config": config}


def test_after_screened_trials_in_a_row_the_incumbent_is_measured_again():
    from tuner.policy import Board

    board = Board(recheck_after=2)
    assert board.screen() is None  # nothing measured yet
    board.update(_full(220.0, {"x": 1}))
    # 10% at least (drift between trials), and twice the incumbent's own error on top:
    # it is the highest of several noisy figures, so likely one read high
    assert board.screen() == {"below": 220.0, "margin": pytest.approx(0.12)}
    # the machine slowed: two configs screened out against 220 in a row
    for value in (150.0, 148.0):
        board.update({**_full(value, {"x": 2}), "screened": True})
    assert board.recheck_due() and board.screen()["below"] == 220.0
    assert board.take_recheck() == {"x": 1}
    assert not board.recheck_due()  # asked once per run of screened trials
    # a disturbed re-measurement changes nothing; a quiet one is the threshold now
    board.update({**_full(60.0, {"x": 1}), "phase": "recheck", "disturbed": True})
    assert board.screen()["below"] == 220.0
    board.update({**_full(152.0, {"x": 1}), "phase": "recheck"})
    assert board.screen()["below"] == 152.0
    # a full measurement above it is the incumbent; one that is not screened breaks the run
    board.update(_full(160.0, {"x": 3}))
    board.update({**_full(100.0, {"x": 4}), "screened": True})
    board.update(_full(155.0, {"x": 5}))
    board.update({**_full(100.0, {"x": 6}), "screened": True})
    assert board.screen()["below"] == 160.0 and not board.recheck_due()
    board.update({**_full(100.0, {"x": 7}), "screened": True})
    assert board.recheck_due() and board.take_recheck() == {"x": 3}
    noisy = Board()
    noisy.update(_full(100.0, {"x": 1}, error=0.01))
    noisy.update(_full(120.0, {"x": 2}, error=0.06))  # the incumbent now, read on noisy windows
    assert noisy.screen()["margin"] == pytest.approx(3 * 0.035 + 2 * 0.06)  # 3x the median error: over 10%
    never = Board(recheck_after=0)
    never.update(_full(220.0, {"x": 1}))
    for _ in range(5):
        never.update({**_full(100.0, {"x": 2}), "screened": True})
    assert not never.recheck_due()


def test_a_leader_whose_repeats_disagree_has_not_beaten_the_rows_behind_it():
    from tuner.records import within_noise

    recs = [
        # measured fast, then 30% slower once the machine drifted
        _full(221.0, {"x": 1}) | {"key": "a"},
        _full(150.0, {"x": 1}) | {"key": "a", "phase": "recheck"},
        _full(150.0, {"x": 2}) | {"key": "b"},
        _full(100.0, {"x": 3}) | {"key": "c"},
    ]
    ranked = rank(aggregate(recs, "samples_per_sec"), "samples_per_sec")
    assert [r["key"] for r in ranked] == ["a", "b", "c"]
    assert ranked[0]["measurements"] == 2 and ranked[0]["error"] == pytest.approx(71 / (2 * 185.5))
    # within noise of a's pooled 185.5 (its own figures 38% apart), where a single
    # figure of a's with a 1% error would have put b 19% behind, out of the confirm rounds
    assert [r["key"] for r in within_noise(ranked, "samples_per_sec")] == ["a", "b"]


def test_the_time_budget_keeps_room_for_the_confirm_round_as_its_contenders_measure():
    """Under a time budget the search stops starting trials that cannot end in it, and keeps
    room for the confirm round: its contenders (the top configs within noise of the
    leader) and the baseline measured again in full, each as long as its own full
    measurement took (contenders with workers to start read 9 s where a typical trial
    took 3), the next trial's config as long as a typical full trial; a config beaten
    beyond noise is no contender, and a screened trial's short wall sizes nothing. That is
    one round's room: a second round runs only if it fits."""
    from tuner.policy import Clock, median_wall

    clock = Clock(time_s=100.0, top=2, confirming=True)
    metric = "samples_per_sec"

    def rec(key, value, wall, phase="search", **more):
        return {"phase": phase, "status": "ok", "key": key, "config": {"micro_batch_size": key},
                "samples_per_sec": value, "samples_per_sec_error": 0.01, "trial_wall_s": wall, **more}

    recs = [rec(8, 100.0, 5.0, phase="baseline"), rec(16, 200.0, 9.0), rec(128, 120.0, 5.0)]
    # the leader's own 9 s and the baseline's 5 s (the 120 is 40% behind: no contender);
    # before the next trial, its config too, as long as a typical full trial (5 s)
    assert clock.reserve(recs, metric) == pytest.approx(9 + 5)
    assert clock.reserve(recs, metric, found_next=True) == pytest.approx(9 + 5 + 5)
    recs += [rec(32, 190.0, 3.0), rec(64, 400.0, 1.0, screened=True),
             {"phase": "search", "status": "infeasible", "key": 4, "config": {}, "trial_wall_s": 0.5}]
    assert clock.reserve(recs, metric) == pytest.approx(9 + 3 + 5)  # the screened 400 is no contender
    assert median_wall(recs) == 4.0  # what the next trial costs, screened ones included
    assert clock.left(0.0, recs, metric) == pytest.approx(100 - 17)
    # the search proper keeps time for one round; a second starts only if a round of the
    # contenders still in the race fits
    race = [{"config": {"micro_batch_size": 16}}, {"config": {"micro_batch_size": 32}}]
    assert clock.round_fits(80.0, recs, race) and not clock.round_fits(85.0, recs, race)
    assert clock.round_fits(85.0, recs, race[1:])  # 3 s and the baseline's 5 s
    assert median_wall([]) is None
    # the next trial: 100 - 17 of the reserve - 78 spent leaves 5 s, a typical trial's 4
    # fit; after screened trials in a row it first re-measures the leader (its own 9 s)
    assert clock.trial_fits(78.0, recs, metric)
    assert not clock.trial_fits(78.0, recs, metric, first={"micro_batch_size": 16})
    assert Clock(time_s=None, top=2, confirming=True).trial_fits(1e9, recs, metric)


def test_energy_per_sample_is_the_gpus_power_over_the_rate_and_a_cpu_search_cannot_optimize_it(tmp_path):
    from tuner.errors import UserError
    from tuner.measure import _energy

    rec = _energy({"gpu_power_w": 300.0, "samples_per_sec": 1500.0, "world_size": 2})
    assert rec["joules_per_sample"] == pytest.approx(0.4) and rec["samples_per_joule"] == pytest.approx(2.5)
    assert _energy({"gpu_power_w": None, "samples_per_sec": 100.0})["joules_per_sample"] is None
    space = _space(tmp_path, "name: t\nworkload: conv\nobjective: samples_per_joule\n")
    with pytest.raises(UserError, match="objective.metric: samples_per_joule .* CPUs"):
        plan_resources(space, {"max_node_cpus": 2, "gpus": 0, "nodes": 1})
    assert plan_resources(space, {"max_node_cpus": 8, "gpus": 1, "nodes": 1})[0] == "cuda"
