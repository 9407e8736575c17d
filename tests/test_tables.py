"""Terminal tables and the progress line (tuner/tables.py): one formatter, what each shows."""

import io

from tuner.tables import Progress, fmt, print_bench, print_summary


def test_one_formatter():
    assert fmt(None) == "-" and fmt(1234.5) == "1,234.5" and fmt(3.14159, " ms", 2) == "3.14 ms"
    assert fmt(512.4, " MB", 0) == "512 MB" and fmt(7) == "7" and fmt(True) == "True"


def test_bench_table_shows_the_figures_and_a_disturbed_warning():
    out = io.StringIO()
    print_bench({"status": "ok", "samples_per_sec": 101.5, "steady_samples_per_sec": 110.0,
                 "epoch_overhead_s": 0.25, "peak_host_memory_mb": 400.0, "disturbed": True,
                 "config": {"micro_batch_size": 8}, "data_wait_fraction": 0.5, "step_time_ms": 70.0}, out)
    text = out.getvalue()
    assert "101.5" in text and "0.250 s" in text and "400 MB" in text and "micro_batch_size=8" in text
    assert "disturbed over a third of the windows" in text
    assert "fitted" not in text
    out = io.StringIO()
    print_bench({"status": "ok", "samples_per_sec": 301.1, "steady_from": "batch lengths",
                 "config": {"micro_batch_size": 32, "group_by_length": True}}, out)
    assert "301.1 (fitted on the batches' lengths over a whole epoch's)" in out.getvalue()


def test_summary_prints_the_winner_first_and_the_verdict():
    out = io.StringIO()
    base = {"config": {"micro_batch_size": 32}, "samples_per_sec": 100.0, "status": "ok", "measurements": 2}
    top = [{"config": {"micro_batch_size": 64, "num_workers": 2}, "samples_per_sec": 150.0, "spread": 0.02,
            "measurements": 3, "memory_mb": 500.0},
           {"config": {"micro_batch_size": 32}, "samples_per_sec": 90.0, "spread": 0.05,
            "measurements": 1, "memory_mb": 300.0, "screened": True}]
    print_summary({"name": "s", "trials": 2, "measurements": 5, "search_wall_s": 60.0,
                   "objective": {"metric": "samples_per_sec"}, "baseline": base, "top": top,
                   "infeasible": [], "verdict": "a note", "overhead_ratio": None}, out)
    lines = out.getvalue().splitlines()
    first = next(line for line in lines if line.strip().startswith("1 "))
    assert "150.0" in first and "1.50x" in first and "num_workers=2" in first
    assert any("screened: never picked" in line for line in lines) and "NOTE: a note" in lines


def test_progress_line_counts_trials_and_the_best(capsys):
    p = Progress(total=4, metric="samples_per_sec", quiet=False)
    p.baseline, p.best = 100.0, 150.0  # the driver's: as the summary takes them
    p.update({"phase": "search", "status": "ok", "samples_per_sec": 150.0})
    p.update({"phase": "search", "status": "infeasible", "reason": "out of memory", "samples_per_sec": None})
    err = capsys.readouterr().err
    assert "[2/4]" in err and "best 150.0 samples_per_sec" in err and "(1.50x baseline)" in err
    assert "trial infeasible: out of memory" in err


def test_progress_in_a_log_prints_a_line_only_where_there_is_news(capsys):
    """Redirected (stderr not a terminal, as under pytest's capture or in a Ray job's log),
    a confirm round's record adds no line of its own: the next task's line says what runs;
    a baseline's record says its figure."""
    p = Progress(total=2, metric="samples_per_sec", quiet=False)
    assert not p.tty
    p.update({"phase": "baseline", "status": "ok", "samples_per_sec": 100.0})
    p.update({"phase": "search", "status": "ok", "samples_per_sec": 150.0})
    p.update(msg="confirm round 1: re-measuring a contender within noise of the leader, interleaved")
    p.update({"phase": "confirm", "status": "ok", "samples_per_sec": 149.0})
    p.update({"phase": "confirm", "status": "infeasible", "reason": "out of memory", "samples_per_sec": None})
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4, lines
    assert "baseline 100.0 samples_per_sec" in lines[0] and "[1/2]" in lines[1] and "confirm round 1" in lines[2]
    assert "trial infeasible: out of memory" in lines[3]


def test_progress_in_a_log_says_what_each_trial_read_and_its_config(capsys):
    """In a log each search trial's line says what it read (screened, disturbed) and the knobs it
    ran away from PyTorch's defaults, an infeasible one its reason and its knobs: the log
    tells what the search measured while it runs, not only the best so far."""
    p = Progress(total=3, metric="samples_per_sec", quiet=False)
    p.best = 150.0
    p.update({"phase": "search", "key": "a", "status": "ok", "samples_per_sec": 150.0,
              "config": {"micro_batch_size": 64, "precision": "bf16"}})
    p.update({"phase": "search", "key": "b", "status": "ok", "samples_per_sec": 90.0, "screened": True,
              "config": {"micro_batch_size": 32, "compile": "default"}})
    p.update({"phase": "search", "key": "c", "status": "infeasible", "reason": "out of memory",
              "samples_per_sec": None, "config": {"micro_batch_size": 512}})
    p.update({"phase": "search", "key": "d", "status": "ok", "samples_per_sec": 95.0, "disturbed": True,
              "config": {"num_workers": 2}})
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("last 150.0: micro_batch_size=64, precision=bf16"), lines[0]
    assert lines[1].endswith("last 90.0 (screened): compile=default"), lines[1]
    assert lines[2].endswith("trial infeasible: out of memory: micro_batch_size=512"), lines[2]
    assert lines[3].endswith("last 95.0 (disturbed): num_workers=2"), lines[3]


def test_a_row_at_pytorch_s_defaults_says_so():
    """A config at PyTorch's defaults in every knob (measured in the tuner's loop) is named,
    not left blank."""
    import io

    base = {"config": {"micro_batch_size": 32}, "samples_per_sec": 100.0, "status": "ok", "measurements": 3}
    top = [{"config": {"micro_batch_size": 32}, "samples_per_sec": 90.0, "spread": None, "measurements": 1,
            "memory_mb": None}]
    out = io.StringIO()
    print_summary({"name": "s", "trials": 1, "measurements": 4, "search_wall_s": 10.0,
                   "objective": {"metric": "samples_per_sec"}, "baseline": base, "top": top,
                   "infeasible": [], "verdict": None, "overhead_ratio": None}, out)
    row = next(line for line in out.getvalue().splitlines() if line.strip().startswith("1 "))
    assert row.rstrip().endswith("PyTorch defaults"), row


def test_the_summary_names_a_config_as_show_does_and_the_baseline_its_batch():
    """The summary's rows name the knobs away from PyTorch's defaults, as ``show`` does: a
    config at the baseline's batch of 16 says micro_batch_size=16 (it read as the default
    32 where the rows were named against the baseline's config, which its row did not
    show), and the baseline's row names its batch."""
    import io

    from tuner.tables import diff_from_default

    base = {"config": {"micro_batch_size": 16}, "samples_per_sec": 100.0, "status": "ok", "measurements": 3}
    config = {"micro_batch_size": 16, "precision": "bf16"}
    top = [{"config": config, "samples_per_sec": 120.0, "spread": None, "measurements": 1, "memory_mb": None}]
    out = io.StringIO()
    print_summary({"name": "s", "trials": 1, "measurements": 4, "search_wall_s": 10.0,
                   "objective": {"metric": "samples_per_sec"}, "baseline": base, "top": top,
                   "infeasible": [], "verdict": None, "overhead_ratio": None}, out)
    lines = out.getvalue().splitlines()
    row = next(line for line in lines if line.strip().startswith("1 "))
    assert row.rstrip().endswith(diff_from_default(config)) and "micro_batch_size=16" in row, row
    assert lines[-1].rstrip().endswith("baseline (plain PyTorch loop, micro_batch_size=16)"), lines[-1]
    out = io.StringIO()  # the pick's trial's notes follow the table
    print_summary({"name": "s", "trials": 1, "measurements": 4, "search_wall_s": 10.0,
                   "objective": {"metric": "samples_per_sec"}, "baseline": base, "top": top,
                   "best": {**top[0], "notes": ["set again"]}, "infeasible": [], "verdict": None,
                   "overhead_ratio": None}, out)
    assert "note on the pick: set again" in out.getvalue().splitlines()


def test_a_screened_config_measured_again_is_one_trial_of_the_budget(capsys):
    """``budget.trials`` counts configs: a screened config that the model sends to be
    measured again in full is one of them, in the progress line as in the policy (the
    line read 14/12 on a search of 12 configs)."""
    from tuner.records import configs_tried

    p = Progress(total=2, metric="samples_per_sec", quiet=False)
    records = [{"phase": "search", "key": "a", "status": "ok", "samples_per_sec": 90.0, "screened": True},
               {"phase": "search", "key": "b", "status": "ok", "samples_per_sec": 150.0},
               {"phase": "search", "key": "a", "status": "ok", "samples_per_sec": 140.0}]
    for r in records:
        p.update(r)
    assert capsys.readouterr().err.splitlines()[-1].startswith("[2/2]")
    skipped = {"phase": "search", "key": "c", "status": "infeasible", "skipped": True}
    assert configs_tried([*records, skipped, {"phase": "confirm", "key": "d"}]) == {"a", "b"}


def test_a_row_above_the_pick_on_one_measurement_says_why_it_is_not_the_pick():
    """Under a time budget the confirm round may hold the leader alone: a config that read
    higher once sits below the pick, and says why (the line was bare, and read as a bug)."""
    import io

    base = {"config": {"micro_batch_size": 32}, "samples_per_sec": 100.0, "status": "ok", "measurements": 2}
    pick = {"config": {"micro_batch_size": 64}, "samples_per_sec": 150.0, "spread": 0.1, "measurements": 2,
            "memory_mb": 1.0}
    once = {"config": {"micro_batch_size": 64, "compile": "default"}, "samples_per_sec": 166.0, "spread": None,
            "measurements": 1, "memory_mb": 1.0}
    below = {**once, "config": {"micro_batch_size": 16}, "samples_per_sec": 90.0}
    out = io.StringIO()
    print_summary({"name": "s", "trials": 3, "measurements": 6, "search_wall_s": 10.0,
                   "objective": {"metric": "samples_per_sec"}, "baseline": base, "top": [pick, once, below],
                   "infeasible": [], "verdict": None, "overhead_ratio": None}, out)
    rows = [line for line in out.getvalue().splitlines() if line.strip()[:1] in ("1", "2", "3")]
    assert "not confirmed" in rows[1] and "not confirmed" not in rows[0] + rows[2], rows


def test_the_summary_prints_each_row_s_own_speed_up_and_says_the_baseline_drifted():
    """Rows carry their speed-up against the baseline measured beside them
    (``records.row_speedup``): the summary prints it, not the row's figure over the
    baseline's pooled one, and says how far the baseline moved between the search and the
    confirm rounds."""
    import io

    base = {"config": {"micro_batch_size": 32}, "samples_per_sec": 150.0, "status": "ok", "measurements": 3}
    pick = {"config": {"precision": "bf16"}, "samples_per_sec": 300.0, "spread": 0.02, "measurements": 3,
            "memory_mb": 1.0, "speedup": 2.0}
    same = {"config": {"torch_threads": 2}, "samples_per_sec": 200.0, "spread": None, "measurements": 1,
            "memory_mb": 1.0, "speedup": 1.0}
    out = io.StringIO()
    print_summary({"name": "s", "trials": 2, "measurements": 6, "search_wall_s": 10.0,
                   "objective": {"metric": "samples_per_sec"}, "baseline": base, "top": [pick, same],
                   "baseline_drift": {"before": 200.0, "rounds": [150.0, 148.0, 152.0]}, "infeasible": [], "verdict": None, "overhead_ratio": None}, out)
    text = out.getvalue()
    rows = [line.split() for line in text.splitlines() if line.strip()[:1] in ("1", "2")]
    assert [r[4] for r in rows] == ["2.00x", "1.00x"], rows
    assert "baseline read 200.0 samples_per_sec before the confirm rounds and 150.0 in them (-25%)" in text
