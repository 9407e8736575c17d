"""The optimized training loop a trial runs, and the plain loop it is compared with.

``Trainer`` applies the knobs in one order (see ``Trainer.__init__``) and then
exposes ``step()``: one optimizer step over ``grad_accum_steps`` micro-batches.
The guides' habits are always on: ``zero_grad(set_to_none=True)``, no
``.item()`` or other host sync per step, no ``isinstance`` chains in the hot
path, tensors moved in place. ``baseline=True`` is what a plain loop does:
PyTorch's defaults and a ``loss.item()`` every step.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, IterableDataset, Sampler

from tuner import apply, knobs
from tuner.batches import Mover
from tuner.data import (
    CollateClock,
    WorkerWatch,
    device_items_refusal,
    same_items,
    workers_refused,
)
from tuner.errors import KnobRefused, UserError, WorkloadError
from tuner.workloads import Workload

perf_counter = time.perf_counter


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (CUDA); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _EpochLimit:
    """An adjustable number of samples per epoch, shared by the samplers below.

    The measurement shortens epochs so that every trial crosses epoch boundaries
    (where worker respawn and dataset reopening cost time). ``limit`` applies from
    the next epoch on; ``current`` is the epoch under way's, read at each draw (the
    DataLoader draws indices in the main process as it goes), so lowering it ends
    that epoch after the batches already sent to workers. An epoch ends on a multiple
    of ``align`` samples (whole rounds of the DataLoader's workers, see measure.py).
    """

    limit: int | None = None
    current: int | None = None
    align: int = 1

    def _ends(self, drawn: int) -> bool:
        """Whether the epoch under way ends after ``drawn`` samples."""
        return (self.current is not None and drawn > 0 and drawn >= self.current
                and drawn % self.align == 0)


class EpochSampler(_EpochLimit, Sampler[int]):
    """Random order over the dataset, with an adjustable number of samples per epoch.
    With ``world`` ranks, each rank draws its own shard of the same order (as
    ``DistributedSampler`` does), all shards of equal size."""

    def __init__(self, size: int, limit: int | None = None, seed: int = 0, rank: int = 0, world: int = 1):
        self.size, self.limit, self.current, self.epoch = size, limit, limit, 0
        self.seed, self.rank, self.world = seed, rank, world

    def __len__(self) -> int:
        per_rank = self.size // self.world
        return min(per_rank, self.limit or per_rank)

    def shard(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s order of this rank's items (the epochs begun count from 0)."""
        g = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(self.size, generator=g).tolist()
        return order[self.rank:(self.size // self.world) * self.world:self.world]

    def longest(self, lengths: Sequence[int], batch_size: int, epoch: int) -> list[int]:
        """The longest item of each batch of ``batch_size`` of epoch ``epoch``, in order (a
        DataLoader cuts the sampler's order into batches as it comes)."""
        shard = self.shard(epoch)
        return [max(map(lengths.__getitem__, shard[i:i + batch_size]))
                for i in range(0, len(shard) - batch_size + 1, batch_size)]

    def epoch_longest(self, lengths: Sequence[int], batch_size: int) -> list[int]:
        """The longest item of each batch of whole epochs, from the next few epochs' orders
        (one random epoch's batches are a draw of the mix: which long items share a batch)."""
        per_epoch = max(1, self.size // self.world // batch_size)
        epochs = max(1, min(8, 8192 // per_epoch))
        return [x for e in range(self.epoch, self.epoch + epochs) for x in self.longest(lengths, batch_size, e)]

    def __iter__(self) -> Iterator[int]:
        shard = self.shard(self.epoch)
        self.epoch += 1
        self.current = self.limit
        for i, index in enumerate(shard):
            if self._ends(i):
                return
            yield index


# group_by_length draws the items of this many batches at random, then sorts them by length
# (the Hugging Face Trainer's LengthGroupedSampler's window, ``mega_batch_mult``)
LENGTH_WINDOW_BATCHES = 50


class GroupedBatchSampler(_EpochLimit, Sampler[list[int]]):
    """Batches built per epoch, in a random order: each holds samples of one source
    (``groups``: ``batch_grouping=by_source``; None: one source, the whole dataset) and,
    with ``lengths`` (``group_by_length``), of similar length: each source's items in a
    random order, cut into windows of ``LENGTH_WINDOW_BATCHES`` batches, each window
    sorted by length and cut into batches, the batches in pairs of a long one and a short
    one (``balanced``), and the first epoch starts on the longest.
    With ``world`` ranks, each rank takes its share of the batches."""

    def __init__(self, groups: list[list[int]] | None, batch_size: int, limit: int | None = None, seed: int = 0,
                 rank: int = 0, world: int = 1, lengths: Sequence[int] | None = None, size: int = 0):
        self.groups = groups if groups is not None else [list(range(size))]
        self.batch_size, self.limit, self.current, self.lengths = batch_size, limit, limit, lengths
        self.seed, self.epoch, self.rank, self.world = seed, 0, rank, world
        # every epoch starts on its longest pair, not the first only (the measurement's:
        # its windows then hold the dearest batches, see tuner.windows.length_fit)
        self.longest_first_always = False
        # with lengths: per epoch begun, the longest item of each batch drawn, in order (the
        # DataLoader delivers them in that order, so the measurement knows what each window ran)
        self.drawn: list[list[int]] = []

    def _all_batches(self, epoch: int | None = None) -> list[list[int]]:
        epoch = self.epoch if epoch is None else epoch
        rng = random.Random(self.seed + epoch)
        bs, batches = self.batch_size, []
        for group in self.groups:
            idx = list(group)
            rng.shuffle(idx)
            if self.lengths is not None:
                window = bs * max(1, min(LENGTH_WINDOW_BATCHES, len(idx) // (4 * bs)))
                idx = [i for w in range(0, len(idx), window)
                       for i in sorted(idx[w:w + window], key=self.lengths.__getitem__, reverse=True)]
            batches += [idx[i:i + bs] for i in range(0, len(idx) - bs + 1, bs)]
        if self.lengths is not None:
            cost = [max(map(self.lengths.__getitem__, b)) for b in batches]
            return balanced(batches, cost, rng, self.rank, self.world,
                            longest_first=epoch == 0 or self.longest_first_always)
        rng.shuffle(batches)
        per_rank = len(batches) // self.world
        return batches[self.rank:per_rank * self.world:self.world]

    def whole_epoch(self) -> int:
        """Batches in an epoch of the whole dataset, this rank's (no limit)."""
        n = sum(len(g) // self.batch_size for g in self.groups)
        return 2 * (n // 2 // self.world) if self.lengths is not None else n // self.world  # balanced()'s pairs

    def epoch_longest(self) -> list[int]:
        """The longest item of each batch of whole epochs (this rank's, no limit; needs
        ``lengths``): an epoch's mix of batches, from the next few epochs' draws where
        the epochs are short (a short epoch's mix varies from one to the next: which of
        its longest items share a batch)."""
        assert self.lengths is not None
        epochs = max(1, min(8, 8192 // max(1, self.whole_epoch())))
        return [max(map(self.lengths.__getitem__, b))
                for e in range(self.epoch, self.epoch + epochs) for b in self._all_batches(e)]

    def __len__(self) -> int:
        n = self.whole_epoch()
        return n if self.limit is None else min(n, max(1, self.limit // self.batch_size))

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._all_batches()
        self.epoch += 1
        self.current = self.limit
        drawn: list[int] = []
        if self.lengths is not None:
            self.drawn.append(drawn)
        for i, batch in enumerate(batches):
            if self._ends(i * self.batch_size):
                return
            if self.lengths is not None:
                drawn.append(max(map(self.lengths.__getitem__, batch)))
            yield batch


def balanced(batches: list[list[int]], cost: list[int], rng: random.Random, rank: int = 0, world: int = 1,
             longest_first: bool = False) -> list[list[int]]:
    """Rank ``rank``'s share of ``batches`` (of ``world``), in pairs of a long batch and a
    short one (the longest with the shortest, the second longest with the second
    shortest...: pairs that cost about alike), the pairs in a random order. Shuffled one by
    one, batches of one length cost alike and come in runs of long ones or of short ones:
    a few seconds of steps then read a rate of their own, not the epoch's. In pairs, every
    two steps cost about the epoch's mean, for a measurement as for a progress bar; and the
    ranks, dealt whole pairs in turn, step long batches at once (none waits on another's).
    ``longest_first``: each rank starts on its pair that holds its longest batch, as the
    Hugging Face sampler does: the warm-up meets the run's peak memory, so a config that
    cannot hold its longest batch fails there, not hours into the user's run. An odd
    batch out and the pairs left after the ranks' equal shares are left out."""
    order = sorted(range(len(batches)), key=cost.__getitem__)
    pairs = [(order[-1 - k], order[k]) for k in range(len(order) // 2)]
    rng.shuffle(pairs)
    mine = pairs[rank:len(pairs) // world * world:world]
    if longest_first and mine:
        top = max(range(len(mine)), key=lambda p: cost[mine[p][0]])
        mine.insert(0, mine.pop(top))
    return [batches[b] for pair in mine for b in pair]


def item_lengths(workload: Workload, dataset: Any) -> list[int]:
    """``Workload.lengths`` of ``dataset``, checked: one non-negative whole number per item
    (a ``UserError`` naming it otherwise)."""
    got = _call(lambda: workload.lengths(dataset), "lengths")
    got = got.tolist() if callable(getattr(got, "tolist", None)) else got  # a tensor or an array
    try:
        lengths = [int(n) for n in got]
        bad = next((was for n, was in zip(lengths, got, strict=True) if n < 0 or n != was), None)
    except (TypeError, ValueError):
        raise UserError(f"Workload.lengths returned {type(got).__name__}: return one whole number per item "
                        f"(a list, or a 1-D tensor)") from None
    if len(lengths) != len(dataset):
        raise UserError(f"Workload.lengths returned {len(lengths)} lengths for a dataset of {len(dataset)} items: "
                        f"return one per item")
    if bad is not None:
        raise UserError(f"Workload.lengths returned {bad!r}: each item's length is a whole number >= 0")
    return lengths


class Trainer:
    """One workload trained under one knob config.

    >>> t = Trainer(workload, config, torch.device("cpu"))
    >>> t.step()  # one optimizer step
    """

    def __init__(self, workload: Workload, config: dict, device: torch.device, *,
                 baseline: bool = False, seed: int = 0):
        self.workload, self.config, self.device, self.baseline = workload, config, device, baseline
        self.accum = config["grad_accum_steps"]
        self.samples_per_step = config["micro_batch_size"] * self.accum  # per rank
        # batches by length cost several-fold apart (a few of them can take much of an epoch)
        self.by_length = bool(config["group_by_length"])
        # micro-batches that cost about the epoch's mean together (``balanced``'s pairs)
        self.batch_round = 2 if self.by_length else 1
        self.rank, self.world = _ranks(config["world_size"])
        self.notes: list[str] = []  # what the Trainer decided on its own (find_unused_parameters)
        torch.manual_seed(seed)
        if config["num_workers"] and (why := workers_refused()):  # before the model and data are built
            raise KnobRefused(f"knob 'num_workers={config['num_workers']}': {why}", "num_workers", at_least=1)

        # The order matters:
        # 1. threads, the allocator and backend flags before any kernel runs;
        apply.apply_threads(config["torch_threads"])
        apply.apply_malloc_retain(config["malloc_retain"])
        apply.apply_backend_flags(device, config["cudnn_benchmark"], config["tf32"])
        # 2. the model on its device, then its memory format (weights must exist there);
        model, compiled = apply.uncompiled(_call(workload.model, "model"))
        self.notes += [compiled] if compiled else []
        self.notes += getattr(model, "tuner_notes", [])  # what a framework's adapter says of the model
        self.half_params = apply.half_parameters(model)
        if self.half_params:
            self.notes.append(f"the model's parameters are {self.half_params} as the workload builds them: the "
                              f"precision knob's autocast runs the same {self.half_params} ops, so its values differ "
                              f"little, and precision=fp32 is not an fp32 training here")
        model = model.to(device)
        model = apply.apply_channels_last(model, config["channels_last"])
        # 3. checkpointing wraps the eager blocks, before compile traces them
        #    (as torchtitan does: compile after activation checkpointing);
        self.checkpointed_blocks = apply.apply_activation_checkpointing(model, config["activation_checkpointing"])
        if config["activation_checkpointing"] and self.checkpointed_blocks == 0:
            raise KnobRefused("knob 'activation_checkpointing': the model has no ModuleList or "
                              "Sequential blocks to checkpoint", "activation_checkpointing", values=[True])
        model.train()
        # 4. the optimizer holds the eager module's parameters (compile shares them);
        self.optimizer = apply.apply_fused_optimizer(
            _call(lambda: workload.make_optimizer(model), "optimizer"),
            config["fused_optimizer"], model)
        # the workload's gradient clipping, over the eager module's parameters, and the
        # rest of its optimizer step (after_step), given the module as built
        self.eager_model, self.after_step = model, workload.after_step
        self.clip = workload.clip_grad_norm
        self.clip_params = list(model.parameters()) if self.clip is not None else []
        self.autocast = apply.autocast_context(device, config["precision"])
        self.scaler = apply.grad_scaler(device, config["precision"])
        self.move = Mover(device, non_blocking=config["non_blocking"] and device.type == "cuda",
                          channels_last=config["channels_last"])
        self.loss_fn = workload.loss
        self.dataset = _call(workload.dataset, "dataset")
        if isinstance(self.dataset, DataLoader):  # a training script's data is often its loader
            raise WorkloadError("workload dataset is a DataLoader: give its dataset (loader.dataset), and its "
                                "collate_fn as Workload(collate=...) where it has its own; the tuner builds the "
                                "DataLoader, whose batch size, workers, prefetch and pinning are the knobs")
        if refused := device_items_refusal(self.dataset, config["num_workers"], config["pin_memory"]):
            raise refused
        # 4b. the dataset's items read once, into memory the loader's workers share (before
        #     the loader: the workers it starts read the cache, not the dataset);
        self.cache_fill_s: float | None = None
        self.own_dataset = self.dataset  # what Workload.groups and .lengths are asked of, cached or not
        if config["dataset_cache"]:
            self.dataset = apply.apply_dataset_cache(self.dataset, config["num_workers"])
            self.cache_fill_s = self.dataset.fill_s
        # what the workload's own building code set of the process-wide knobs, set back
        self.notes += apply.reassert_process_knobs(config, device) + apply.process_settings_notes(device)
        # and the workload's per-batch augment, in the workers' collate or on the device
        self.augment_on_device = workload.augment is not None and config["augment_on"] == "device"
        self.collate = workload.collate
        if workload.augment is not None and not self.augment_on_device:
            self.collate = AugmentedCollate(workload.collate, workload.augment)
        # 5. data parallel: DDP over the eager module, after a probe step that finds
        #    parameters the loss does not reach (DDP then needs find_unused_parameters);
        self.ddp = None
        if self.world > 1:
            unused = self._unused_parameters(model)
            if unused:
                self.notes.append(f"find_unused_parameters turned on: {len(unused)} parameters get no "
                                  f"gradient ({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''})")
            model = self.ddp = apply.apply_ddp(model, config, device, find_unused_parameters=bool(unused))
        self.no_sync = self.ddp is not None and config["ddp_no_sync_accumulation"] and self.accum > 1
        # 6. compile last, over the final module.
        self.model = apply.apply_compile(model, config["compile"])
        self.loader, self.sampler = self._make_loader(seed)
        if self.world > 1 and self.sampler is None:
            self.notes.append("the dataset is iterable: every rank reads all of it unless it shards "
                              "itself by rank (torch.distributed.get_rank())")
        self._it: Iterator | None = None
        self._refreeze = False  # gc_freeze: set when the loop starts
        # Accounting read by tuner.measure; plain floats and ints, no syncs.
        self.data_wait_s = 0.0      # time blocked in next(loader), epoch boundaries included
        # Each epoch boundary: from the next() that ends an epoch (where PyTorch shuts
        # non-persistent workers down) to the first batch of the next one (workers
        # respawned, datasets reopened, the prefetch pipeline refilled).
        self.epoch_start_s: list[float] = []
        # Micro-batches of each epoch that ended: an iterable dataset's epoch is as long as
        # it runs, which only its end tells.
        self.epoch_micro_batches: list[int] = []
        self._in_epoch = 0
        self.micro_batches = 0
        self.loss_sum = torch.zeros((), device=device)
        self.last_loss: float | None = None

    def _unused_parameters(self, model: torch.nn.Module) -> list[str]:
        """Names of trainable parameters that one forward/backward on a first batch
        leaves without a gradient (the gradients are then cleared)."""
        probe = DataLoader(self.dataset, batch_size=self.config["micro_batch_size"],
                           collate_fn=self.workload.collate)
        batch = self.move(next(iter(probe)))
        with self.autocast():
            loss = self.loss_fn(model, batch)
        loss.float().backward()
        unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        model.zero_grad(set_to_none=True)
        return unused

    def _make_loader(self, seed: int) -> tuple[DataLoader, Sampler | None]:
        cfg, ds = self.config, self.dataset
        kwargs = knobs.loader_kwargs(cfg, self.device.type)
        # the collate times itself in whichever process runs it (the record's collate_s_per_sample)
        collate = self.collate_clock = CollateClock(self.collate, cfg["num_workers"])
        # the workers time their own full garbage collections (the record's workers_gc_share) and
        # give their ids, for their heaps (workers_memory_growth_mb)
        self.worker_watch = WorkerWatch(cfg["num_workers"]) if cfg["num_workers"] else None
        if self.worker_watch is not None:
            kwargs["worker_init_fn"] = self.worker_watch
        bs = cfg["micro_batch_size"]
        if isinstance(ds, IterableDataset) or not hasattr(ds, "__len__"):
            if cfg["group_by_length"]:
                raise KnobRefused("knob 'group_by_length=True': the dataset is iterable, so its stream orders its "
                                  "items (a map-style dataset is batched by length)", "group_by_length",
                                  values=[True])
            return DataLoader(ds, batch_size=bs, drop_last=True, collate_fn=collate, **kwargs), None
        if len(ds) < bs:
            raise KnobRefused(f"knob 'micro_batch_size={bs}' is larger than the dataset ({len(ds)} samples)",
                              "micro_batch_size", at_least=bs)
        if cfg["batch_grouping"] == "by_source" or cfg["group_by_length"]:
            own = self.own_dataset
            groups = (_call(lambda: self.workload.groups(own), "groups") if cfg["batch_grouping"] == "by_source"
                      else None)
            lengths = item_lengths(self.workload, own) if cfg["group_by_length"] else None
            sampler = GroupedBatchSampler(groups, bs, seed=seed, rank=self.rank, world=self.world, lengths=lengths,
                                          size=len(ds))
            if len(sampler) == 0:
                raise UserError(f"knob 'micro_batch_size={bs}' is larger than every source of the dataset"
                                if groups is not None else f"knob 'micro_batch_size={bs}' is larger than a rank's "
                                f"share of the dataset ({len(ds) // self.world} samples)")
            return DataLoader(ds, batch_sampler=sampler, collate_fn=collate, **kwargs), sampler
        if len(ds) // self.world < bs:
            raise UserError(f"knob 'micro_batch_size={bs}' is larger than a rank's shard of the dataset "
                            f"({len(ds) // self.world} samples)")
        sampler = EpochSampler(len(ds), seed=seed, rank=self.rank, world=self.world)
        loader = DataLoader(ds, batch_size=bs, sampler=sampler, drop_last=True, collate_fn=collate, **kwargs)
        return loader, sampler

    def set_epoch_limit(self, samples: int | None, now: bool = False, align: int = 1) -> None:
        """Samples per epoch from the next epoch on (None: the whole dataset); ``now``:
        for the epoch under way too, which ends there if it is already past it, on the
        next multiple of ``align`` samples."""
        if self.sampler is not None:
            self.sampler.limit, self.sampler.align = samples, align
            if now:
                self.sampler.current = samples

    def _new_epoch(self, t0: float) -> tuple[Any, float]:
        """The epoch ended in a next() that began at ``t0``: start the next epoch.

        Returns its first batch and the seconds spent waiting for queued device work,
        which belong to the steps before, not to the epoch boundary nor to data wait.
        """
        s0 = perf_counter()
        synchronize(self.device)
        sync_s = perf_counter() - s0
        self.epoch_micro_batches.append(self._in_epoch)
        self._in_epoch = 0
        self._it = iter(self.loader)
        try:
            batch = next(self._it)
        except StopIteration:
            raise UserError("the dataset yields no full batch; lower micro_batch_size") from None
        except Exception as exc:
            _raise_data_error(exc)
        self.epoch_start_s.append(perf_counter() - t0 - sync_s)
        return batch, sync_s

    def drawn_at(self) -> tuple[int, int] | None:
        """Where the training is in the batches drawn: the epoch's index (of the epochs
        begun) and its micro-batches trained on; None where the batches' lengths are not to
        be known (no ``Workload.lengths``, batches by source alone, an iterable dataset)."""
        s = self.sampler
        if isinstance(s, GroupedBatchSampler) and s.lengths is not None and s.drawn:
            return len(s.drawn) - 1, self._in_epoch
        if isinstance(s, EpochSampler) and self.workload.lengths is not None and s.epoch:
            return s.epoch - 1, self._in_epoch
        return None

    def longest_between(self, spans: list[tuple[tuple[int, int], tuple[int, int]]],
                        counts: list[int]) -> tuple[list[list[int]], list[int]] | None:
        """The longest item of each batch trained on between each pair of ``drawn_at``
        points, and of each batch of a whole epoch's mix; None where a span's count of
        batches is not the window's (``counts``: the batches' order was not the sampler's),
        or the items' lengths cannot be read.

        Batches by length were noted as they were drawn (``GroupedBatchSampler.drawn``).
        Other batches are the sampler's order cut in turn, so the items' lengths are read
        here, after the timed windows (``Workload.lengths`` may read a dataset's column: a
        config that does not group by length does not read them in the user's run)."""
        s = self.sampler
        if isinstance(s, GroupedBatchSampler):
            drawn: Any = s.drawn
            mix = s.epoch_longest
        else:
            try:
                lengths = item_lengths(self.workload, self.own_dataset)
            except (UserError, WorkloadError):
                return None  # the user's lengths, never asked for by this config: no fit, not a failed trial
            bs, ended = self.config["micro_batch_size"], self.epoch_micro_batches
            # an epoch the measurement shortened ended where its batches trained did
            drawn = {e: s.longest(lengths, bs, e)[:ended[e] if e < len(ended) else None]
                     for (e0, _), (e1, _) in spans for e in range(e0, e1 + 1)}
            mix = lambda: s.epoch_longest(lengths, bs)  # noqa: E731
        out = []
        for ((e0, p0), (e1, p1)), n in zip(spans, counts, strict=True):
            got = drawn[e0][p0:p1] if e0 == e1 else [
                *drawn[e0][p0:], *(x for e in range(e0 + 1, e1) for x in drawn[e]), *drawn[e1][:p1]]
            if len(got) != n:
                return None
            out.append(got)
        return out, mix()

    def feed(self, batches: list) -> None:
        """Train on these batches, already in memory, over and over: no data loading at all
        (for the compute-only ceiling). Batches are moved to the device once, here."""
        import itertools

        moved = [self.move(b) for b in batches]
        self._it = itertools.cycle(moved)

    def start(self, on_first_batch: Callable[[], None] | None = None) -> None:
        """Start the first epoch (DataLoader workers are spawned here): a one-time cost.
        ``on_first_batch``: called once the first batch has come (the first step's wait
        for data is over; its compute, compile included, follows)."""
        # the objects of the build frozen last, before the loader forks its workers
        apply.apply_gc_freeze(self.config["gc_freeze"])
        self._refreeze = self.config["gc_freeze"]
        self._it = iter(self.loader)
        self._in_epoch = 0
        workers = self.config["num_workers"]
        if isinstance(self.dataset, IterableDataset) and workers >= 2:
            self._it = _WorkerRepeatCheck(self, self._it, workers)
        if on_first_batch is not None:
            self._it = _FirstBatch(self, self._it, on_first_batch)

    def step(self) -> None:
        """One optimizer step over ``grad_accum_steps`` micro-batches."""
        for i in range(self.accum):
            t0 = perf_counter()
            try:
                batch = next(self._it)
            except StopIteration:
                batch, sync_s = self._new_epoch(t0)
                t0 += sync_s
            except Exception as exc:
                _raise_data_error(exc)
            self.data_wait_s += perf_counter() - t0
            self._in_epoch += 1
            # The batch and the loss live until the step returns, as in a framework's
            # training step (Hugging Face's, Lightning's) and the exported script's step():
            # when they are freed decides how glibc's malloc trims and re-faults the heap
            # on a CPU. Held until the next step instead, as an inline `for batch in
            # loader:` body holds them, the heap faults differently and the rate moves with
            # it (malloc_retain removes the difference).
            batch = self.move(batch)
            if self.augment_on_device:
                try:
                    batch = self.workload.augment(batch)
                except Exception as exc:
                    _raise_as_workload_error(exc, "augment")
            # DDP all-reduces in every backward unless told not to: with no_sync, only the
            # accumulation step's last micro-batch does.
            with self.ddp.no_sync() if self.no_sync and i < self.accum - 1 else _NO_CONTEXT:
                try:  # free in the hot path (3.11's zero-cost exceptions)
                    with self.autocast():
                        loss = self.loss_fn(self.model, batch)
                except Exception as exc:
                    _raise_as_workload_error(exc, "loss")
                if self.accum > 1:
                    loss = loss / self.accum  # gradients equal to one large batch's
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                else:
                    loss.backward()
            self.loss_sum += loss.detach()
        self.micro_batches += self.accum
        if self.clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(self.clip_params, self.clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.after_step is not None:
            try:
                self.after_step(self.eager_model, self.optimizer)
            except Exception as exc:
                _raise_as_workload_error(exc, "after_step")
        if self.baseline:
            self.last_loss = loss.item()  # what a plain loop does to log: a host sync per step
        if self._refreeze:  # gc_freeze: the first step's objects too (compile's graphs, the optimizer's state)
            self._refreeze = False
            apply.apply_gc_freeze(True)

    def loss_finite(self) -> bool:
        """Whether every loss so far was finite (one host sync; call at window edges)."""
        return bool(torch.isfinite(self.loss_sum).item())


_NO_CONTEXT = contextlib.nullcontext()


class AugmentedCollate:
    """The workload's collate (PyTorch's default where it has none), then its augment: the
    host placement of ``augment_on``, in the DataLoader's workers. A class, so that
    spawned workers can unpickle it."""

    def __init__(self, collate: Callable[[list], Any] | None, augment: Callable[[Any], Any]):
        self.collate, self.augment = collate, augment

    def __call__(self, items: list) -> Any:
        from torch.utils.data import default_collate

        return self.augment((self.collate or default_collate)(items))


def _ranks(world_size: int) -> tuple[int, int]:
    """(rank, world) of this process: (0, 1) for one rank; for several, the process
    group Ray Train started, which must have world_size processes."""
    if world_size == 1:
        return 0, 1
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise UserError(f"knob 'world_size={world_size}': several ranks run through Ray Train "
                        "(tuner run, or bench with Ray); this process has no process group")
    if dist.get_world_size() != world_size:
        raise UserError(f"knob 'world_size={world_size}': the process group has {dist.get_world_size()} ranks")
    return dist.get_rank(), world_size


# What collating items of different sizes raises: PyTorch's default collate stacks them
# (in the main process), or stacks them into a shared-memory tensor sized from the first
# (in a DataLoader worker).
_UNEVEN = ("stack expects each tensor to be equal size", "Trying to resize storage that is not resizable")


# Raised as they are, not as the workload's error: a refusal (the message is already the
# tuner's), an OOM (the search records it as one).
_PASS = (torch.OutOfMemoryError, UserError, WorkloadError)


def _raise_data_error(exc: Exception) -> NoReturn:
    """Raise what the workload's data raised while a batch was made (its dataset's
    ``__getitem__`` or its collate, in this process or a DataLoader worker) as one line
    that says so, with the original message of a worker's error and the fix for items of
    different sizes. Refusals, OOMs and shared-memory failures are raised as they are."""
    said = str(exc)
    if isinstance(exc, _PASS) or "shared memory" in said.lower():
        raise exc
    lines = [ln.strip() for ln in said.strip().splitlines() if ln.strip()]
    # a worker's error comes back as text, its original message last (its type in it)
    text = lines[-1] if "Original Traceback" in said and lines else \
        f"{type(exc).__name__}: {lines[0] if lines else ''}"
    where = " in a DataLoader worker" if "DataLoader worker" in said else ""
    if any(u in said for u in _UNEVEN):
        raise WorkloadError(f"workload data raised{where}: its items differ in size ({text}), which PyTorch's "
                            f"default collate cannot stack: give Workload(collate=...) that pads them "
                            f"(torch.nn.utils.rnn.pad_sequence)") from exc
    raise WorkloadError(f"workload data raised{where}: {text}") from exc


def _raise_as_workload_error(exc: Exception, what: str) -> NoReturn:
    """Raise what the user's ``what`` (its loss, augment, after_step) raised as one line
    that says so; an OOM, a refusal or a compile failure is raised as it is."""
    if isinstance(exc, _PASS) or (type(exc).__module__ or "").startswith(("torch._dynamo", "torch._inductor")):
        raise exc
    raise WorkloadError(f"workload {what} raised {type(exc).__name__}: {exc}") from exc


def _call(fn: Any, what: str) -> Any:
    try:
        return fn()
    except (UserError, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        raise WorkloadError(f"workload {what} raised {type(exc).__name__}: {exc}") from exc


class _WorkerRepeatCheck:
    """The first epoch's iterator of an iterable dataset read by ``workers`` >= 2, until it
    tells whether every worker yields the whole stream (as ``tuner.data.workers_repeat``:
    batches 0 and 1, the first of workers 0 and 1 in the loader's round-robin order, are
    the same, and batch ``workers``, worker 0's second, differs): the config would then train each item
    ``workers`` times an epoch, and its figure would not be the user's training. Then the
    trainer gets the plain iterator back."""

    def __init__(self, trainer: Trainer, inner: Any, workers: int):
        self.trainer, self.inner, self.workers = trainer, inner, workers
        self.seen = 0
        self.first: Any = None

    def __next__(self) -> Any:
        batch = next(self.inner)
        j, self.seen = self.seen, self.seen + 1
        if j == 0:  # a copy: the step may change its batch in place
            self.first = pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, batch)
        elif j == 1 and not same_items(self.first, batch):
            self._done()
        elif j == self.workers:
            if not same_items(self.first, batch):  # workers 0 and 1 began alike, and the stream moves on
                raise KnobRefused(f"knob 'num_workers={self.workers}': every DataLoader worker yields the whole "
                                  f"iterable dataset (it does not split its stream by "
                                  f"torch.utils.data.get_worker_info()), so each item would be trained "
                                  f"{self.workers} times an epoch; split it per worker, or keep num_workers to 0 or 1",
                                  "num_workers", at_least=2)
            self._done()
        return batch

    def _done(self) -> None:
        self.first = None
        if self.trainer._it is self:
            self.trainer._it = self.inner


class _FirstBatch:
    """The first epoch's iterator until its first batch comes: then the trainer gets the
    plain iterator back (nothing of this stays in the hot path) and ``then`` is called."""

    def __init__(self, trainer: Trainer, inner: Any, then: Callable[[], None]):
        self.trainer, self.inner, self.then = trainer, inner, then

    def __next__(self) -> Any:
        batch = next(self.inner)
        self.trainer._it = self.inner
        self.then()
        return batch
