"""The search policy driven by hand: records in, decisions out (no Ray, no processes)."""

import optuna
import pytest

from tests.helpers import pipeline_rate
from tuner import knobs, spec
from tuner.policy import Done, SearchPolicy, Task, Wait

CTX = knobs.Context(device="cpu", cpu_count=2)


def _space(**more):
    data = {"name": "t", "workload": "conv",
            "knobs": {"precision": ["fp32", "bf16"], "num_workers": [0, 1, 2], "micro_batch_size": [16, 32, 64]},
            "budget": {"trials": 6}}
    data.update(more)
    return spec.parse(data)


def _policy(space, records=(), sink=None):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return SearchPolicy(space, CTX, records=records, sink=sink)


def rate(config: dict) -> float:
    """bf16 and workers help, larger batches a little."""
    return (100.0 * (1.5 if config.get("precision") == "bf16" else 1.0) * (1 + 0.2 * (config.get("num_workers") or 0))
            * (1 + (config.get("micro_batch_size") or 32) / 640))


def _measure(task: Task, wall: float = 5.0, factor: float = 1.0) -> dict:
    value = rate(task.config) * factor
    screened = bool(task.screen and value * (1 + task.screen["margin"]) < task.screen["below"])
    return {"status": "ok", "config": dict(task.config), "samples_per_sec": value, "samples_per_sec_error": 0.01,
            "screened": screened, "trial_wall_s": wall}


def _run(policy, now=0.0, wall=5.0, until=None):
    """Drive ``policy`` one measurement at a time; the tasks it gave, in order."""
    tasks = []
    while True:
        decision = policy.next(now)
        if isinstance(decision, Done) or (until and until(tasks)):
            return tasks
        assert isinstance(decision, Task), decision
        tasks.append(decision)
        now += wall
        policy.on_result(decision, _measure(decision, wall))


def test_a_search_is_the_baseline_the_configs_the_confirm_rounds_and_the_pick():
    written = []
    policy = _policy(_space(), sink=written.append)
    tasks = _run(policy)
    phases = [str(t.phase) for t in tasks]
    assert phases[0] == "baseline" and phases.count("search") == 6
    # the first trials: PyTorch's defaults in the optimized loop, then the guides' advice
    first, second = [t.config for t in tasks if t.phase == "search"][:2]
    assert (first["precision"], first["num_workers"]) == ("fp32", 0)
    assert second["micro_batch_size"] == 64  # on a CPU the advice starts at the largest batch
    # the confirm rounds: contenders interleaved with the baseline, the baseline last
    rounds = [t for t in tasks if t.confirm_round]
    assert rounds and str(rounds[-1].phase) == "baseline"
    assert len({(t.config["precision"], t.config["num_workers"], t.config["micro_batch_size"])
                for t in tasks if t.phase == "search"}) == 6  # never a config twice
    # the sink got every record first, completed: phase, key, the threshold it was held to
    assert len(written) == len(tasks) == len(policy.records)
    assert all(r["key"] and r["phase"] for r in written)
    screened_against = [r for r in written if r["phase"] == "search" and r.get("screen")]
    assert screened_against and all(r["screen"]["below"] > 0 for r in screened_against)
    best = policy.pick().row
    assert best["config"]["precision"] == "bf16" and best["config"]["num_workers"] == 2
    assert best["measurements"] >= 2  # chosen on repeated figures
    assert isinstance(policy.next(1e6), Done)


def test_the_pick_reads_the_confirm_rounds_not_the_lucky_figure_that_made_a_contender():
    # mb 32 is 5% slower than mb 64, but its one search figure was a lucky draw (+15%):
    # enough to lead the search and, pooled with its confirm figure, to beat mb 64
    policy = _policy(_space(knobs={"micro_batch_size": [16, 32, 64]}, budget={"trials": 3},
                            confirm={"top": 3, "repeats": 1}))
    now, lucky = 0.0, []
    while not isinstance(task := policy.next(now), Done):
        factor = 1.15 if task.phase == "search" and task.config["micro_batch_size"] == 32 else 1.0
        lucky += [task.config["micro_batch_size"]] if factor > 1 else []
        now += 5.0
        policy.on_result(task, _measure(task, factor=factor))
    assert lucky == [32]
    confirmed = {r["config"]["micro_batch_size"] for r in policy.records
                 if r.get("confirm_round") and r["phase"] == "confirm"}
    assert confirmed == {32, 64}  # the lucky one led the search: both were measured again
    best = policy.pick().row
    assert best["config"]["micro_batch_size"] == 64
    assert best["samples_per_sec"] == pytest.approx(rate({"micro_batch_size": 64}))


@pytest.mark.parametrize(("second", "noise", "rounds"), [
    (99.0, 0.06, 4),  # 1% apart, figures 6% apart: measured again up to confirm.repeats
    (80.0, 0.01, 1),  # 20% apart, figures 1% apart: the first round settles it
    (90.0, 0.01, 1),  # 10% apart: within a fixed allowance of noise, beyond what the figures show
])
def test_the_confirm_rounds_race_the_contenders_until_the_noise_parts_them(second, noise, rounds):
    rates = {16: 100.0, 32: second, 64: 50.0}
    policy = _policy(_space(knobs={"micro_batch_size": [16, 32, 64]}, budget={"trials": 3},
                            confirm={"top": 2, "repeats": 4}))
    now, seen = 0.0, {}
    while not isinstance(task := policy.next(now), Done):
        batch = task.config["micro_batch_size"]
        n = seen[batch] = seen.get(batch, -1) + 1  # the noise alternates: the two cross each time
        sign = 1 if (n + (batch == 32)) % 2 == 0 else -1
        value = rates.get(batch, 40.0) * (1 + sign * noise if task.phase != "baseline" else 1)
        now += 5.0
        policy.on_result(task, {"status": "ok", "config": dict(task.config), "samples_per_sec": value,
                                "samples_per_sec_error": 0.01, "trial_wall_s": 5.0})
    confirmed = [r for r in policy.records if r["phase"] == "confirm"]
    assert max(r["confirm_round"] for r in confirmed) == rounds
    if rounds > 1:  # both raced to the end, the baseline measured beside them in every round
        assert len(confirmed) == 2 * rounds
        assert sum(1 for r in policy.records if r["phase"] == "baseline") == rounds + 1
    assert policy.pick().row["config"]["micro_batch_size"] == 16


def test_optuna_is_told_each_configs_figure_and_status():
    policy = _policy(_space())
    _run(policy)
    trials = policy.study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(trials) == 6
    for t in trials:
        assert t.user_attrs["status"] == "ok" and t.user_attrs["samples_per_sec"] == pytest.approx(t.value)


def test_a_search_never_tries_more_configs_than_the_space_runs():
    space = _space(knobs={"num_workers": [0, 1], "prefetch_factor": [2, 4]}, budget={"trials": 12})
    tasks = _run(_policy(space))
    searched = [t for t in tasks if t.phase == "search"]
    # prefetch applies only with workers: 3 distinct configs, not 4, and not 12
    assert len(searched) == 3


def test_screened_trials_in_a_row_send_the_incumbent_to_be_measured_again():
    space = _space(budget={"trials": 8}, measure={"recheck_after": 1, "screen_windows": 2})
    policy = _policy(space)
    tasks = _run(policy)
    phases = [str(t.phase) for t in tasks]
    assert "recheck" in phases
    i = phases.index("recheck")
    # the recheck follows a screened trial, and re-measures the incumbent
    assert policy.records[i - 1]["screened"]
    best_before = max((r for r in policy.records[:i] if r["phase"] == "search" and not r["screened"]),
                      key=lambda r: r["samples_per_sec"])
    assert tasks[i].config == best_before["config"]


def test_a_retried_lost_trial_is_still_in_flight_and_one_given_up_is_left_to_resume():
    written = []
    space = _space(budget={"trials": 1}, confirm={"top": 0})
    policy = _policy(space, sink=written.append)
    base = policy.next(0.0)
    policy.on_result(base, _measure(base))
    task = policy.next(1.0)
    lost = policy.on_lost(task, "lost: the node died", retried=True)
    assert lost["phase"] == "lost" and lost["reason"].endswith("tried again")
    assert isinstance(policy.next(2.0), Wait)  # its retry is still to land
    policy.on_lost(task, "lost: the node died again", retried=False)
    assert isinstance(policy.next(3.0), Done)
    assert [str(r["phase"]) for r in policy.records] == ["baseline"]  # never a result
    assert [str(r["phase"]) for r in written] == ["baseline", "lost", "lost"]  # said in trials.jsonl
    # resumed: the config is measured
    again = _policy(space, records=policy.records)
    nxt = again.next(0.0)
    assert isinstance(nxt, Task) and nxt.phase == "search" and nxt.config == task.config


def test_a_search_killed_in_a_confirm_round_takes_it_up_again_within_its_share():
    # confirm: 2 rounds of the top 2 and the baseline = a share of 6 (of 3 trials)
    space = spec.parse({"name": "t", "workload": "conv", "knobs": {"micro_batch_size": [8, 16, 32]},
                        "budget": {"trials": 3}, "confirm": {"top": 2, "repeats": 2}})
    assert space.model.confirm_measurements() == 6

    def rec(batch, value, phase, **more):
        config = {"micro_batch_size": batch}
        return {"phase": phase, "status": "ok", "config": config, "key": _policy(space).canon(config),
                "samples_per_sec": value, "samples_per_sec_error": 0.01, **more}

    base = rec(4, 50.0, "baseline")
    searched = [rec(8, 100.0, "search"), rec(16, 99.0, "search"), rec(32, 98.0, "search")]
    killed = [base, *searched, rec(8, 100.0, "confirm", confirm_round=1)]  # cut after the leader's
    policy = _policy(space, records=killed)
    new = [(t.config["micro_batch_size"], str(t.phase), t.confirm_round) for t in _run(policy)]
    # round 1 again, whole (the top 2 and the baseline), then round 2 with the share's last
    # 2 measurements: the leader and the baseline; 6 in all with the one before the kill
    assert new[:3] == [(8, "confirm", 1), (16, "confirm", 1), (4, "baseline", 1)]
    assert [n[2] for n in new[3:]] == [2, 2] and new[-1] == (4, "baseline", 2)
    # resumed once more, after it finished: the share is spent, nothing runs twice
    assert _run(_policy(space, records=policy.records)) == []


def test_a_confirm_round_near_the_end_of_the_budget_measures_the_contenders_that_fit():
    space = spec.parse({"name": "t", "workload": "conv", "knobs": {"micro_batch_size": [8, 16, 32]},
                        "budget": {"trials": 3, "time_s": 100}, "confirm": {"top": 3, "repeats": 2}})
    canon = _policy(space).canon
    records = [{"phase": phase, "status": "ok", "config": {"micro_batch_size": b}, "key": canon({"micro_batch_size": b}),
                "samples_per_sec": v, "samples_per_sec_error": 0.01, "trial_wall_s": 5.0}
               for phase, b, v in (("baseline", 4, 50.0), ("search", 8, 100.0), ("search", 16, 99.0),
                                   ("search", 32, 98.0))]
    policy = _policy(space, records=records)
    # three contenders within noise, 12 s left: the leader and the baseline fit (10 s)
    tasks = _run(policy, now=88.0)
    assert [(t.config["micro_batch_size"], t.confirm_round) for t in tasks] == [(8, 1), (4, 1)]


def test_under_a_time_budget_no_trial_starts_that_cannot_end_in_it():
    space = _space(budget={"trials": 20, "time_s": 60})
    tasks = _run(_policy(space), wall=5.0)
    # every measurement takes 5 s: the search proper stops with room for the confirm round
    # (the top 3 and the baseline, 20 s), which then fits whole
    assert len(tasks) * 5.0 <= 60.0
    assert any(t.confirm_round for t in tasks)


def test_a_budget_with_room_for_one_config_and_its_confirmation_measures_that_one():
    # the baseline, one config and a confirm round of it (and the baseline) take 20 s: the
    # room kept for the confirm round counts the contenders found, not three yet to find;
    # that one config is the guides' advice: PyTorch's defaults would read as the baseline
    space = _space(budget={"trials": 20, "time_s": 22})
    policy = _policy(space)
    tasks = _run(policy, wall=5.0)
    assert [str(t.phase) for t in tasks] == ["baseline", "search", "confirm", "baseline"]
    assert len(tasks) * 5.0 <= 22 and policy.pick().row is not None
    defaults, advice = space.start_points(CTX)[:2]
    assert defaults != advice and policy.canon(tasks[1].config) == policy.canon(advice)
    # with room for two configs, PyTorch's defaults come first, as without a budget
    roomy = _run(_policy(_space(budget={"trials": 20, "time_s": 32})), wall=5.0)
    assert sum(t.phase == "search" for t in roomy) == 2 and policy.canon(roomy[1].config) == policy.canon(defaults)


def test_a_budget_keeps_room_for_the_contenders_within_noise_of_the_leader_alone():
    # every measurement 5 s; the confirm round re-measures the configs within noise of the
    # leader: where each config doubles the one before, that is the leader alone, and the
    # search measures one config more in the time kept for three
    def configs_measured(value) -> tuple[int, float]:
        policy = _policy(_space(knobs={"micro_batch_size": [8, 16, 32, 64, 128, 256]},
                                budget={"trials": 6, "time_s": 45}))
        now = 0.0
        while not isinstance(task := policy.next(now), Done):
            now += 5.0
            policy.on_result(task, {"status": "ok", "config": dict(task.config), "trial_wall_s": 5.0,
                                    "samples_per_sec": value(task.config["micro_batch_size"]),
                                    "samples_per_sec_error": 0.01, "screened": False})
        return sum(r["phase"] == "search" for r in policy.records), now

    clear, flat = configs_measured(lambda batch: float(batch)), configs_measured(lambda batch: 100.0)
    assert clear == (5, 35.0 + 5.0) and flat[0] == 4 and flat[1] <= 45


def test_several_at_once_the_confirm_round_waits_for_the_search_s_last_trials():
    policy = _policy(_space(budget={"trials": 3}))
    base = policy.next(0.0)
    assert isinstance(policy.next(0.0), Wait)  # the search starts once the baseline landed
    policy.on_result(base, _measure(base))
    a, b, c = policy.next(1.0), policy.next(1.0), policy.next(1.0)
    assert all(isinstance(t, Task) and t.phase == "search" for t in (a, b, c))
    for t in (a, b):
        policy.on_result(t, _measure(t))
    assert isinstance(policy.next(2.0), Wait)  # the budget's 3 configs are out; c has not landed
    policy.on_result(c, _measure(c))
    nxt = policy.next(3.0)
    assert isinstance(nxt, Task) and nxt.confirm_round == 1


def test_a_config_that_would_hang_as_one_did_is_not_run():
    """Where a trial hung says which knobs can matter: waiting for its first batch, the
    loader's (a config that differs only in precision hangs too, and is not run); in its
    first step's compute, every knob but the loader's own (another micro-batch is run)."""
    space = _space(knobs={"precision": ["fp32", "bf16"], "num_workers": [0, 2], "micro_batch_size": [16, 32]},
                   budget={"trials": 8}, confirm={"top": 0})
    policy = _policy(space)
    base = policy.next(0.0)
    policy.on_result(base, _measure(base))
    seen = []
    while isinstance(task := policy.next(1.0), Task):
        seen.append(task.config)
        c = task.config
        if c["num_workers"] == 2 and c["micro_batch_size"] == 32:
            record = {"status": "infeasible", "error_kind": "timeout", "config": dict(c), "samples_per_sec": None,
                      "hung_phase": "waiting for the first batch", "reason": "hung"}
        else:
            record = _measure(task)
        policy.on_result(task, record)
    hung = [r for r in policy.records if r.get("hung_phase")]
    skipped = [r for r in policy.records if r.get("skipped")]
    assert len(hung) == 1 and len(skipped) == 1  # of the two 2-worker, 32-batch configs, one ran
    assert skipped[0]["config"]["precision"] != hung[0]["config"]["precision"]
    assert "num_workers=2" in skipped[0]["reason"] and "waiting for the first batch" in skipped[0]["reason"]
    assert len(policy.records) == 1 + 8  # the baseline, and every config of the space: ran or not run
    # the same hang in the first step's compute: a 16-batch config is still run
    from tuner.policy import _hang

    compute = {**hung[0], "hung_phase": "the first step's compute (forward, backward, compile)"}
    config, names, _ = _hang(compute)
    assert "precision" in names and "micro_batch_size" in names and "num_workers" not in names


@pytest.mark.parametrize("refusal, refused", [
    ({"knob": "channels_last", "values": [True]}, lambda c: c["channels_last"]),
    ({"knob": "micro_batch_size", "at_least": 32}, lambda c: c["micro_batch_size"] >= 32),
])
def test_a_knob_value_a_trial_refused_is_not_run_again_nor_counted_in_the_budget(refusal, refused):
    """A trial refused a value whatever the other knobs were (KnobRefused: a cache of a
    random dataset, a fused step for sparse gradients, workers that each read a whole
    stream): no other config with it is run, and the budget's configs are all ones that
    ran. The sampler wasted a third of a 12-config search on them (conv, channels_last
    refused: 4 of 12), and its pick read 0.86 of the best allowed config."""
    knobs_ = {"precision": ["fp32", "bf16"], "num_workers": [0, 1, 2], "micro_batch_size": [16, 32, 64],
              "channels_last": [False, True]}
    space = _space(knobs=knobs_, budget={"trials": 12}, confirm={"top": 0})  # without the rule: 3 refused ran
    policy = _policy(space)
    base = policy.next(0.0)
    policy.on_result(base, _measure(base))
    while isinstance(task := policy.next(1.0), Task):
        if refused(task.config):
            record = {"status": "infeasible", "error_kind": "invalid", "config": dict(task.config),
                      "samples_per_sec": None, "reason": "invalid config: refused here", "refused": refusal}
        else:
            record = _measure(task)
        policy.on_result(task, record)
    search = [r for r in policy.records if r["phase"] == "search"]
    ran = [r for r in search if not r.get("skipped")]
    assert sum(1 for r in ran if refused(r["config"])) == 1  # the one that found it out
    assert sum(1 for r in ran if r["status"] == "ok") == 12 - 1  # the budget, less that one
    for r in (r for r in search if r.get("skipped")):
        assert refused(r["config"]) and r["error_kind"] == "invalid"
        assert r["reason"].startswith(f"not run: {refusal['knob']}=") and "refused here" in r["reason"]
    # a resumed search knows the refusal from its records
    again = _policy(space, records=policy.records)
    assert again._refused_like({**ran[0]["config"], refusal["knob"]: refusal.get("values", [64])[0]})


def test_on_a_gpu_under_a_time_budget_eager_configs_are_searched_then_the_contenders_compiled():
    space = _space(knobs={"precision": ["fp32", "bf16"], "num_workers": [0, 1, 2], "compile": ["off", "default"]},
                   budget={"trials": 8, "time_s": 10_000})
    gpu = knobs.Context(device="cuda", cpu_count=16)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    policy = SearchPolicy(space, gpu)
    tasks, now = [], 0.0
    while not isinstance(decision := policy.next(now), Done):
        tasks.append(decision)
        now += 5.0
        # a compiled config is 20% faster here
        factor = 1.2 if decision.config.get("compile") != "off" else 1.0
        policy.on_result(decision, _measure(decision, factor=factor))
    search = [t for t in tasks if t.phase == "search"]
    ran = [r for r in policy.records if r["phase"] == "search" and not r.get("skipped")]
    first_compiled = next(i for i, r in enumerate(ran) if r["config"]["compile"] != "off")
    # every measured config before the first compiled one is eager, and every one after it is compiled
    assert first_compiled >= 3 and all(r["config"]["compile"] != "off" for r in ran[first_compiled:])
    held = [r for r in policy.records if r.get("error_kind") == "held"]
    assert all(r["config"]["compile"] != "off" for r in held)
    # the guides' start (compile on a GPU) ran as its eager twin
    assert ran[1]["config"]["precision"] == "bf16"
    # the pick is a compiled contender, measured (its held record does not make it infeasible)
    best = policy.pick().row
    assert best["config"]["compile"] == "default" and best["feasible"] and best["measurements"] >= 2
    assert len(search) <= 8 + len(held) + 2


def test_a_compiled_twin_starts_only_where_it_and_its_confirmation_fit_the_time_budget():
    """On a GPU a compiled trial costs many eager trials' time (here 60 s against 5 s). The
    contenders' compiled twins are costed at the compiled trials' wall, not a typical
    trial's, and each twin that may lead is costed with its re-measurement in the confirm
    round: every search ends within its budget, and a budget with room for both twins
    runs both."""
    def flat(config: dict) -> float:  # every eager config within noise of the others
        return 100.0 * (1 + 0.01 * (config.get("num_workers") or 0)) * (1.01 if config.get("precision") == "bf16" else 1)

    gpu = knobs.Context(device="cuda", cpu_count=16)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    twins = {}
    for time_s in (200, 240, 300, 360):
        space = _space(knobs={"precision": ["fp32", "bf16"], "num_workers": [0, 1, 2], "compile": ["off", "default"]},
                       budget={"trials": 8, "time_s": time_s}, confirm={"top": 3})
        policy, now = SearchPolicy(space, gpu), 0.0
        while not isinstance(decision := policy.next(now), Done):
            compiled = (decision.config.get("compile") or "off") != "off"
            wall = 60.0 if compiled else 5.0
            now += wall
            policy.on_result(decision, {"status": "ok", "config": dict(decision.config), "trial_wall_s": wall,
                                        "samples_per_sec": flat(decision.config) * (1.2 if compiled else 1.0),
                                        "samples_per_sec_error": 0.01, "screened": False})
        assert now <= time_s, (time_s, now)
        twins[time_s] = sum(r["phase"] == "search" and r["status"] == "ok" and r["config"].get("compile") == "default"
                           for r in policy.records)
        assert policy.pick().row["config"]["compile"] == "default"
    assert twins[200] == 1 and twins[360] == 2, twins


@pytest.mark.parametrize(("loader_cores_per_worker", "threads"), [(1.0, 8), (0.02, 16)])
def test_the_cores_its_workers_used_reach_the_starts_through_optuna(loader_cores_per_worker, threads):
    """A trial's record carries the cores its DataLoader workers used; the policy hands them
    to Optuna with its figures, and the start at the most workers on 16 cores leaves the
    threads the cores those workers did not use."""
    ctx = knobs.Context(device="cpu", cpu_count=16)
    space = _space(knobs={"num_workers": [0, 4, 8], "torch_threads": [1, 2, 4, 8, 16],
                          "micro_batch_size": [32, 64]})
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    policy = SearchPolicy(space, ctx)
    searched = []
    now = 0.0
    while len(searched) < 4:
        task = policy.next(now)
        assert isinstance(task, Task), task
        record = _measure(task)
        if task.phase == "search":
            searched.append(task.config)
            record["loader_cpu_cores"] = loader_cores_per_worker * (task.config.get("num_workers") or 0)
        now += 5.0
        policy.on_result(task, record)
    assert [(c["num_workers"], c["torch_threads"]) for c in searched[:3]] == [(0, 16), (4, 8), (0, 16)]
    assert (searched[3]["num_workers"], searched[3]["torch_threads"]) == (8, threads)


def test_a_resumed_study_keeps_the_figures_the_sampler_reads():
    """Resume rebuilds the study from the records: a trial Optuna never heard of comes back
    with its figures, screened or not, and its workers' cores, as the live trial told them."""
    first = _policy(_space())
    tasks = _run(first, until=lambda tasks: sum(t.phase == "search" for t in tasks) == 3)
    records = [{**r, "loader_cpu_cores": 0.25, "screened": r.get("trial_number") == 1} for r in first.records]
    resumed = _policy(_space(), records=records)
    trials = resumed.study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(trials) == 3 == sum(t.phase == "search" for t in tasks)
    assert [bool(t.user_attrs.get("screened")) for t in trials] == [False, True, False]
    assert all(t.user_attrs["loader_cpu_cores"] == 0.25 and t.user_attrs["samples_per_sec"] > 0 for t in trials)


def test_the_threads_a_trial_ran_with_reach_the_sampler_through_optuna():
    """A space that leaves the threads unset: each record's ``intra_op_threads`` (what the
    user's default gave the trial) reaches Optuna with its figures, and the guided sampler
    reads the unset threads as those, not as every core."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    policy = SearchPolicy(_space(knobs={"num_workers": [0, 4, 8], "micro_batch_size": [32, 64]}),
                          knobs.Context(device="cpu", cpu_count=16))
    now = 0.0
    while sum(r.get("phase") == "search" for r in policy.records) < 3:
        task = policy.next(now)
        assert isinstance(task, Task), task
        policy.on_result(task, {**_measure(task), "intra_op_threads": 1})
        now += 5.0
    policy.next(now)  # the sampler plans the next config from the three
    trials = policy.study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert [t.user_attrs["intra_op_threads"] for t in trials] == [1.0, 1.0, 1.0]
    assert policy.study.sampler._unset == 1


@pytest.mark.parametrize(("cores", "threads", "per_process"),
                         [(16, True, 20.0), (16, True, 60.0), (16, True, 100.0), (16, True, 1000.0),
                          (64, False, 20.0), (64, False, 200.0), (64, False, 2000.0)])
def test_on_many_cores_the_search_finds_the_split_its_pipeline_needs(cores, threads, per_process):
    """A machine of many cores (the policy is told so) and a synthetic pipeline: the step's
    rate grows with the intra-op threads and the batch and falls where threads and workers
    overrun the cores; each loading process delivers ``per_process`` samples/s, so the
    workers it takes range from all of them to hardly any. No 2-core rule knows the answer:
    the starts and the model of the pipeline's stages, fed each trial's data wait, find the
    best config within 12 configs at every loading rate, with the threads searched or left
    to PyTorch (every core, which the workers then share)."""
    import itertools

    def measure(c: dict) -> tuple[float, float]:  # (samples/s, data wait)
        return pipeline_rate(c, cores, per_process)

    knob_values = {"micro_batch_size": [32, 64, 128], "num_workers": [0, 2, 4, 8, 12] if threads else [0, 2, 4, 8, 16, 32],
                   **({"torch_threads": [1, 2, 4, 8, 16]} if threads else {})}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    policy = SearchPolicy(_space(knobs=knob_values, budget={"trials": 12}),
                          knobs.Context(device="cpu", cpu_count=cores, bf16_native=False))
    now = 0.0
    while not isinstance(task := policy.next(now), Done):
        rate, wait = measure(task.config)
        screened = bool(task.screen and rate * (1 + task.screen["margin"]) < task.screen["below"])
        policy.on_result(task, {"status": "ok", "config": dict(task.config), "samples_per_sec": rate,
                                "samples_per_sec_error": 0.01, "screened": screened, "trial_wall_s": 5.0,
                                "data_wait_fraction": wait})
        now += 5.0
    best = max(measure(dict(zip(knob_values, v, strict=True)))[0] for v in itertools.product(*knob_values.values()))
    assert measure(policy.pick().row["config"])[0] == pytest.approx(best)


@pytest.mark.parametrize(("mb_per_sample", "grown"), [(100.0, True), (200.0, False)])
def test_on_a_gpu_the_third_config_is_the_best_start_at_the_largest_batch_its_measured_memory_fits(
        mb_per_sample, grown):
    """The records' peak device memory and the device's memory reach the guided sampler
    through Optuna (a GPU context: no GPU is needed to decide, only its figures)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    policy = SearchPolicy(_space(budget={"trials": 4}), knobs.Context(device="cuda", cpu_count=8))
    searched = []
    while not isinstance(task := policy.next(5.0 * len(searched)), Done):
        rec = _measure(task)
        rec.update(peak_device_memory_mb=mb_per_sample * task.config["micro_batch_size"],
                   hardware={"gpu_memory_mb": 10000.0})
        searched += [task.config] if task.phase == "search" else []
        policy.on_result(task, rec)
    advice = searched[1]
    assert advice["micro_batch_size"] == 32  # on a GPU the advice keeps its batch
    third = {k: searched[2][k] for k in ("precision", "num_workers", "micro_batch_size")}
    # 64 samples: 6,400 MB of 10,000 fits in 80%; 12,800 does not
    assert (third == {**{k: advice[k] for k in third}, "micro_batch_size": 64}) is grown


def test_a_config_with_more_ranks_is_costed_at_its_own_world_size_s_walls():
    """A trial of two ranks pays their processes' start (Ray Train's controller and
    workers) on top of the work: here 20 s against 5 s, and two ranks read 10% slower, so
    that most trials have one. The search proper costs the config it chose at the trials
    of its world size (as a compiled one at its compile mode's) before it starts it: where
    it does not fit, the search proper ends there and the time goes to the confirm round.
    Costed at a typical trial's 5 s, a late two-rank trial took the confirm round's room.
    Only the first trial of two ranks has no walls of its kind to be costed at."""
    def rate_of(config: dict) -> float:
        return (100.0 * (1 + 0.05 * config["num_workers"]) * (1 + config["micro_batch_size"] / 320)
                * (0.9 if config["world_size"] == 2 else 1.0))

    for time_s in range(40, 200, 3):
        space = _space(knobs={"num_workers": [0, 1, 2], "micro_batch_size": [16, 32, 64],
                              "precision": ["fp32", "bf16"], "world_size": [1, 2]},
                       budget={"trials": 12, "time_s": time_s}, confirm={"top": 2})
        policy, now = _policy(space), 0.0
        while not isinstance(decision := policy.next(now), Done):
            assert isinstance(decision, Task), decision
            config = {"num_workers": 0, "micro_batch_size": 32, "world_size": 1, **decision.config}
            wall = 20.0 if config["world_size"] == 2 else 5.0
            now += wall
            policy.on_result(decision, {"status": "ok", "config": dict(decision.config), "trial_wall_s": wall,
                                        "samples_per_sec": rate_of(config), "samples_per_sec_error": 0.01,
                                        "screened": False})
        assert now <= time_s, (time_s, now)
        ranks = [r["config"].get("world_size", 1) for r in policy.records if r["phase"] == "search"]
        first_of_its_kind = ranks[-1] not in ranks[:-1]
        assert 2 in ranks or time_s < 60, (time_s, ranks)
        assert any(r.get("confirm_round") for r in policy.records) or first_of_its_kind, (time_s, ranks)
