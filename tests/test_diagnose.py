

import pytest

from tests.helpers import FAST_MEASURE, ref
from tuner.diagnose import diagnose
from tuner.trial import make_request, run_isolated


def _measure(workers):
    # a batch loads in 32 ms and steps in 20: inline, the wait is ~60% of the time; four
    # workers supply a batch every ~8 ms, and what is left of the wait is their hand-over
    # (a few ms a batch on this VM), well under the verdict's 25% even on a slow host
    req = make_request(workload=ref("slow_data"), workload_args={"sample_s": 0.004, "step_s": 0.02},
                       config={"micro_batch_size": 8, "num_workers": workers,
                               "persistent_workers": workers > 0},
                       device="cpu", measure=FAST_MEASURE)
    r = run_isolated(req, timeout_s=120)
    assert r["status"] == "ok", r.get("reason")
    return r


@pytest.mark.slow
@pytest.mark.alone  # the share of time spent waiting for data
def test_slow_dataset_is_input_bound_until_there_are_enough_workers():
    slow = _measure(0)
    d = diagnose(slow)
    assert d.verdict == "input-bound" and slow["data_wait_fraction"] > 0.4
    assert any(r.startswith("num_workers=") for r in d.recommendations)
    assert f"{slow['data_wait_fraction']:.0%}" in d.recommendations[0]  # the figure that triggered it
    fed = _measure(4)
    assert fed["data_wait_fraction"] < 0.25
    assert diagnose(fed).verdict == "compute-bound"


def test_memory_near_the_cap_and_noise_flags():
    rec = {"status": "ok", "samples_per_sec": 10.0, "config": {"micro_batch_size": 64},
           "peak_host_memory_mb": 950.0, "peak_device_memory_mb": None, "hardware": {"host_memory_mb": 64000},
           "data_wait_fraction": 0.5, "samples_per_sec_spread": 0.4}
    d = diagnose(rec, max_memory_mb=1000)
    assert d.verdict == "memory-bound"
    assert any("activation_checkpointing" in r for r in d.recommendations)
    assert any("micro_batch_size=32 with grad_accum_steps=2" in r for r in d.recommendations)
    assert any("spread 40%" in f for f in d.flags)


def test_gpu_idle_with_little_data_wait_is_host_sync_bound():
    rec = {"status": "ok", "samples_per_sec": 10.0, "config": {}, "peak_device_memory_mb": 1000.0,
           "hardware": {"gpu_memory_mb": 80000}, "data_wait_fraction": 0.02, "gpu_util_pct": 35.0}
    d = diagnose(rec)
    assert d.verdict == "host-sync-bound" and ".item()" in d.recommendations[0]


def test_a_churning_host_heap_is_flagged_with_the_knob_that_fixes_it():
    from tuner import knobs

    rec = {"status": "ok", "samples_per_sec": 800.0, "config": {"micro_batch_size": 32},
           "peak_host_memory_mb": 900.0, "peak_device_memory_mb": None, "hardware": {"host_memory_mb": 64000},
           "data_wait_fraction": 0.0, "page_faults_per_step": 4660.0}
    flagged = [f for f in diagnose(rec).flags if "page faults" in f]
    if not knobs.GLIBC:  # the knob, and this flag, exist where glibc's malloc does
        assert not flagged
        return
    assert len(flagged) == 1 and "4,660 page faults per step" in flagged[0] and "malloc_retain=true" in flagged[0]
    assert "first epoch" not in flagged[0]  # no workers: no epoch that starts them anew
    anew = {**rec, "config": {"micro_batch_size": 32, "num_workers": 1, "persistent_workers": False}}
    assert any("first epoch" in f for f in diagnose(anew).flags if "page faults" in f)
    kept = {**rec, "config": {"micro_batch_size": 32, "num_workers": 1, "persistent_workers": True}}
    assert not any("first epoch" in f for f in diagnose(kept).flags if "page faults" in f)
    retained = {**rec, "config": {"micro_batch_size": 32, "malloc_retain": True}, "page_faults_per_step": 30.0}
    assert not [f for f in diagnose(retained).flags if "page faults" in f]
    settled = {**rec, "page_faults_per_step": 40.0}  # glibc's own thresholds settled high
    assert not [f for f in diagnose(settled).flags if "page faults" in f]
    on_gpu = {**rec, "peak_device_memory_mb": 5000.0, "hardware": {"gpu_memory_mb": 80000}}
    assert not [f for f in diagnose(on_gpu).flags if "page faults" in f]


@pytest.mark.parametrize(("other_cores", "blamed"), [(0.3, False), (4.0, True), (None, True)])
def test_spread_windows_blame_another_process_only_where_the_load_beside_them_says_so(other_cores, blamed):
    """Windows other load kept from their cores are measured again: where the load meter saw
    little beside the kept ones, the spread is named the workload's own."""
    rec = {"status": "ok", "samples_per_sec": 2375.0, "config": {"micro_batch_size": 128},
           "peak_device_memory_mb": 5754.0, "hardware": {"gpu_memory_mb": 143155, "cpu_count": 16},
           "data_wait_fraction": 0.14, "samples_per_sec_spread": 0.27, "interference_cores": other_cores}
    [flag] = [f for f in diagnose(rec).flags if "spread 27%" in f]
    assert (("another process" in flag or "other processes used 4.0 of 16" in flag) is blamed
            and ("the workload's own pace" in flag) is not blamed)


def test_the_spread_of_windows_fitted_on_batch_lengths_is_named_the_batches_own():
    """Windows of batches by length spread by design (each measured epoch starts on its
    longest pair), and their figure is fitted, not their average: no process is blamed."""
    rec = {"status": "ok", "samples_per_sec": 300.0, "config": {"micro_batch_size": 32, "group_by_length": True},
           "hardware": {"cpu_count": 2}, "data_wait_fraction": 0.02, "samples_per_sec_spread": 0.9,
           "interference_cores": None, "steady_from": "batch lengths"}
    [flag] = [f for f in diagnose(rec).flags if "spread 90%" in f]
    assert "batches by length" in flag and "fitted" in flag and "another process" not in flag
    [flag] = [f for f in diagnose({**rec, "steady_from": "all windows"}).flags if "spread 90%" in f]
    assert "another process" in flag
    # batches in a random order, padded to their longest: fitted too, and said so
    [flag] = [f for f in diagnose({**rec, "config": {"micro_batch_size": 32, "group_by_length": False}}).flags
              if "spread 90%" in f]
    assert "padded to their longest item" in flag and "longest pair" not in flag and "fitted" in flag


def test_channels_last_is_advised_for_a_model_with_conv_layers_only():
    """A trial records whether its model has Conv2d layers; a compute-bound config of a
    model without them is not sent to try channels_last (records from before the fact
    keep the advice, worded for conv nets)."""
    rec = {"status": "ok", "samples_per_sec": 100.0, "data_wait_fraction": 0.01, "config": {},
           "hardware": {"cpu_count": 2}}
    advised = lambda r: any(x.startswith("channels_last=true") for x in diagnose(r).recommendations)  # noqa: E731
    assert advised({**rec, "has_conv2d": True}) and advised(rec)
    assert not advised({**rec, "has_conv2d": False})


def test_length_grouping_is_advised_where_the_workload_gives_lengths_and_its_batches_are_mixed():
    rec = {"status": "ok", "samples_per_sec": 100.0, "data_wait_fraction": 0.01, "config": {},
           "hardware": {"cpu_count": 2}}
    advised = lambda r: [x for x in diagnose(r).recommendations if x.startswith("group_by_length=true")]  # noqa: E731
    [said] = advised({**rec, "has_lengths": True})
    assert "padding" in said and "data wait only 1%" in said
    assert not advised(rec) and not advised({**rec, "has_lengths": False})
    assert not advised({**rec, "has_lengths": True, "config": {"group_by_length": True}})


def test_precision_is_not_advised_where_the_workload_turns_autocast_on_itself():
    # inside the workload's own autocast the knob has no effect: bf16 would read the same
    rec = {"status": "ok", "samples_per_sec": 100.0, "data_wait_fraction": 0.01, "config": {},
           "hardware": {"cpu_count": 2}}
    advised = lambda r: any(x.startswith("precision=bf16") for x in diagnose(r).recommendations)  # noqa: E731
    assert advised(rec) and advised({**rec, "own_autocast": []})
    assert not advised({**rec, "own_autocast": ["train.py:40 (bfloat16, in loss)"]})
    near_cap = {**rec, "peak_host_memory_mb": 950.0, "hardware": {"host_memory_mb": 64000}}
    assert advised({**near_cap, "own_autocast": []}) and not advised({**near_cap, "own_autocast": ["x.py:1"]})


def test_bf16_is_advised_for_speed_only_on_a_cpu_that_runs_it_natively():
    """Emulated bf16 can take several times fp32's step: a compute-bound config on a CPU
    without native bf16 is not told to try it; near the memory cap it is, with the cost."""
    rec = {"status": "ok", "samples_per_sec": 100.0, "data_wait_fraction": 0.01, "config": {}}
    recs = lambda cpu_bf16: diagnose({**rec, "hardware": {"cpu_count": 2, "cpu_bf16": cpu_bf16}}).recommendations  # noqa: E731
    assert any(x.startswith("precision=bf16") for x in recs("avx512_bf16"))
    assert not any(x.startswith("precision=bf16") for x in recs(None))
    near_cap = {**rec, "peak_host_memory_mb": 950.0, "hardware": {"host_memory_mb": 1000, "cpu_bf16": None}}
    said = [x for x in diagnose(near_cap).recommendations if x.startswith("precision=bf16")]
    assert len(said) == 1 and "emulated on this CPU" in said[0], said


def test_a_recommendation_the_search_measured_says_what_it_read():
    """Against a search's rows, the best config's advice to try a value the search already
    measured becomes what that value read: in the best config's twin where there is one,
    else in the fastest config that had it; advice nothing measured stays a "try"."""
    from tuner import knobs

    base = {**knobs.defaults(), "micro_batch_size": 64, "num_workers": 1}
    best = {"feasible": True, "samples_per_sec": 200.0, "config": base, "data_wait_fraction": 0.01,
            "hardware": {"cpu_count": 2}, "status": "ok", "has_conv2d": False}
    bf16 = {**best, "samples_per_sec": 150.0, "config": {**base, "precision": "bf16"}}
    compiled = {**best, "samples_per_sec": 20.0, "config": {**base, "compile": "default", "num_workers": 0,
                                                            "micro_batch_size": 32}}
    d = diagnose(best)
    assert any(r.startswith("precision=bf16") for r in d.recommendations)
    d = d.against(best, [best, bf16, compiled], "samples_per_sec")
    assert not any(r.startswith(("precision=", "compile=")) for r in d.recommendations)
    assert "fused_optimizer=true" in d.recommendations
    assert d.measured == [
        "precision=bf16: 150.0 samples_per_sec (0.75x the best) with the best config's other knobs",
        "compile=default: 20.0 samples_per_sec (0.10x the best) at most, in a config 2 other knobs from the best"]
    # a figure the search could not trust as a full, quiet measurement says so
    d = diagnose(best).against(best, [best, {**bf16, "disturbed": True}, {**compiled, "screened": True}],
                               "samples_per_sec")
    assert d.measured[0].endswith("other knobs; measured only beside other load")
    assert d.measured[1].endswith("from the best; screened after its first windows")


def test_a_compiled_config_that_recompiled_in_its_windows_says_so():
    rec = {"status": "ok", "samples_per_sec": 100.0, "data_wait_fraction": 0.01, "hardware": {"cpu_count": 2},
           "config": {"compile": "default"}, "recompiles_in_windows": 3}
    assert any("traced 3 new graph(s) inside the timed windows" in f for f in diagnose(rec).flags)
    assert not any("traced" in f for f in diagnose({**rec, "recompiles_in_windows": 0}).flags)


def test_a_data_wait_just_under_the_input_bound_mark_is_not_called_small():
    """Compute-bound below a 25% data wait: a 21% wait is said as under that mark, not as
    "only 21%", which read as no wait to speak of; a 3% wait is "only"."""
    hw = {"cpu_count": 2}
    near = diagnose({"status": "ok", "samples_per_sec": 1.0, "data_wait_fraction": 0.21, "hardware": hw})
    assert near.verdict == "compute-bound" and "only" not in near.evidence
    assert "21%, under the 25% that makes it input-bound" in near.evidence
    small = diagnose({"status": "ok", "samples_per_sec": 1.0, "data_wait_fraction": 0.03, "hardware": hw})
    assert small.evidence == "data wait only 3%"
    none = diagnose({"status": "ok", "samples_per_sec": 1.0, "data_wait_fraction": 0.004, "hardware": hw})
    assert none.evidence == "data wait under 1%"  # not "only 0%"


def test_workers_that_hide_the_wait_on_a_cpu_but_take_its_cores_advise_the_cache():
    """A CPU config whose DataLoader workers keep the data wait near zero is compute-bound,
    yet the workers' cores are the step's threads' on a CPU: where they take LOADER_HEAVY
    of the trial's cores, the cache is advised (the items are read once); not where the
    workers take little, the items are cached already, the dataset is iterable, or the
    step runs on a GPU (whose step does not use those cores)."""
    from tuner.diagnose import LOADER_HEAVY

    def rec(loader, **more):
        return {"status": "ok", "samples_per_sec": 478.0, "map_style": True, "data_wait_fraction": 0.005,
                "trial_cpu_cores": 1.7, "loader_cpu_cores": loader, "hardware": {"cpu_count": 2},
                "config": {"num_workers": 1, "precision": "bf16", "fused_optimizer": True, "channels_last": True,
                           "compile": "default", **more.pop("config", {})}, **more}

    d = diagnose(rec(0.77))
    assert d.verdict == "compute-bound"
    cache = [r for r in d.recommendations if r.startswith("dataset_cache=true")]
    assert len(cache) == 1 and "0.8 of the trial's 1.7 cores" in cache[0]
    assert d.moves[cache[0]] == {"dataset_cache": True}
    low = 1.7 * LOADER_HEAVY * 0.9
    assert not any(r.startswith("dataset_cache") for r in diagnose(rec(low)).recommendations)
    for other in (rec(0.77, config={"dataset_cache": True}), rec(0.77, map_style=False),
                  rec(0.77, peak_device_memory_mb=900.0, gpu_util_pct=95.0)):
        assert not any(r.startswith("dataset_cache") for r in diagnose(other).recommendations), other


def test_an_input_bound_loader_with_every_core_taken_advises_cheaper_items_for_its_device():
    """Workers already on every core but one: the advice is cheaper items, and where the
    per-item work can go is the device's: the GPU on a GPU, a batched augment on a CPU."""
    def advice(on_gpu):
        rec = {"status": "ok", "samples_per_sec": 900.0, "data_wait_fraction": 0.4, "hardware": {"cpu_count": 2},
               "config": {"num_workers": 1, "torch_threads": 1}}
        if on_gpu:
            rec.update(peak_device_memory_mb=900.0, gpu_util_pct=40.0)
        d = diagnose(rec)
        assert d.verdict == "input-bound"
        return next(r for r in d.recommendations if r.startswith("the loader already has"))

    cpu, gpu = advice(False), advice(True)
    assert cpu.startswith("the loader already has 1 worker on 2 CPUs") and "Workload.augment" in cpu
    assert "GPU" not in cpu and "move augmentation to the GPU" in gpu


def test_full_collections_that_take_the_step_s_time_advise_gc_freeze_first():
    # a table's large batches: the collections start while a batch is collated, so the
    # verdict reads the time as data wait; the advice that takes it back comes first
    rec = {"status": "ok", "samples_per_sec": 67067.0, "config": {"micro_batch_size": 4096},
           "hardware": {"cpu_count": 2}, "data_wait_fraction": 0.60, "gc_share": 0.36}
    d = diagnose(rec)
    assert d.verdict == "input-bound"
    assert d.recommendations[0].startswith("gc_freeze=true") and "36%" in d.recommendations[0]
    assert d.moves[d.recommendations[0]] == {"gc_freeze": True}
    frozen = {**rec, "config": {"micro_batch_size": 4096, "gc_freeze": True}, "gc_share": 0.36}
    assert not any("gc_freeze" in r for r in diagnose(frozen).recommendations)
    for share in (0.01, None):  # a collection now and then is no lever; an older record has no figure
        assert not any("gc_freeze" in r for r in diagnose({**rec, "gc_share": share}).recommendations)
    # the DataLoader's workers collate there, and collect there: their share, named as theirs
    workers = diagnose({**rec, "gc_share": 0.0, "workers_gc_share": 0.18, "config": {"micro_batch_size": 4096,
                                                                                      "num_workers": 2}})
    assert workers.recommendations[0].startswith("gc_freeze=true")
    assert "18% of the DataLoader workers' time" in workers.recommendations[0]


@pytest.mark.parametrize(("rate", "said"), [(50_000.0, "20.0 µs"), (800.0, "1.25 ms"), (400_000.0, None)])
def test_the_cache_is_advised_with_an_item_s_cost_where_it_has_something_to_save(rate, said):
    # an item of microseconds said "0.00 ms"; one cheaper than a read from the cache (a
    # table's row in a TensorDataset) gets no advice to cache it
    rec = {"status": "ok", "samples_per_sec": 1000.0, "config": {"micro_batch_size": 64}, "map_style": True,
           "hardware": {"cpu_count": 2}, "data_wait_fraction": 0.5, "load_samples_per_sec_per_process": rate}
    advice = [r for r in diagnose(rec).recommendations if r.startswith("dataset_cache")]
    if said is None:
        assert not advice
        return
    assert len(advice) == 1 and f"an item costs {said} to produce" in advice[0]


def test_a_collate_that_is_the_loading_cost_is_named_and_no_cache_is_advised_for_it():
    """A loading process's time per item is reading the item and its share of the collate:
    where the collate is most of it, the advice names the collate, and the cache (which
    saves the read) is advised only where the read left over is worth caching."""
    rec = {"status": "ok", "samples_per_sec": 1000.0, "config": {"micro_batch_size": 64, "num_workers": 1},
           "map_style": True, "hardware": {"cpu_count": 2}, "data_wait_fraction": 0.5,
           "load_samples_per_sec_per_process": 50_000.0}  # 20 µs an item
    collate_bound = diagnose({**rec, "collate_s_per_sample": 16e-6}).recommendations
    assert not [r for r in collate_bound if r.startswith("dataset_cache")]  # 4 µs left to read: nothing to save
    named = [r for r in collate_bound if r.startswith("the collate takes")]
    assert len(named) == 1 and "16.0 µs of the 20.0 µs an item costs" in named[0], collate_bound
    read_bound = diagnose({**rec, "collate_s_per_sample": 2e-6}).recommendations
    cache = [r for r in read_bound if r.startswith("dataset_cache")]
    assert len(cache) == 1 and ("an item costs 20.0 µs to produce in a loading process (2.0 µs of it in the collate, "
                                "which the cache does not save)") in cache[0]
    assert not [r for r in read_bound if r.startswith("the collate takes")]
