"""GuidedSampler with real Optuna studies on synthetic landscapes (no Ray, no torch runs)."""

import json

import optuna
import pytest

from tests.helpers import pipeline_rate
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


def test_starts_at_the_start_and_leaves_its_neighbourhood_where_the_optimum_is_far():
    """A landscape whose optimum differs from the start in every knob, with every one-knob
    change of the start worse than the start: a local search from there stays; the
    model's expected improvement goes where nothing was measured yet."""
    import itertools

    def deceptive(c):
        far = sum(c[k] != START[k] for k in DOMAIN)
        return 1.0 - 0.1 * far if far < len(DOMAIN) else 2.0

    sampler = GuidedSampler(DOMAIN, START, key, seed=0)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.optimize(lambda t: deceptive({k: t.suggest_categorical(k, v) for k, v in DOMAIN.items()}), n_trials=10)
    assert study.trials[0].params == START
    configs = [dict(zip(DOMAIN, v, strict=True)) for v in itertools.product(*DOMAIN.values())]
    assert study.best_value == max(map(deceptive, configs))


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


CORES_DOMAIN = {"precision": ["fp32", "bf16"], "num_workers": [0, 1, 2], "torch_threads": [1, 2],
                "micro_batch_size": [32, 64]}


def input_bound(c):
    """2 cores shared by intra-op threads and workers: data comes from workers, compute from
    threads, and both together beyond the cores thrash (the input-bound set seen here:
    best 2 workers with 1 thread, 1 worker with 2 threads 0.69 of it)."""
    workers, threads = c["num_workers"], c["torch_threads"]
    data = {0: 60.0, 1: 110.0, 2: 220.0}[workers]
    compute = 150.0 * threads * (1.3 if c["precision"] == "bf16" else 1.0) * (1.05 if c["micro_batch_size"] == 64 else 1)
    rate = 1 / (1 / data + 1 / compute)
    return rate * (0.55 if threads > 1 and threads + workers > 2 else 1.0)


def test_the_model_sees_threads_and_workers_compete_for_the_cores():
    import itertools

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    configs = [dict(zip(CORES_DOMAIN, v, strict=True)) for v in itertools.product(*CORES_DOMAIN.values())]
    optimum = max(map(input_bound, configs))
    defaults = {"precision": "fp32", "num_workers": 0, "torch_threads": 2, "micro_batch_size": 32}
    guides = {"precision": "bf16", "num_workers": 1, "torch_threads": 1, "micro_batch_size": 32}
    picks = []
    for seed in range(3):
        sampler = GuidedSampler(CORES_DOMAIN, [defaults, guides], key, seed=seed, cores=2)
        study = optuna.create_study(direction="maximize", sampler=sampler)
        study.optimize(lambda t: input_bound({k: t.suggest_categorical(k, v) for k, v in CORES_DOMAIN.items()}),
                       n_trials=8)
        picks.append(study.best_value / optimum)
        # once the model has seen it cost, threads are not left without cores again
        late = [t.params for t in study.trials[4:]]
        assert sum(p["torch_threads"] > 1 and p["num_workers"] + p["torch_threads"] > 2 for p in late) <= 1
    assert min(picks) == pytest.approx(1.0)


def test_a_screened_contender_is_measured_again_in_full():
    """The optimum, screened out on its first windows: once the model of full
    measurements rates it near the incumbent, it is proposed again (once), and wins."""
    import itertools

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = GuidedSampler(DOMAIN, START, key, seed=0)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    optimum = max((dict(zip(DOMAIN, v, strict=True)) for v in itertools.product(*DOMAIN.values())), key=speed)
    seen = []

    def objective(trial):
        c = {k: trial.suggest_categorical(k, v) for k, v in DOMAIN.items()}
        seen.append(key(c))
        if c == optimum and seen.count(key(c)) == 1:
            trial.set_user_attr("screened", True)
            return speed(c) * 0.5  # its start-up windows
        return speed(c)

    study.optimize(objective, n_trials=20)
    assert seen.count(key(optimum)) == 2
    assert len(set(seen)) == len(seen) - 1
    assert study.best_value == pytest.approx(speed(optimum))



def test_a_config_screened_far_below_the_incumbent_is_not_measured_again():
    """bf16 on a host without bf16 instructions runs several times slower: every config
    with it is screened on its first windows. The full measurements know nothing of bf16,
    so the model of them alone rated such a config as high as any and measured it again
    in full; its own screened figure says it is no contender."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    domain = {k: v for k, v in DOMAIN.items() if k != "precision"} | {"precision": ["fp32", "bf16"]}
    start = {**START, "precision": "fp32"}
    sampler = GuidedSampler(domain, start, key, seed=0)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    seen = []

    def objective(trial):
        c = {k: trial.suggest_categorical(k, v) for k, v in domain.items()}
        seen.append(key(c))
        if c["precision"] == "bf16":
            trial.set_user_attr("screened", True)
            return speed({**c, "precision": "fp32"}) * 0.12
        return speed(c)

    study.optimize(objective, n_trials=20)
    bf16 = [k for k in seen if '"bf16"' in k]
    assert bf16 and len(set(bf16)) == len(bf16)  # tried, and none of them twice


@pytest.mark.parametrize("bf16_gain", [0.6, 1.5])
def test_the_starts_after_a_pair_take_the_value_the_pair_found_faster(bf16_gain):
    """The guides' advice and the same in fp32 are measured side by side; the start after
    them (another split of the cores) runs at whichever precision read faster, since bf16
    on a CPU wins on some hosts and loses on others."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    guides = {"precision": "bf16", "num_workers": 1, "torch_threads": 1, "micro_batch_size": 64}
    starts = [{"precision": "fp32", "num_workers": 0, "torch_threads": 2, "micro_batch_size": 32}, guides,
              {**guides, "precision": "fp32"}, {**guides, "torch_threads": 2, "num_workers": 0}]

    def rate(c):
        return input_bound(c) / 1.3 * (bf16_gain if c["precision"] == "bf16" else 1.0)

    sampler = GuidedSampler(CORES_DOMAIN, starts, key, seed=0, cores=2)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.optimize(lambda t: rate({k: t.suggest_categorical(k, v) for k, v in CORES_DOMAIN.items()}), n_trials=4)
    assert [t.params for t in study.trials[:3]] == starts[:3]
    faster = "bf16" if bf16_gain > 1 else "fp32"
    assert study.trials[3].params == {**starts[3], "precision": faster}


def test_a_start_replaced_by_a_pair_does_not_come_back_when_the_pair_is_measured_again():
    """The pair settles on its first figures: a re-measurement of the guides' start that
    reads faster than the fp32 one does not bring back the split in bf16 that the settled
    fp32 split replaced."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    guides = {"precision": "bf16", "num_workers": 1, "torch_threads": 1, "micro_batch_size": 64}
    split = {**guides, "torch_threads": 2, "num_workers": 0}
    sampler = GuidedSampler(CORES_DOMAIN, [guides, {**guides, "precision": "fp32"}, split], key, seed=0, cores=2)
    study = optuna.create_study(direction="maximize", sampler=sampler)

    def run(value):
        trial = study.ask()
        params = {k: trial.suggest_categorical(k, v) for k, v in CORES_DOMAIN.items()}
        study.tell(trial, value)
        return params

    assert run(1.0) == guides and run(2.0)["precision"] == "fp32"
    assert run(1.5) == {**split, "precision": "fp32"}
    study.enqueue_trial(guides)
    assert run(3.0) == guides  # measured again, now faster than the fp32 start
    later = [run(1.0) for _ in range(6)]
    assert split not in later


def test_a_thread_count_held_fixed_shares_the_cores_with_the_searched_workers():
    """A space that fixes torch_threads and searches num_workers: the model's term for
    threads left without a core reads the fixed count, not PyTorch's default."""
    from tuner.sampler import InteractionModel

    domain = {"num_workers": [0, 2, 4]}
    done = [({"num_workers": 0}, 100.0), ({"num_workers": 2}, 90.0)]
    model = InteractionModel(domain, done, 1.0, cores=4, fixed={"torch_threads": 2})
    rows = {w: model._row({"num_workers": w})[model.over] for w in (0, 2, 4)}
    assert rows == {0: 0.0, 2: 0.0, 4: pytest.approx(0.5)}  # 2 threads + 4 workers on 4 cores
    unset = InteractionModel(domain, done, 1.0, cores=4)
    assert unset._row({"num_workers": 2})[unset.over] == pytest.approx(0.5)  # every core to threads


def test_threads_left_unset_are_read_as_the_threads_the_trials_ran_with():
    """A space that leaves torch_threads to the user's default: before a trial reported
    its threads, the model reads every core (the most a default takes); once trials
    reported ``intra_op_threads`` (the user's OMP_NUM_THREADS=1 here, or the physical cores
    PyTorch picks on an SMT host), it reads those, and workers that fit beside them leave
    no thread without a core."""
    from tuner.sampler import InteractionModel, oversubscription, unset_threads

    domain = {"num_workers": [0, 4, 8]}
    done = [({"num_workers": 0}, 100.0), ({"num_workers": 4}, 150.0)]
    trials = [({"num_workers": 0}, {"samples_per_sec": 100.0, "intra_op_threads": 1.0}),
              ({"num_workers": 4}, {"samples_per_sec": 150.0, "intra_op_threads": 1.0}),
              ({"num_workers": 4, "torch_threads": 16}, {"samples_per_sec": 90.0, "intra_op_threads": 16.0})]
    assert unset_threads(trials) == 1  # the trial that set 16 threads is not the default
    assert unset_threads([(c, {"samples_per_sec": f["samples_per_sec"]}) for c, f in trials]) is None
    before = InteractionModel(domain, done, 1.0, cores=16)
    after = InteractionModel(domain, done, 1.0, cores=16, unset_threads=unset_threads(trials))
    assert before._row({"num_workers": 8})[before.over] == pytest.approx(0.5)  # 16 threads + 8 workers
    assert after._row({"num_workers": 8})[after.over] == 0.0
    smt = {"num_workers": 12}  # 8 physical of 16 logical cores: 8 threads and 12 workers overrun them
    assert oversubscription(smt, 16, unset=8) == pytest.approx(4 / 16)
    assert oversubscription({**smt, "torch_threads": 2}, 16, unset=8) == 0.0  # a set count is the count


def test_workers_that_wait_leave_their_cores_to_the_threads_in_the_model():
    """The term for threads without a core counts the cores the workers were measured to
    use: two workers waiting on a disk (a tenth of a core between them) leave two threads
    their cores on 2 cores; counted as a core each, they would not."""
    from tuner.sampler import LoaderUse, loader_use, oversubscription

    config = {"torch_threads": 2, "num_workers": 2}
    assert oversubscription(config, 2) == 1.0
    waiting = loader_use([({"num_workers": 1}, {"samples_per_sec": 100.0, "loader_cpu_cores": 0.05}),
                          ({"num_workers": 0}, {"samples_per_sec": 120.0, "loader_cpu_cores": 0.0})])
    assert waiting == LoaderUse(per_sample=0.0005, rate=120.0)
    assert oversubscription(config, 2, waiting) == pytest.approx(0.06 / 2)
    decoding = LoaderUse(per_sample=0.02, rate=120.0)  # 2.4 cores' worth of loading: each worker busy
    assert oversubscription(config, 2, decoding) == 1.0
    assert loader_use([({"num_workers": 0}, {"samples_per_sec": 120.0, "loader_cpu_cores": 0.0})]) is None
    # a screened figure is no target rate, but its workers' cores are a measurement
    use = loader_use([({"num_workers": 2}, {"samples_per_sec": 50.0, "loader_cpu_cores": 1.0, "screened": True}),
                      ({"num_workers": 0}, {"samples_per_sec": 80.0})])
    assert use == LoaderUse(per_sample=0.02, rate=80.0)


@pytest.mark.parametrize(("loader_cores", "threads"), [(None, 8), (4.0, 8), (0.4, 16)])
def test_a_split_start_takes_the_threads_its_workers_leave_by_the_cores_they_used(loader_cores, threads):
    """On 16 cores the start at the most workers (8) first assumes a core per worker and
    so 8 threads. Once the guides' start (4 workers) has reported the cores its workers
    used, the split takes what is left by use: 4 busy workers' rate at 8 workers still
    leaves 8 threads, workers that waited on a disk (0.4 cores between 4) leave all 16;
    with no cores reported it stays as it was."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    domain = {"num_workers": [0, 4, 8], "torch_threads": [1, 2, 4, 8, 16]}
    defaults, guides, split = ({"num_workers": 0, "torch_threads": 16}, {"num_workers": 4, "torch_threads": 8},
                               {"num_workers": 8, "torch_threads": 8})
    sampler = GuidedSampler(domain, [defaults, guides, split], key, seed=0, cores=16, splits=[defaults, split])
    study = optuna.create_study(direction="maximize", sampler=sampler)
    for start, rate in ((defaults, 300.0), (guides, 400.0)):
        trial = study.ask()
        assert {k: trial.suggest_categorical(k, v) for k, v in domain.items()} == start
        trial.set_user_attr("samples_per_sec", rate)
        if loader_cores is not None and start["num_workers"]:
            trial.set_user_attr("loader_cpu_cores", loader_cores)
        study.tell(trial, rate)
    trial = study.ask()
    assert {k: trial.suggest_categorical(k, v) for k, v in domain.items()} == {"num_workers": 8, "torch_threads": threads}


def test_the_loading_stage_is_measured_per_group_of_configs_that_load_alike():
    """Without workers, the training process's loading rate is its figure over its data
    wait; with workers that bound the rate, a worker's is the figure over the workers; a
    rate workers kept up with is the least a worker does; a config whose loading differs
    (a dataset cache) is a group of its own, and a loading never seen to bind is no limit."""
    from tuner.sampler import pipeline

    plain, cached = {"dataset_cache": False}, {"dataset_cache": True}
    pipe = pipeline([({**plain, "num_workers": 0}, {"samples_per_sec": 75.0, "data_wait_fraction": 0.25}),
                     ({**plain, "num_workers": 2}, {"samples_per_sec": 120.0, "data_wait_fraction": 0.3}),
                     ({**plain, "num_workers": 4}, {"samples_per_sec": 200.0, "data_wait_fraction": 0.01}),
                     ({**cached, "num_workers": 0}, {"samples_per_sec": 90.0, "data_wait_fraction": 0.01})], cores=16)
    assert pipe.limit({**plain, "num_workers": 0}) == (True, pytest.approx(300.0))
    assert pipe.limit({**plain, "num_workers": 8}) == (False, pytest.approx(8 * 60.0))
    assert pipe.limit({**cached, "num_workers": 0}) is None
    # workers seen to keep up at 50 samples/s each: at least that, whatever bound ones read
    slow = pipeline([({**plain, "num_workers": 2}, {"samples_per_sec": 60.0, "data_wait_fraction": 0.5}),
                     ({**plain, "num_workers": 4}, {"samples_per_sec": 200.0, "data_wait_fraction": 0.0})], cores=16)
    assert slow.limit({**plain, "num_workers": 8}) == (False, pytest.approx(8 * 50.0))
    assert pipeline([({**plain, "num_workers": 2}, {"samples_per_sec": 60.0, "data_wait_fraction": 0.0})], 16) is None
    assert pipe.step_rate(75.0, 0.25) == pytest.approx(100.0)


@pytest.mark.parametrize("throughput", [True, False])
def test_a_search_its_loading_bounds_adds_workers_rather_than_threads(throughput):
    """A 16-core machine whose loading takes a process 60 samples/s: every config below 8
    workers is held to what its workers load, whatever its threads and batch. After the
    two starts (no workers; 2 workers and 8 threads, bound at 120 samples/s), the model
    of the pipeline knows that only workers raise the rate and measures 8 of them next;
    a model of the figures alone spends its trials on the threads and batch of the
    bound start first."""
    import itertools

    cores, per_process = 16, 60.0
    domain = {"micro_batch_size": [32, 64, 128], "num_workers": [0, 2, 4, 8], "torch_threads": [2, 4, 8, 16]}

    def measure(c):  # (samples/s, data wait): the step's rate through the loading's
        return pipeline_rate(c, cores, per_process)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    starts = [{"micro_batch_size": 32, "num_workers": 0, "torch_threads": 16},
              {"micro_batch_size": 128, "num_workers": 2, "torch_threads": 8}]
    sampler = GuidedSampler(domain, starts, key, seed=0, cores=cores, throughput=throughput)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    for _ in range(4):
        trial = study.ask()
        rate, wait = measure({k: trial.suggest_categorical(k, v) for k, v in domain.items()})
        trial.set_user_attr("samples_per_sec", rate)
        trial.set_user_attr("data_wait_fraction", wait)
        study.tell(trial, rate)
    best = max(measure(dict(zip(domain, v, strict=True)))[0] for v in itertools.product(*domain.values()))
    assert [t.params for t in study.trials[:2]] == starts
    assert (study.trials[2].params["num_workers"] == 8) is throughput
    assert (study.best_value >= best * 0.999) is throughput


@pytest.mark.parametrize("batches", [[16, 32, 64, 128], [16, 128]])
def test_on_a_cpu_the_best_config_is_measured_next_at_half_the_largest_batch(batches):
    """After the starts (the advice at the largest batch listed), the best config measured
    in full is measured at the batch listed nearest half the largest, once: the model's
    one-value moves from the largest stop where the next one down reads the same, and a
    peak below it went unmeasured. Not with two batches listed (the move is the model's
    own), nor for an objective other than samples/s."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    domain = {**DOMAIN, "micro_batch_size": batches}
    defaults = {**START, "precision": "fp32", "num_workers": 0, "micro_batch_size": 16}
    advice = {**START, "micro_batch_size": 128}

    def rate(c):  # flat from 128 down to 64 (the model's next move), best at 32
        return speed(c) * {16: 1.0, 32: 1.6, 64: 1.05, 128: 1.05}[c["micro_batch_size"]]

    def run(throughput, trials):
        sampler = GuidedSampler(domain, [defaults, advice], key, seed=0, cores=2, throughput=throughput)
        study = optuna.create_study(direction="maximize", sampler=sampler)
        for _ in range(trials):
            trial = study.ask()
            config = {k: trial.suggest_categorical(k, v) for k, v in domain.items()}
            trial.set_user_attr("data_wait_fraction", 0.0)
            study.tell(trial, rate(config))
        return [t.params for t in study.trials]

    asked = run(True, 6)
    assert asked[:2] == [defaults, advice]
    halved = [c for c in asked[2:] if c == {**advice, "micro_batch_size": 64}]
    assert len(halved) == (1 if len(batches) > 2 else 0)
    if len(batches) > 2:
        assert asked[2] == halved[0]
    assert {**advice, "micro_batch_size": 64} != run(False, 3)[2]


def _walked(rate, trials: int) -> tuple[optuna.Study, dict]:
    """A CPU search of samples/s from PyTorch's defaults (at the smallest batch) and the
    advice (at the largest), ``trials`` trials each read at ``rate(config)``: the study and
    the advice."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    defaults = {**START, "precision": "fp32", "num_workers": 0, "micro_batch_size": 16}
    advice = {**START, "micro_batch_size": 128}
    sampler = GuidedSampler(DOMAIN, [defaults, advice], key, seed=0, cores=2, throughput=True)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    for _ in range(trials):
        trial = study.ask()
        config = {k: trial.suggest_categorical(k, v) for k, v in DOMAIN.items()}
        trial.set_user_attr("data_wait_fraction", 0.0)
        study.tell(trial, rate(config))
    return study, advice


@pytest.mark.parametrize(("by_batch", "walked"), [({16: 2.0, 32: 1.6, 64: 1.3, 128: 1.0}, [64, 32, 16]),
                                                  ({16: 1.0, 32: 1.2, 64: 1.3, 128: 1.0}, [64, 32]),
                                                  ({16: 1.0, 32: 1.0, 64: 0.9, 128: 1.0}, [64])])
def test_on_a_cpu_the_batch_walks_down_while_each_halving_wins(by_batch, walked):
    """Where the step to half the largest batch won, the best config is measured next at
    half its batch, and so on while each step wins; the walk stops at the first step that
    loses (padded sequences: the per-sample cost grows with the batch all the way down)."""
    study, advice = _walked(lambda c: speed({**c, "micro_batch_size": 64}) * by_batch[c["micro_batch_size"]],
                            2 + len(walked) + 1)
    asked = [t.params for t in study.trials]
    assert asked[2:2 + len(walked)] == [{**advice, "micro_batch_size": b} for b in walked]
    below = [{**advice, "micro_batch_size": b} for b in DOMAIN["micro_batch_size"] if b < walked[-1]]
    assert asked[2 + len(walked)] not in below  # the walk stopped where a step lost


@pytest.mark.parametrize(("by_batch", "walked"), [({16: 8.0, 32: 4.0, 64: 2.0, 128: 1.0}, [64, 32, 16]),
                                                  ({16: 8.0, 32: 1.0, 64: 0.9, 128: 1.0}, [64, 16])])
def test_where_the_defaults_at_the_smallest_batch_win_the_walk_goes_down_from_the_advice(by_batch, walked):
    """Where PyTorch's defaults at the smallest batch beat the advice at the largest (a
    cost per sample that falls several-fold with the batch), the advice is measured next
    at half the largest, and lower while each halving beats the config it halved: the
    defaults differ from the advice in every knob, and their win alone does not say
    whether the batch made the advice slow. Where a halving loses before the smallest
    batch (a cliff between two listed batches), the config it halved is measured at the
    smallest batch, once, and the walk ends there."""
    study, advice = _walked(lambda c: speed(c) * by_batch[c["micro_batch_size"]], 2 + len(walked) + 1)
    asked = [t.params for t in study.trials]
    assert study.trials[0].values[0] > study.trials[1].values[0]  # the defaults won the starts
    assert asked[2:2 + len(walked)] == [{**advice, "micro_batch_size": b} for b in walked]
    assert asked.count({**advice, "micro_batch_size": min(DOMAIN["micro_batch_size"])}) == 1


@pytest.mark.parametrize(("peak_mb", "grown"), [(None, 128), (1000.0, 128), (3000.0, 64), (5000.0, None)])
def test_on_a_gpu_the_best_config_is_measured_next_at_the_largest_batch_its_memory_fits(peak_mb, grown):
    """After the starts, the best config measured in full is measured at the largest
    micro-batch listed that its peak device memory, scaled with the batch, fits in 80% of
    the device's (the largest listed where no memory was reported); once, and not on a CPU."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    defaults = {**START, "precision": "fp32", "num_workers": 0, "micro_batch_size": 16}

    def run(grow):
        sampler = GuidedSampler(DOMAIN, [defaults, START], key, seed=0, throughput=True, grow_batch=grow)
        study = optuna.create_study(direction="maximize", sampler=sampler)
        for _ in range(2):
            trial = study.ask()
            config = {k: trial.suggest_categorical(k, v) for k, v in DOMAIN.items()}
            memory = {"peak_device_memory_mb": peak_mb * config["micro_batch_size"] / 32,
                      "gpu_memory_mb": 10000.0} if peak_mb else {}
            for k, v in {**memory, "data_wait_fraction": 0.0}.items():
                trial.set_user_attr(k, v)
            study.tell(trial, speed(config))
        nxt = study.ask()
        return {k: nxt.suggest_categorical(k, v) for k, v in DOMAIN.items()}, study

    third, study = run(True)
    assert [t.params for t in study.trials[:2]] == [defaults, START]
    if grown is None:  # the advice's batch is the largest that fits: the model chooses
        assert third not in ({**START, "micro_batch_size": 64}, {**START, "micro_batch_size": 128})
    else:
        assert third == {**START, "micro_batch_size": grown}
    assert run(False)[0] != {**START, "micro_batch_size": 128}  # a CPU search: the model chooses
