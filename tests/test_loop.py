import itertools
from pathlib import Path

import pytest
import torch

from tests.helpers import ref
from tuner import knobs
from tuner.loop import EpochSampler, GroupedBatchSampler, Trainer
from tuner.workloads import load_workload
from tuner.workloads.builtin import multisource

CPU = torch.device("cpu")


def _config(**kw):
    ctx = knobs.Context("cpu", 2, has_groups=kw.pop("_groups", False), has_lengths=kw.pop("_lengths", False))
    return knobs.resolve(kw, ctx, strict=True)[0]


def test_accumulation_gives_the_gradients_of_one_large_batch():
    wl = load_workload(ref("linear"), {"lr": 1.0})
    big = Trainer(wl, _config(micro_batch_size=16, grad_accum_steps=1), CPU, seed=0)
    acc = Trainer(wl, _config(micro_batch_size=4, grad_accum_steps=4), CPU, seed=0)
    acc.model.load_state_dict(big.model.state_dict())
    before = [p.detach().clone() for p in big.model.parameters()]
    big.start()
    acc.start()
    big.step()
    acc.step()
    # SGD with lr=1: the update equals the gradient, so equal params mean equal gradients.
    for b, a, p0 in zip(big.model.parameters(), acc.model.parameters(), before, strict=True):
        assert not torch.equal(b, p0)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in acc.model.parameters())  # zero_grad(set_to_none=True)


def test_a_step_frees_its_batch_when_it_returns_as_a_framework_s_step_does():
    # A framework's training step (Hugging Face's, Lightning's) and the exported script's
    # step() free their batch and loss when they return. When tensors are freed decides
    # how glibc's malloc trims and re-faults the heap on a CPU (held until the next step,
    # a small transformer read 1.07-1.18x a step function's rate), so the measured loop
    # frees them where the user's framework does.
    import weakref

    t = Trainer(load_workload(ref("linear")), _config(micro_batch_size=4), CPU)
    t.start()
    seen = []

    class Recording:  # holds nothing itself
        def __init__(self, it):
            self.it = it

        def __next__(self):
            batch = next(self.it)
            seen.append(weakref.ref(batch[0]))
            return batch

    t._it = Recording(t._it)
    t.step()
    assert seen[0]() is None  # gone when its step returned
    t.step()
    assert seen[1]() is None and len(seen) == 2


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                             ("fp16", torch.float16)])
def test_forward_sees_the_autocast_dtype(precision, dtype):
    t = Trainer(load_workload(ref("probe")), _config(precision=precision, micro_batch_size=4), CPU)
    t.start()
    t.step()
    assert t.model.seen_dtype == dtype
    assert (t.scaler is not None) == (precision == "fp16")


def test_channels_last_reaches_weights_and_inputs():
    t = Trainer(load_workload(ref("probe")), _config(channels_last=True, micro_batch_size=4), CPU)
    assert t.model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    t.start()
    t.step()
    assert t.model.seen_channels_last is True
    off = Trainer(load_workload(ref("probe")), _config(micro_batch_size=4), CPU)
    off.start()
    off.step()
    assert off.model.seen_channels_last is False


def test_compile_fused_threads_and_loader_kwargs_reach_torch(restore_threads):
    cfg = _config(compile="default", fused_optimizer=True, torch_threads=1, num_workers=2,
                  prefetch_factor=3, persistent_workers=True, micro_batch_size=4)
    t = Trainer(load_workload(ref("linear")), cfg, CPU)
    assert isinstance(t.model, torch._dynamo.eval_frame.OptimizedModule)
    assert t.optimizer.defaults["fused"] is True
    assert torch.get_num_threads() == 1
    assert (t.loader.num_workers, t.loader.prefetch_factor, t.loader.persistent_workers) == (2, 3, True)


def test_threads_the_workload_sets_while_building_give_way_to_the_knob_with_a_note(restore_threads):
    # a torch.set_num_threads left in the user's model factory would otherwise run every
    # trial at its count under the knob's name
    t = Trainer(load_workload(ref("sets_threads"), {"build": 1}), _config(torch_threads=2), CPU)
    assert torch.get_num_threads() == 2
    assert any("torch.set_num_threads(1)" in n for n in t.notes), t.notes
    # the knob at PyTorch's default (None) leaves the user's count, with nothing to say
    t = Trainer(load_workload(ref("sets_threads"), {"build": 1}), _config(torch_threads=None), CPU)
    assert torch.get_num_threads() == 1 and not t.notes


@pytest.mark.parametrize("how", ["wrap", "submodule", "method"])
def test_a_model_its_factory_compiled_runs_as_the_compile_knob_says_with_a_note(how):
    # compiled in the user's building code, compile=off would measure a compiled model
    # (its compile in the warm-up, with compile_s 0) and compile=default compile it twice
    from importlib.util import module_from_spec, spec_from_file_location

    from torch._dynamo.eval_frame import OptimizedModule

    def compiled_parts(model):
        return [m for m in model.modules() if isinstance(m, OptimizedModule) or m._compiled_call_impl is not None]

    t = Trainer(load_workload(ref("compiled_in_factory"), {"how": how}), _config(compile="off"), CPU)
    assert not isinstance(t.model, OptimizedModule) and compiled_parts(t.model) == []
    assert any("applies torch.compile to" in n and "the compile knob decides" in n for n in t.notes), t.notes
    t = Trainer(load_workload(ref("compiled_in_factory"), {"how": how}), _config(compile="default"), CPU)
    assert isinstance(t.model, OptimizedModule) and compiled_parts(t.model._orig_mod) == []
    # the exported script builds the model as the trials did
    spec = spec_from_file_location("exported_train", Path(knobs.__file__).parent / "templates" / "train.py")
    train = module_from_spec(spec)
    spec.loader.exec_module(train)
    built = train.build_model(load_workload(ref("compiled_in_factory"), {"how": how}), _config(), CPU, 1)[0]
    assert not isinstance(built, OptimizedModule) and compiled_parts(built) == []
    assert Trainer(load_workload(ref("linear")), _config(), CPU).notes == []


def test_settings_no_knob_covers_that_slow_training_are_noted_and_kept():
    # a seeding helper's deterministic algorithms and a float64 default dtype are the
    # user's training as it runs: kept, and the record says so
    try:
        t = Trainer(load_workload(ref("seeded_for_reproducibility")), _config(), CPU)
        assert torch.are_deterministic_algorithms_enabled() and torch.get_default_dtype() == torch.float64
        assert any(n.startswith("deterministic algorithms are on") for n in t.notes), t.notes
        assert any(n.startswith("the default dtype is float64") for n in t.notes), t.notes
        assert not any("cudnn" in n for n in t.notes)  # a GPU's only
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        torch.set_default_dtype(torch.float32)


def test_workers_are_refused_for_items_already_on_a_device():
    # a dataset kept on the GPU (TensorDataset(x.cuda(), y.cuda())): a forked worker cannot
    # use the device. No GPU here: items on the "meta" device stand in for the GPU's
    # (the check reads the items' device, not CUDA); pin_memory's twin is in test_gpu.py
    from torch.utils.data import TensorDataset

    from tests.fixture_workloads import _mse
    from tuner.errors import KnobRefused
    from tuner.workloads import Workload

    on_device = TensorDataset(torch.empty(64, 8, device="meta"), torch.empty(64, 1, device="meta"))
    wl = Workload(model=lambda: torch.nn.Linear(8, 1), dataset=lambda: on_device, loss=_mse)
    with pytest.raises(KnobRefused, match=r"num_workers=2.*items are already on meta") as refused:
        Trainer(wl, _config(num_workers=2, micro_batch_size=8), CPU)
    assert refused.value.refusal == {"knob": "num_workers", "at_least": 1}
    from tuner.data import CacheRefused, check_cacheable

    with pytest.raises(CacheRefused, match="already on meta"):  # and no cache in host memory for them
        check_cacheable(on_device)
    t = Trainer(load_workload(ref("linear")), _config(num_workers=1, micro_batch_size=8), CPU)  # host items
    assert t.loader.num_workers == 1


def test_a_model_built_in_16_bits_is_noted_and_not_sent_to_try_bf16():
    from tuner.diagnose import diagnose

    t = Trainer(load_workload(ref("half_model")), _config(micro_batch_size=8), CPU)
    assert t.half_params == "bfloat16"
    assert any(n.startswith("the model's parameters are bfloat16") for n in t.notes), t.notes
    assert Trainer(load_workload(ref("linear")), _config(), CPU).half_params is None
    rec = {"status": "ok", "samples_per_sec": 100.0, "data_wait_fraction": 0.01, "config": {},
           "hardware": {"cpu_count": 2}}
    bf16 = lambda r: any(x.startswith("precision=bf16") for x in diagnose(r).recommendations)  # noqa: E731
    assert bf16(rec) and not bf16({**rec, "half_params": "bfloat16"})


def test_a_dataloader_given_as_the_dataset_is_refused_in_one_line_naming_its_dataset():
    from torch.utils.data import DataLoader

    from tests.fixture_workloads import Numbers, _mse
    from tuner.errors import WorkloadError
    from tuner.workloads import Workload

    for given in (DataLoader(Numbers(), batch_size=8), lambda: DataLoader(Numbers(), batch_size=8)):
        wl = Workload(model=lambda: torch.nn.Linear(8, 1), dataset=given, loss=_mse)
        with pytest.raises(WorkloadError, match=r"dataset is a DataLoader: give its dataset \(loader.dataset\)"):
            Trainer(wl, _config(), CPU)


@pytest.mark.parametrize("fused", [False, True])
def test_an_optimizer_factory_written_against_the_model_keeps_its_groups_in_trials_and_the_export(fused):
    # the factory reads model.named_parameters(): it gets the parameters, standing for the
    # model; fused, the same groups and weight decays, in the trial and in the exported script
    from importlib.util import module_from_spec, spec_from_file_location

    def decays(opt):
        return [(len(g["params"]), g["weight_decay"], bool(g.get("fused"))) for g in opt.param_groups]

    wl = load_workload(ref("decay_by_name"))
    t = Trainer(wl, _config(fused_optimizer=fused), CPU)
    assert decays(t.optimizer) == [(2, 0.1, fused), (2, 0.0, fused)]
    spec = spec_from_file_location("exported_train", Path(knobs.__file__).parent / "templates" / "train.py")
    train = module_from_spec(spec)
    spec.loader.exec_module(train)
    _, _, opt = train.build_model(wl, _config(fused_optimizer=fused), CPU, 1)
    assert decays(opt) == [(2, 0.1, fused), (2, 0.0, fused)]


def test_the_workload_s_gradient_clipping_is_in_each_step():
    from tuner.errors import UserError
    from tuner.workloads import Workload

    def moved(clip):
        t = Trainer(load_workload(ref("linear"), {"lr": 1.0, "clip": clip}), _config(micro_batch_size=8), CPU)
        before = [p.detach().clone() for p in t.model.parameters()]
        t.start()
        t.step()
        return sum(float((p.detach() - b).norm()) ** 2 for p, b in zip(t.model.parameters(), before, strict=True)) ** 0.5

    # SGD with lr 1 moves the parameters by the gradient: clipped, by at most the max norm
    assert moved(1e-3) <= 1e-3 * 1.0001 < moved(None)
    with pytest.raises(UserError, match="clip_grad_norm=0"):
        Workload(model=lambda: torch.nn.Linear(8, 1), dataset=lambda: [], loss=lambda m, b: 0, clip_grad_norm=0)


@pytest.mark.parametrize("workers", [0, 1])
def test_an_error_in_the_workload_s_data_is_one_line_that_says_so(workers):
    # items of different sizes fail in the default collate: in a worker as a shared-memory
    # resize whose words name neither; a bad item's error comes back from a worker as text
    from tuner.errors import WorkloadError

    where = "workload data raised in a DataLoader worker: " if workers else "workload data raised: "
    config = _config(micro_batch_size=8, num_workers=workers)
    t = Trainer(load_workload(ref("uneven")), config, CPU)
    t.start()
    with pytest.raises(WorkloadError) as raised:
        t.step()
    said = str(raised.value)
    assert said.startswith(where + "its items differ in size") and "pad_sequence" in said and "\n" not in said, said
    t = Trainer(load_workload(ref("uneven"), {"broken": 3, "padded": True}), config, CPU)
    t.start()
    with pytest.raises(WorkloadError, match="^" + where + "ValueError: bad row 3$"):
        for _ in range(8):  # an epoch: item 3 is in one of its batches
            t.step()
    t = Trainer(load_workload(ref("uneven"), {"padded": True}), config, CPU)  # padded: it trains
    t.start()
    t.step()


@pytest.mark.slow  # compiles
def test_the_rest_of_the_workload_s_step_runs_after_each_optimizer_step_on_the_module_as_built():
    from tuner.errors import WorkloadError

    t = Trainer(load_workload(ref("linear"), {"ema": True}), _config(micro_batch_size=8, grad_accum_steps=2,
                                                                        compile="default"), CPU)
    assert t.eager_model is not t.model  # compiled: after_step gets the module as built
    t.start()
    for _ in range(3):
        t.step()
    assert t.eager_model.ema_steps == 3  # once per optimizer step, not per micro-batch
    assert [e.shape for e in t.eager_model.ema] == [p.shape for p in t.eager_model.parameters()]
    wl = load_workload(ref("linear"))
    wl.after_step = lambda model, optimizer: 1 / 0
    t = Trainer(wl, _config(micro_batch_size=8), CPU)
    t.start()
    with pytest.raises(WorkloadError, match="^workload after_step raised ZeroDivisionError: division by zero$"):
        t.step()


def test_backend_flags_the_workload_sets_while_building_give_way_to_the_knobs_on_a_gpu():
    # cudnn.benchmark and TF32 are process flags that exist without a GPU: set here as a
    # user's model factory would, then set back for a GPU config (the GPU itself is not needed)
    from tuner.apply import reassert_process_knobs

    saved = (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = False
        config = {**knobs.defaults(), "cudnn_benchmark": False, "tf32": True}
        notes = reassert_process_knobs(config, torch.device("cuda"))
        assert torch.backends.cudnn.benchmark is False and torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.backends.cudnn.allow_tf32 is True
        assert len(notes) == 2 and "cudnn.benchmark = True" in notes[0] and "allow_tf32 = False" in notes[1], notes
        assert reassert_process_knobs(config, torch.device("cuda")) == []  # as the knobs say: nothing to note
        torch.backends.cudnn.benchmark = True
        assert reassert_process_knobs(config, CPU) == []  # not a CPU config's knobs
    finally:
        (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
         torch.backends.cudnn.allow_tf32) = saved


def test_threads_the_workload_sets_in_its_step_are_said_in_the_record(restore_threads):
    from tests.helpers import FAST_MEASURE
    from tuner.trial import execute, make_request

    r = execute(make_request(workload=ref("sets_threads"), workload_args={"build": 2, "step": 1},
                             config={"micro_batch_size": 8, "torch_threads": 2}, device="cpu", measure=FAST_MEASURE))
    assert r["intra_op_threads"] == 1
    assert any("step set torch.set_num_threads(1)" in n for n in r["notes"]), r["notes"]


def test_a_debugging_switch_in_the_environment_is_said_in_the_record(monkeypatch):
    from tests.helpers import FAST_MEASURE
    from tuner.trial import execute, make_request

    monkeypatch.setenv("TORCH_COMPILE_DEBUG", "1")
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")  # a GPU run's only: not said of a CPU trial
    r = execute(make_request(workload=ref("linear"), config={"micro_batch_size": 8}, device="cpu",
                             measure=FAST_MEASURE))
    said = [n for n in r["notes"] if n.startswith("the environment sets")]
    assert len(said) == 1 and "TORCH_COMPILE_DEBUG=1" in said[0], r["notes"]


def test_compile_is_refused_where_torch_compile_is_disabled(monkeypatch):
    # torch.compile hands back the eager model there: the trial would measure eager under
    # compile's name
    from tuner.errors import KnobRefused

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    with pytest.raises(KnobRefused, match="torch.compile is disabled") as refused:
        Trainer(load_workload(ref("linear")), _config(compile="default"), CPU)
    assert refused.value.refusal == {"knob": "compile", "values": ["default"]}
    monkeypatch.delenv("TORCHDYNAMO_DISABLE")
    Trainer(load_workload(ref("linear")), _config(compile="default"), CPU)


def test_epochs_restart_and_are_timed_apart():
    t = Trainer(load_workload(ref("linear"), {"size": 32}), _config(micro_batch_size=8), CPU)
    t.start()
    for _ in range(9):  # 4 steps per epoch: crosses two epoch boundaries
        t.step()
    assert len(t.epoch_start_s) == 2
    t.set_epoch_limit(16)
    for _ in range(6):
        t.step()
    assert len(t.epoch_start_s) >= 4


@pytest.mark.parametrize("grouped", [False, True])
def test_an_epoch_shortened_late_ends_on_a_whole_round(grouped):
    # The limit is lowered after 40 samples were drawn (workers prefetch ahead): the
    # epoch ends at the next multiple of align, not at an arbitrary point of a round.
    if grouped:
        sampler = GroupedBatchSampler([list(range(200))], batch_size=4)
    else:
        sampler = EpochSampler(200)
    it = iter(sampler)
    drawn = sum(len(b) if grouped else 1 for b in itertools.islice(it, 10 if grouped else 40))
    assert drawn == 40
    sampler.limit, sampler.current, sampler.align = 24, 24, 16
    rest = sum(len(b) if grouped else 1 for b in it)
    assert drawn + rest == 48
    # the next epoch ends at the limit, itself a multiple of align here
    sampler.limit = 32
    assert sum(len(b) if grouped else 1 for b in iter(sampler)) == 32


def test_baseline_syncs_each_step_and_optimized_does_not():
    wl = load_workload(ref("linear"))
    base = Trainer(wl, _config(micro_batch_size=8), CPU, baseline=True)
    base.start()
    base.step()
    assert isinstance(base.last_loss, float)
    opt = Trainer(wl, _config(micro_batch_size=8), CPU)
    opt.start()
    opt.step()
    assert opt.last_loss is None and opt.loss_finite()


def test_by_source_batches_hold_one_source():
    wl = multisource(size=96)
    t = Trainer(wl, _config(micro_batch_size=8, batch_grouping="by_source", _groups=True), CPU)
    assert isinstance(t.loader.batch_sampler, GroupedBatchSampler)
    batches = list(t.loader)
    assert batches and all(len(b) == 1 for b in batches)
    mixed = Trainer(wl, _config(micro_batch_size=8, _groups=True), CPU)
    assert any(len(b) > 1 for b in mixed.loader)


def _padding(batches, lengths):
    """The share of the padded batches' positions that is padding."""
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1 - sum(lengths[i] for b in batches for i in b) / padded


def test_batches_grouped_by_length_pad_less_start_on_the_longest_and_hold_each_item_once():
    wl = load_workload(ref("padded"), {"size": 1024})
    lengths = wl.dataset().lengths
    t = Trainer(wl, _config(micro_batch_size=8, group_by_length=True, _lengths=True), CPU)
    assert isinstance(t.loader.batch_sampler, GroupedBatchSampler)
    first, second = list(t.loader.batch_sampler), list(t.loader.batch_sampler)
    mixed = Trainer(wl, _config(micro_batch_size=8, _lengths=True), CPU)
    order = list(mixed.loader.sampler)
    mixed_batches = [order[i:i + 8] for i in range(0, len(order) - 7, 8)]
    for epoch in (first, second):
        flat = [i for b in epoch for i in b]
        assert len(flat) == len(set(flat)) == 1024 and all(len(b) == 8 for b in epoch)
        assert _padding(epoch, lengths) < 0.1 < 0.3 < _padding(mixed_batches, lengths)
    assert max(lengths[i] for i in first[0]) == max(lengths)  # the warm-up meets the peak memory
    assert first != second  # each epoch draws anew
    # the batches come in a random order, not from the longest down
    firsts = [max(lengths[i] for i in b) for b in second]
    assert firsts != sorted(firsts, reverse=True) and firsts != sorted(firsts)
    # the loader hands the padded batches to the step: they train
    t.start()
    t.step()
    assert t.loss_finite()
    # the lengths are the workload's dataset's, where the loader reads a cache of it
    cached = Trainer(wl, _config(micro_batch_size=8, group_by_length=True, dataset_cache=True, _lengths=True), CPU)
    assert _padding(list(cached.loader.batch_sampler), lengths) < 0.1


def test_batches_by_length_come_in_pairs_that_cost_about_the_epoch_s_mean():
    # Shuffled one by one, batches of one length come in runs: a GRU's windows of 4 steps
    # read 107-420 samples/s, and the steady ones between the epochs' boundaries set a
    # figure 1.3-1.5x its whole epochs. In pairs of the k-th longest and the k-th shortest,
    # every two steps cost about the mean.
    import random
    import statistics

    from tuner.loop import balanced

    rng = random.Random(0)
    cost = [rng.randint(20, 300) for _ in range(200)]
    batches = [[i] for i in range(200)]
    mine = balanced(batches, cost, rng)
    twos = [cost[a[0]] + cost[b[0]] for a, b in zip(mine[::2], mine[1::2], strict=True)]
    shuffled = rng.sample(cost, len(cost))
    free = [a + b for a, b in zip(shuffled[::2], shuffled[1::2], strict=True)]
    assert statistics.pstdev(twos) < statistics.pstdev(free) / 4
    assert sorted(b[0] for b in mine) == list(range(200))  # every batch once
    assert mine != balanced(batches, cost, random.Random(1))  # the pairs' order is drawn


def test_the_trainer_knows_the_longest_item_of_each_batch_by_length_it_trained_on():
    # The measurement fits a window's time on the batches it ran (windows.length_fit): the
    # sampler notes each batch it draws, and the DataLoader's two workers deliver them in
    # that order, across an epoch's end.
    wl = load_workload(ref("padded"), {"size": 256})
    lengths = wl.dataset().lengths
    t = Trainer(wl, _config(micro_batch_size=8, group_by_length=True, num_workers=2, persistent_workers=True,
                            _lengths=True), CPU)
    t.start()
    at = [t.drawn_at()]
    for _ in range(40):  # 32 batches an epoch: the second epoch's first 8 among them
        t.step()
        at.append(t.drawn_at())
    drawn = t.sampler.drawn
    assert at[0] == (0, 0) and at[32] == (0, 32) and at[33] == (1, 1) and at[-1] == (1, 8)
    assert len(drawn[0]) == 32
    seen = drawn[0] + drawn[1][:8]
    assert len(seen) == 40 and max(seen) == max(lengths)
    assert all(x == max(lengths[i] for i in b) for x, b in zip(drawn[0], t.sampler._all_batches(0), strict=True))
    # every epoch may start on its longest pair (the measurement's), not the first only
    assert max(drawn[1][:2]) < max(drawn[1])
    t.sampler.longest_first_always = True
    later = list(t.sampler)
    assert max(lengths[i] for i in later[0] + later[1]) == max(lengths)
    # a whole epoch's mix: the next few epochs' (a short epoch's varies)
    mix = t.sampler.epoch_longest()
    assert len(mix) % 32 == 0 and len(mix) > 32 and max(mix) == max(lengths)


def test_the_trainer_knows_the_longest_item_of_each_batch_in_a_random_order_it_trained_on():
    # Batches not grouped by length are the sampler's random order cut in turn: after its
    # windows the measurement reads the items' lengths and finds each window's batches
    # there (the collate pads to the longest item, so a batch's width is its longest),
    # across epochs the measurement shortened, with two workers delivering them.
    wl = load_workload(ref("padded"), {"size": 256})
    lengths = wl.dataset().lengths
    t = Trainer(wl, _config(micro_batch_size=8, num_workers=2, persistent_workers=True, _lengths=True), CPU)
    widths, loss = [], t.loss_fn
    t.loss_fn = lambda model, batch: (widths.append(batch[0].shape[1]), loss(model, batch))[1]
    t.start()
    for _ in range(3):
        t.step()
    # 5 batches an epoch from here on; the epoch under way ends after the batches its
    # workers already hold (7: 3 trained, 4 prefetched)
    t.set_epoch_limit(40, now=True)
    at = [t.drawn_at()]
    for n in (4, 9):
        for _ in range(n):
            t.step()
        at.append(t.drawn_at())
    assert at == [(0, 3), (0, 7), (2, 4)] and t.epoch_micro_batches == [7, 5]
    spans = list(zip(at, at[1:], strict=False))
    got = t.longest_between(spans, [4, 9])
    assert got is not None
    windows, mix = got
    assert windows == [widths[3:7], widths[7:16]]
    assert t.longest_between(spans, [4, 8]) is None  # a count not the window's: not these batches
    # a whole epoch's mix: whole epochs of the next orders, not the shortened ones
    assert len(mix) == 8 * 32 and max(mix) == max(lengths)
    # the user's lengths that fail leave the figure unfitted; the trial goes on
    failing = load_workload(ref("padded"), {"size": 256, "lengths": "raises"})
    f = Trainer(failing, _config(micro_batch_size=8, _lengths=True), CPU)
    f.start()
    f.step()
    assert f.longest_between([(f.drawn_at(), f.drawn_at())], [0]) is None
    # without lengths nothing is known
    none = Trainer(load_workload(ref("padded"), {"size": 256, "lengths": "none"}), _config(micro_batch_size=8), CPU)
    none.start()
    none.step()
    assert none.drawn_at() is None


def test_length_grouping_keeps_sources_apart_and_ranks_disjoint():
    lengths = [i % 37 for i in range(400)]
    groups = [list(range(0, 400, 2)), list(range(1, 400, 2))]
    shards = [list(GroupedBatchSampler(groups, 4, seed=3, rank=r, world=2, lengths=lengths)) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 50
    assert not {i for b in shards[0] for i in b} & {i for b in shards[1] for i in b}
    for shard in shards:
        assert all(len({i % 2 for i in b}) == 1 for b in shard)  # one source per batch
        assert max(lengths[i] for i in shard[0]) == 36  # each rank starts on its longest
        assert _padding(shard, lengths) < 0.1


@pytest.mark.parametrize("args, config, error", [
    ({"lengths": "none"}, {"group_by_length": True}, "knob 'group_by_length=True' the workload gives no lengths"),
    ({"lengths": "short"}, {"group_by_length": True}, "Workload.lengths returned 255 lengths for a dataset of 256"),
    ({"lengths": "negative"}, {"group_by_length": True}, "Workload.lengths returned -1: each item's length"),
    ({"lengths": "raises"}, {"group_by_length": True}, "workload lengths raised KeyError"),
    ({"iterable": True}, {"group_by_length": True}, "knob 'group_by_length=True': the dataset is iterable"),
])
def test_lengths_that_cannot_group_batches_are_said_in_one_line(args, config, error):
    from tuner import apply
    from tuner.errors import UserError, WorkloadError

    wl = load_workload(ref("padded"), args)
    with pytest.raises((UserError, WorkloadError)) as got:
        ctx = apply.context_for(CPU, wl)
        Trainer(wl, knobs.resolve({"micro_batch_size": 8, **config}, ctx, strict=True)[0], CPU)
    assert error in str(got.value) and "\n" not in str(got.value)


def test_nan_loss_is_detected_without_per_step_sync():
    t = Trainer(load_workload(ref("nan_in"), {"precision_dtype": "bfloat16"}),
                _config(precision="bf16", micro_batch_size=4), CPU)
    t.start()
    t.step()
    assert t.loss_finite() is False


def test_worker_shutdown_is_charged_to_the_epoch_boundary():
    # Non-persistent workers are shut down inside the next() that ends an epoch;
    # that time belongs to the epoch boundary, not to a steady step.
    wl = load_workload(ref("slow_exit_workers"), {"exit_s": 0.4, "size": 32})
    t = Trainer(wl, _config(micro_batch_size=8, num_workers=1, persistent_workers=False), CPU)
    t.start()
    for _ in range(9):  # 4 steps per epoch: two boundaries
        t.step()
    assert len(t.epoch_start_s) == 2
    assert all(s >= 0.4 for s in t.epoch_start_s)
    steady_wait = t.data_wait_s - sum(t.epoch_start_s)
    assert steady_wait < 0.4  # the shutdowns are not in the steady steps' data wait


def test_a_loss_that_returns_more_than_the_loss_trains_on_the_loss():
    """Training code often returns ``loss, stats`` (or a Hugging Face-style mapping): the
    loop takes the loss out of it and trains exactly as on the tensor alone; a return with
    no loss in it, or per-sample losses, is one line saying what came back."""
    import dataclasses

    from tuner.errors import WorkloadError

    wl = load_workload(ref("linear"), {"lr": 1.0})
    plain = wl.loss
    shapes = {"tensor": plain, "tuple": lambda m, b: (plain(m, b), {"n": 1}),
              "dict": lambda m, b: {"loss": plain(m, b), "logits": None}}
    after = {}
    for name, loss in shapes.items():
        t = Trainer(dataclasses.replace(wl, loss=loss), _config(micro_batch_size=8), CPU, seed=0)
        t.start()
        t.step()
        after[name] = [p.detach().clone() for p in t.model.parameters()]
    for name in ("tuple", "dict"):
        for a, b in zip(after[name], after["tensor"], strict=True):
            torch.testing.assert_close(a, b)
    wrong = {"per-sample": (lambda m, b: torch.ones(8, requires_grad=True), "shape (8,): reduce it"),
             "no key": (lambda m, b: {"logits": torch.ones(1)}, "without a 'loss' key (keys: logits)"),
             "a float": (lambda m, b: (0.5, None), "a tuple whose first item is a float")}
    for name, (loss, says) in wrong.items():
        t = Trainer(dataclasses.replace(wl, loss=loss), _config(micro_batch_size=8), CPU, seed=0)
        t.start()
        with pytest.raises(WorkloadError, match=r"^workload loss returned") as err:
            t.step()
        assert says in str(err.value) and "\n" not in str(err.value), name
