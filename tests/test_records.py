"""Results files read defensively, and the one-writer lock (tuner/records.py), on real files."""

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tuner.errors import UserError
from tuner.records import read_json, read_trials, writer_lock


def _rec(i):
    return json.dumps({"phase": "search", "config": {"micro_batch_size": 8 * (i + 1)}, "status": "ok",
                       "samples_per_sec": 100.0 + i})


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path):
    p = tmp_path / "trials.jsonl"
    p.write_text(_rec(0) + "\n" + _rec(1) + "\n" + _rec(2)[:20])  # a kill mid-write
    warn = io.StringIO()
    records = read_trials(p, warn=warn)
    assert [r["samples_per_sec"] for r in records] == [100.0, 101.0]
    assert f"{p}:3" in warn.getvalue() and "torn last line" in warn.getvalue()


@pytest.mark.parametrize("bad", ["{not json", "{}", "[1, 2]", '{"config": 3}'])
def test_a_malformed_middle_line_is_an_error_naming_it(tmp_path, bad):
    p = tmp_path / "trials.jsonl"
    p.write_text(_rec(0) + "\n" + bad + "\n" + _rec(1) + "\n")
    with pytest.raises(UserError, match=f"{p}:2: "):
        read_trials(p)


def test_truncated_or_foreign_json_is_one_line(tmp_path):
    p = tmp_path / "summary.json"
    p.write_text('{"name": "x", "best": {"config"')
    with pytest.raises(UserError, match="summary.json:1: not valid JSON"):
        read_json(p)
    p.write_text("[1, 2]")
    with pytest.raises(UserError, match="expected a JSON object, found list"):
        read_json(p)


def test_the_recorder_cuts_a_torn_tail_before_appending(tmp_path):
    from tuner.study import Recorder

    p = tmp_path / "trials.jsonl"
    p.write_text(_rec(0) + "\n" + _rec(1)[:15])
    rec = Recorder(p)
    assert len(rec.previous) == 1
    rec.add({"phase": "search", "config": {"micro_batch_size": 8}, "status": "ok", "samples_per_sec": 1.0})
    assert len(read_trials(p)) == 2  # no torn line left in the middle


_HOLD = """
import sys, time
from pathlib import Path
from tuner.records import writer_lock
with writer_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


def test_the_lock_names_a_live_holder_and_dies_with_a_killed_one(tmp_path):
    folder = tmp_path / "results" / "x"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"another search is writing here \\(pid {holder.pid} on "), \
                writer_lock(folder):
            pass
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # kill -9: nothing is left to clean up
        holder.wait()
    with writer_lock(folder):  # the lock died with its process
        assert (folder / ".lock.json").is_file()


def test_readers_work_while_a_search_holds_the_lock(tmp_path):
    from tuner.results import open_results

    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "space.yaml").write_text("name: r\nworkload: conv\n")
    (folder / "trials.jsonl").write_text(_rec(0) + "\n")
    with writer_lock(folder):
        res = open_results(folder)
        assert len(res.records) == 1
    time.sleep(0)  # nothing to wait for: readers take no lock


def test_a_journal_lock_left_by_a_killed_search_does_not_hold_up_the_next(tmp_path):
    """A kill during a journal write leaves Optuna's lock link behind; Optuna would wait
    30 s for it, warning every 10 s, at the resume's first write."""
    import optuna

    from tuner.study import JOURNAL, open_journal

    out = tmp_path / "out"
    out.mkdir()

    class Progress:
        def close(self) -> None:
            pass

    with writer_lock(out):
        optuna.create_study(storage=open_journal(out, Progress()), study_name="j")
    (out / f"{JOURNAL}.lock").symlink_to(out / JOURNAL)  # the lock as a killed writer left it
    t0 = time.monotonic()
    with writer_lock(out):
        optuna.load_study(study_name="j", storage=open_journal(out, Progress())).ask()  # a write
    assert time.monotonic() - t0 < 5
    assert not (out / f"{JOURNAL}.lock").is_symlink()


def test_a_rate_and_its_data_wait_are_the_pipeline_s_two_stages():
    """The step's rate is the figure with the wait taken out; one loading process's rate
    is seen only where the loading showed: without workers, the figure over the wait's
    share; with workers, a worker's share (no more of them loading at once than cores)."""
    from tuner.records import stage_rates

    assert stage_rates(75.0, 0.25, 0) == (pytest.approx(100.0), pytest.approx(300.0))
    assert stage_rates(120.0, 0.3, 2) == (pytest.approx(120 / 0.7), pytest.approx(60.0))
    assert stage_rates(200.0, 0.01, 4) == (pytest.approx(200 / 0.99), None)  # the loader kept up
    assert stage_rates(64.0, 0.5, 32, cores=16)[1] == pytest.approx(4.0)
    assert stage_rates(50.0, 1.0, 0) == (None, pytest.approx(50.0))  # nothing but waiting


def test_a_trial_s_record_reads_its_loading_as_the_search_s_model_does():
    """More workers than cores: the record's per-worker loading rate and the sampler's
    model of the pipeline divide by the cores alike (the record is what `diagnose` reads)."""
    import os
    from types import SimpleNamespace

    from tuner.measure import _stage_rates
    from tuner.sampler import pipeline

    workers = 4 * (os.cpu_count() or 1)
    trainer = SimpleNamespace(loader=SimpleNamespace(num_workers=workers))
    record = _stage_rates(trainer, 120.0, 0.5)
    model = pipeline([({"num_workers": workers}, {"samples_per_sec": 120.0, "data_wait_fraction": 0.5})],
                     os.cpu_count())
    assert record["load_samples_per_sec_per_process"] == pytest.approx(120.0 / (os.cpu_count() or 1))
    assert list(model.worker.values()) == [pytest.approx(record["load_samples_per_sec_per_process"])]


def test_a_row_s_other_figures_come_from_the_measurements_its_objective_does():
    from tuner.records import aggregate

    config = {"micro_batch_size": 32}
    search = {"phase": "search", "key": "k", "config": config, "status": "ok", "samples_per_sec": 130.0,
              "samples_per_joule": 1.30, "peak_host_memory_mb": 500.0}  # the lucky draw that made a contender
    confirm = [{**search, "phase": "confirm", "confirm_round": n, "samples_per_sec": v, "samples_per_joule": v / 100,
                "peak_host_memory_mb": 510.0} for n, v in ((1, 100.0), (2, 104.0))]
    row, = aggregate([search, *confirm], "samples_per_joule")
    assert row["samples_per_joule"] == pytest.approx(1.02) and row["samples_per_sec"] == pytest.approx(102.0)
    assert row["peak_host_memory_mb"] == 510.0 and row["measurements"] == 3
    # without confirm rounds, every measurement counts
    row, = aggregate([search, {**search, "samples_per_sec": 110.0}], "samples_per_joule")
    assert row["samples_per_sec"] == pytest.approx(120.0)


def test_memory_that_grew_in_one_of_a_config_s_measurements_is_its_row_s_and_the_summary_says_so():
    """A leak read steadily in one measurement (another held fewer windows) is the
    config's: its row keeps that measurement's growth, and the run's summary names it as
    a note on the pick, from the row's figures (``diagnose``)."""
    from tuner.records import aggregate
    from tuner.tables import print_summary

    config = {"micro_batch_size": 32}
    flat = {"phase": "search", "key": "k", "config": config, "status": "ok", "samples_per_sec": 100.0,
            "host_memory_growth_mb": 3.0, "host_memory_growth_steps": 20, "host_memory_grew_steadily": False}
    grew = {**flat, "phase": "confirm", "host_memory_growth_mb": 90.0, "host_memory_growth_steps": 60,
            "host_memory_grew_steadily": True}
    row, = aggregate([flat, grew], "samples_per_sec")
    assert (row["host_memory_growth_mb"], row["host_memory_growth_steps"], row["host_memory_grew_steadily"]) == \
        (90.0, 60, True)
    assert "workers_memory_growth_mb" not in row  # not read: no workers
    row, = aggregate([flat], "samples_per_sec")
    assert row["host_memory_growth_mb"] == 3.0 and not row["host_memory_grew_steadily"]
    top = [{**row, "spread": None, "memory_mb": None}]
    for best, says in (({**top[0], "host_memory_grew_steadily": True}, True), (top[0], False)):
        out = io.StringIO()
        print_summary({"name": "s", "trials": 1, "measurements": 1, "search_wall_s": 10.0,
                       "objective": {"metric": "samples_per_sec"}, "baseline": {**flat, "measurements": 1},
                       "top": top, "best": best, "infeasible": [], "verdict": None, "overhead_ratio": None}, out)
        noted = [line for line in out.getvalue().splitlines() if line.startswith("note on the pick: ")]
        assert bool(noted) == says and all("resident memory grew through the timed windows, 3 MB over 20 steps"
                                           in line for line in noted), noted


def test_a_config_held_back_unrun_is_a_row_of_no_measurement_not_an_infeasible_one():
    """A compiled config held back under a GPU time budget (its eager twin runs in its place)
    is shown as not run, with nothing measured; one skipped because it would hang as a
    measured one did stays infeasible; once a held config is measured, it is an ordinary row."""
    from tuner.records import aggregate

    held = {"phase": "search", "key": "held", "config": {"compile": "default"}, "status": "infeasible",
            "error_kind": "held", "skipped": True, "samples_per_sec": None, "reason": "not run in the search"}
    hang = {**held, "key": "hang", "error_kind": "timeout", "reason": "would hang"}
    rows = {r["key"]: r for r in aggregate([held, hang], "samples_per_sec")}
    assert rows["held"]["held"] and rows["held"]["measurements"] == 0 and not rows["held"]["feasible"]
    assert not rows["hang"]["held"] and rows["hang"]["measurements"] == 0
    measured = {**held, "status": "ok", "error_kind": None, "skipped": False, "samples_per_sec": 100.0,
                "phase": "search"}
    row, = aggregate([held, measured], "samples_per_sec")
    assert row["feasible"] and not row["held"] and row["measurements"] == 1


def test_a_row_and_the_baseline_keep_the_load_beside_their_windows_for_the_spread_note():
    """`show` diagnoses a config from its row, not from one record: the row keeps the load
    beside its measurements' windows (the median), so that a wide spread on a quiet
    machine is called the workload's own pace, not another process's doing."""
    from tuner.diagnose import diagnose
    from tuner.records import aggregate, baseline_of

    hw = {"cpu_count": 2}
    quiet = [{"phase": "search", "key": "a", "config": {}, "status": "ok", "samples_per_sec": v,
              "samples_per_sec_spread": 0.4, "interference_cores": 0.02, "hardware": hw} for v in (100.0, 110.0)]
    row, = aggregate(quiet, "samples_per_sec")
    assert row["interference_cores"] == 0.02
    note = next(f for f in diagnose(row).flags if "spread" in f)
    assert "workload's own pace" in note and "another process" not in note
    busy = [{**r, "interference_cores": 1.5} for r in quiet]
    note = next(f for f in diagnose(aggregate(busy, "samples_per_sec")[0]).flags if "spread" in f)
    assert "other processes used 1.5 of 2 cores" in note
    base = baseline_of([{**r, "phase": "baseline"} for r in quiet], "samples_per_sec")
    assert base["measurements"] == 2 and base["interference_cores"] == 0.02


def test_the_noise_between_repeats_is_pooled_over_configs_and_parts_the_race():
    import math

    from tuner.records import aggregate, rank, repeat_noise, still_racing

    def rec(batch, value, phase="search", **more):
        return {"phase": phase, "status": "ok", "key": str(batch), "config": {"micro_batch_size": batch},
                "samples_per_sec": value, "samples_per_sec_error": 0.01, **more}

    records = [rec(8, 50.0, "baseline"), rec(8, 80.0, "baseline", confirm_round=1),  # never noise
               rec(16, 100.0), rec(32, 96.0), rec(64, 90.0), rec(128, 300.0, screened=True),
               rec(16, 100.0, "confirm", confirm_round=1), rec(32, 96.0, "confirm", confirm_round=1),
               rec(64, 90.0, "confirm", confirm_round=1), rec(128, 10.0, "recheck", disturbed=True)]
    assert repeat_noise(records[:6], "samples_per_sec") is None  # no config measured twice
    assert repeat_noise(records, "samples_per_sec") == pytest.approx(0.0)
    ranked = rank(aggregate(records, "samples_per_sec"), "samples_per_sec")
    # figures that agree: held to the least noise (2%), 4% and 10% behind are out
    assert [r["config"]["micro_batch_size"] for r in still_racing(ranked, records, "samples_per_sec")] == [16]
    # where two figures of one config (an incumbent and its recheck) lie 25% apart, the
    # same gaps are within the noise
    noisy = records + [rec(256, 50.0), rec(256, 62.5, "recheck")]
    assert repeat_noise(noisy, "samples_per_sec") == pytest.approx(math.log(1.25) / math.sqrt(2 * 4))
    ranked = rank(aggregate(noisy, "samples_per_sec"), "samples_per_sec")
    assert [r["config"]["micro_batch_size"] for r in still_racing(ranked, noisy, "samples_per_sec")] == [16, 32, 64]
    # a minimized objective races the other way
    times = [{**r, "projected_run_s": 1000.0 / r["samples_per_sec"]} for r in noisy]
    ranked = rank(aggregate(times, "projected_run_s"), "projected_run_s")
    assert ranked[0]["config"]["micro_batch_size"] == 16
    assert len(still_racing(ranked, times, "projected_run_s")) == 3
    assert math.isclose(repeat_noise(times, "projected_run_s"), repeat_noise(noisy, "samples_per_sec"))


def test_a_row_s_speed_up_is_against_the_baseline_measured_beside_it_when_the_machine_drifts():
    """The machine slows by a quarter between the search and the confirm rounds. A config
    that is the baseline in all but name, measured in the search, reads about 1.00x (the
    baseline at its time, between the baseline's measurements before and after), not the
    1.33x a comparison with the confirm rounds' baseline would give; a config in the
    confirm rounds is compared with the baseline measured interleaved with it."""
    from tuner.diagnose import Diagnosis
    from tuner.records import aggregate, baseline_at, baseline_drift, row_speedup
    from tuner.tables import drift_line

    def rec(key, value, start, phase="search", rnd=None):
        return {"phase": phase, "key": key, "config": {"micro_batch_size": 32, "k": key}, "status": "ok",
                "samples_per_sec": value, "started_at": start, "ended_at": start + 10, "confirm_round": rnd}

    records = [rec("b", 200.0, 0, "baseline"), rec("same", 200.0, 10), rec("fast", 330.0, 20),
               rec("fast", 300.0, 100, "confirm", 1), rec("b", 150.0, 110, "baseline", 1),
               rec("fast", 300.0, 120, "confirm", 2), rec("b", 150.0, 130, "baseline", 2)]
    rows = {r["key"]: r for r in aggregate(records, "samples_per_sec")}
    at = baseline_at(records, "samples_per_sec", 15)
    assert at == pytest.approx(200 - 50 * 10 / 110)
    assert row_speedup(rows["same"], records, "samples_per_sec") == pytest.approx(200 / at)
    assert row_speedup(rows["fast"], records, "samples_per_sec") == pytest.approx(2.0)
    drift = baseline_drift(records, "samples_per_sec")
    assert drift == {"before": 200.0, "rounds": [150.0, 150.0]} and "-25%" in drift_line(drift, "samples_per_sec")
    # a small move, or one within the rounds' own spread, is noise: no line
    assert drift_line({"before": 200.0, "rounds": [188.0]}, "samples_per_sec") is None
    assert drift_line({"before": 183.0, "rounds": [177.0, 210.0]}, "samples_per_sec") is None
    # records without times (an old folder): the baseline's pooled figure, as before
    timeless = [{k: v for k, v in r.items() if not k.endswith("_at")} for r in records]
    rows_t = {r["key"]: r for r in aggregate(timeless, "samples_per_sec")}
    assert row_speedup(rows_t["same"], timeless, "samples_per_sec") == pytest.approx(200 / 150)
    # the best config's diagnosis compares a measured alternative on the same footing
    for r in rows.values():
        r["feasible"], r["speedup"] = True, row_speedup(r, records, "samples_per_sec")
    d = Diagnosis("compute-bound", "", ["try k=same"], [], [], {"try k=same": {"k": "same"}})
    line, = d.against(rows["fast"], list(rows.values()), "samples_per_sec").measured
    assert f"({rows['same']['speedup'] / 2.0:.2f}x the best)" in line
