"""Train with the config tuner chose, in a plain PyTorch loop.

    python train_tuned.py               # one epoch
    python train_tuned.py --steps 50    # time 50 optimizer steps after a warm-up; print samples/sec
    torchrun --nproc_per_node N train_tuned.py   # when the config's world_size is N > 1

Written by `tuner export --format python`; the CONFIG below is the exported config.
"""

import argparse
import contextlib
import gc
import importlib
import importlib.util
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

WORKLOAD = None  # "file.py:make", "pkg.module:make" or a built-in name
WORKLOAD_ARGS = {}
BASE_DIR = None  # where a relative workload file lives (the space file's folder)
DEVICE = "cpu"
CONFIG = {}
FIND_UNUSED = False  # DDP's find_unused_parameters: the tuner turns it on where the model needs it
BUILTIN = {"conv": "tuner.workloads.builtin:conv", "transformer": "tuner.workloads.builtin:transformer",
           "multisource": "tuner.workloads.builtin:multisource", "files": "tuner.workloads.builtin:files"}


def load_factory():
    """Your workload function, as the space file names it."""
    ref = BUILTIN.get(WORKLOAD, WORKLOAD)
    target, name = ref.rsplit(":", 1)
    if target.endswith(".py"):
        path = Path(target) if Path(target).is_absolute() else Path(BASE_DIR) / target
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module  # DataLoader workers unpickle classes from it
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    return getattr(module, name)


def move(batch, device, non_blocking, channels_last):
    """Every tensor of the batch to the device (dicts, tuples, lists, namedtuples)."""
    if torch.is_tensor(batch):
        if channels_last and batch.dim() == 4:
            return batch.to(device, non_blocking=non_blocking, memory_format=torch.channels_last)
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return type(batch)({k: move(v, device, non_blocking, channels_last) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move(v, device, non_blocking, channels_last) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move(v, device, non_blocking, channels_last) for v in batch)
    return batch


class Batches(torch.utils.data.Sampler):
    """batch_grouping=by_source: each batch holds samples of one source (groups);
    group_by_length: of similar length (lengths): the items of 50 batches drawn at random,
    sorted by length and cut into batches; the batches then come in pairs of a long one
    and a short one (every two steps cost about the epoch's mean), the pairs in a random
    order, each rank taking whole pairs in turn, and the first epoch starting on the
    longest (its peak memory shows at once). Without lengths the batches' order is random;
    with several ranks each takes its share."""

    def __init__(self, groups, lengths, batch_size, rank=0, world=1, seed=0):
        self.groups, self.lengths, self.batch_size = groups, lengths, batch_size
        self.rank, self.world, self.seed, self.epoch = rank, world, seed, 0

    def __len__(self):
        n = sum(len(g) // self.batch_size for g in self.groups)
        return 2 * (n // 2 // self.world) if self.lengths is not None else n // self.world

    def __iter__(self):
        rng, bs, batches = random.Random(self.seed + self.epoch), self.batch_size, []
        for g in self.groups:
            g = rng.sample(g, len(g))
            if self.lengths is not None:
                window = bs * max(1, min(50, len(g) // (4 * bs)))
                g = [i for w in range(0, len(g), window)
                     for i in sorted(g[w:w + window], key=self.lengths.__getitem__, reverse=True)]
            batches += [g[i:i + bs] for i in range(0, len(g) - bs + 1, bs)]
        first, self.epoch = self.epoch == 0, self.epoch + 1
        if self.lengths is None:
            rng.shuffle(batches)
            per_rank = len(batches) // self.world
            return iter(batches[self.rank:per_rank * self.world:self.world])
        cost = [max(self.lengths[i] for i in b) for b in batches]
        order = sorted(range(len(batches)), key=cost.__getitem__)
        pairs = [(order[-1 - k], order[k]) for k in range(len(order) // 2)]
        rng.shuffle(pairs)
        mine = pairs[self.rank:len(pairs) // self.world * self.world:self.world]
        if first and mine:  # the peak memory first, not hours in
            mine.insert(0, mine.pop(max(range(len(mine)), key=lambda p: cost[mine[p][0]])))
        return iter([batches[b] for pair in mine for b in pair])


def main():
    ap = argparse.ArgumentParser(description="train with the exported config")
    ap.add_argument("--steps", type=int, help="time this many optimizer steps (after 5 warm-up steps)")
    ap.add_argument("--epochs", type=int, default=1)
    a = ap.parse_args()
    c = CONFIG
    device = torch.device(DEVICE)
    world = c.get("world_size", 1)
    if world > 1:  # data parallel: one process per rank, started by torchrun
        import os

        if int(os.environ.get("WORLD_SIZE", 1)) != world:
            sys.exit(f"world_size={world}: run with torchrun --nproc_per_node {world} {sys.argv[0]}")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
    try:
        train(a, c, device, world)
        if world > 1:
            dist.barrier()  # every rank done with its collectives before the group goes
    finally:
        # A process group, or a DDP model, left to the interpreter's exit can abort a
        # rank after it trained ("terminate called without an active exception": gloo's
        # threads still hold work that refers to Python objects being torn down), and
        # torchrun then marks the whole job failed. The model's reducer and a comm
        # hook's futures sit in reference cycles: collected here, then the group goes.
        gc.collect()
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def train(a, c, device, world):
    process_settings(c, device)
    wl = load_factory()(**WORKLOAD_ARGS)
    model, ddp, opt = build_model(wl, c, device, world)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(c["precision"])
    scaler = torch.amp.GradScaler(device.type) if c["precision"] == "fp16" else None
    params = [p for g in opt.param_groups for p in g["params"]]  # the eager module's, for clipping
    eager = ddp.module if ddp is not None else getattr(model, "_orig_mod", model)  # the module as built
    loader = make_loader(wl, c, device, world)
    accum = c["grad_accum_steps"]
    non_blocking = c["non_blocking"] and device.type == "cuda"
    on_device = getattr(wl, "augment", None) if c.get("augment_on") == "device" else None

    def batches():
        for epoch in range(a.epochs if a.steps is None else 10**9):  # --steps: as many epochs as it takes
            if hasattr(loader.sampler, "set_epoch"):
                loader.sampler.set_epoch(epoch)  # DistributedSampler: a new order each epoch
            yield from loader

    if c["gc_freeze"]:  # the build's objects out of the collector's reach, before the workers fork
        gc.collect()
        gc.freeze()
    it = batches()
    refreeze = c["gc_freeze"]

    def step():
        """One optimizer step over `accum` micro-batches (StopIteration when the epochs end)."""
        nonlocal refreeze
        for i in range(accum):
            batch = move(next(it), device, non_blocking, c["channels_last"])
            if on_device is not None:
                batch = on_device(batch)  # augment_on: device
            # with ddp_no_sync_accumulation, only the last micro-batch all-reduces
            quiet = ddp is not None and c["ddp_no_sync_accumulation"] and i < accum - 1
            with ddp.no_sync() if quiet else contextlib.nullcontext():
                with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                    loss = wl.loss(model, batch)
                loss = loss / accum if accum > 1 else loss
                (scaler.scale(loss) if scaler else loss).backward()
        if wl.clip_grad_norm is not None:  # the workload's gradient clipping
            if scaler:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, wl.clip_grad_norm)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)  # no loss.item() per step: it waits for the device
        if wl.after_step is not None:  # the rest of the workload's step (an EMA, a scheduler)
            wl.after_step(eager, opt)
        if refreeze:  # gc_freeze: the first step's objects too (compile's graphs, the optimizer's state)
            refreeze = False
            gc.collect()
            gc.freeze()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    try:
        run_steps(a, step, sync, c["micro_batch_size"], accum, world, device)
    finally:
        # DataLoader workers shut down before the process group goes (persistent ones
        # are held by the loader, not by the generator)
        it.close()
        if getattr(loader, "_iterator", None) is not None:
            loader._iterator._shutdown_workers()


def process_settings(c, device):
    """Threads, the allocator and backend flags: before any kernel runs."""
    if c["torch_threads"]:
        torch.set_num_threads(c["torch_threads"])
    if c["malloc_retain"]:  # glibc keeps freed memory for the next step
        import ctypes
        import os

        # M_MMAP_THRESHOLD 1 GiB, M_TRIM_THRESHOLD never: the same as starting Python with
        # MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=18446744073709551615
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 1 << 30)
        libc.mallopt(-1, -1)
        os.environ.update(MALLOC_MMAP_THRESHOLD_=str(1 << 30), MALLOC_TRIM_THRESHOLD_=str(2**64 - 1))
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = c["cudnn_benchmark"]
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = c["tf32"]


def build_model(wl, c, device, world):
    """The model on its device, its memory format, checkpointing, the optimizer over the
    eager module, DDP, then compile over the final module."""
    from tuner.apply import apply_fused_optimizer, uncompiled

    model = uncompiled(wl.model())[0].to(device)  # its own torch.compile undone, as in the trials
    if c["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    if c["activation_checkpointing"]:
        from torch.utils.checkpoint import checkpoint

        for blocks in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
            for block in blocks:
                block.forward = (lambda f: lambda *x, **k: checkpoint(f, *x, use_reentrant=False, **k))(block.forward)
    model.train()
    opt = wl.make_optimizer(model)  # the workload's optimizer (AdamW without one), as in the tuner's trials
    # fused_optimizer: the same optimizer, parameter groups and hyperparameters, fused kernels
    opt = apply_fused_optimizer(opt, c["fused_optimizer"], model)
    ddp = None
    if world > 1:  # DDP before compile, as PyTorch's docs ask
        from torch.nn.parallel import DistributedDataParallel

        ddp = model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=c["ddp_bucket_cap_mb"], gradient_as_bucket_view=c["ddp_gradient_as_bucket_view"],
            static_graph=c["ddp_static_graph"], find_unused_parameters=FIND_UNUSED)
        if c["ddp_comm_hook"] != "none":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, getattr(default_hooks, c["ddp_comm_hook"] + "_hook"))
    if c["compile"] != "off":
        model = torch.compile(model, mode=None if c["compile"] == "default" else c["compile"])
    return model, ddp, opt


class Augmented:
    """The collate, then the workload's per-batch augment (augment_on: host), in the workers."""

    def __init__(self, collate, augment):
        self.collate, self.augment = collate or torch.utils.data.default_collate, augment

    def __call__(self, items):
        return self.augment(self.collate(items))


def make_loader(wl, c, device, world):
    dataset = own = wl.dataset()  # own: what the workload's groups and lengths read
    if c.get("dataset_cache"):
        # items read once (the first read is paid here, up front), then served from memory
        # the DataLoader's workers share
        from tuner.data import cached

        dataset = cached(dataset, workers=c["num_workers"])
    collate = wl.collate
    if getattr(wl, "augment", None) is not None and c.get("augment_on", "host") == "host":
        collate = Augmented(wl.collate, wl.augment)
    kw = {"num_workers": c["num_workers"], "collate_fn": collate}
    if c["num_workers"] > 0:
        kw["persistent_workers"] = c["persistent_workers"]
        if c["prefetch_factor"]:
            kw["prefetch_factor"] = c["prefetch_factor"]
    if device.type == "cuda":
        kw["pin_memory"] = c["pin_memory"]
    bs = c["micro_batch_size"]
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        # a stream orders its own items (and splits them among the workers): no sampler
        loader = torch.utils.data.DataLoader(dataset, batch_size=bs, drop_last=True, **kw)
    elif (c["batch_grouping"] == "by_source" and wl.groups) or (c.get("group_by_length") and wl.lengths):
        groups = wl.groups(own) if c["batch_grouping"] == "by_source" else [list(range(len(dataset)))]
        lengths = [int(n) for n in wl.lengths(own)] if c.get("group_by_length") else None
        rank = dist.get_rank() if world > 1 else 0
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=Batches(groups, lengths, bs, rank, world), **kw)
    elif world > 1:  # each rank its own shard
        sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, drop_last=True)
        loader = torch.utils.data.DataLoader(dataset, batch_size=bs, sampler=sampler, drop_last=True, **kw)
    else:
        loader = torch.utils.data.DataLoader(dataset, batch_size=bs, shuffle=True, drop_last=True, **kw)
    return loader


def run_steps(a, step, sync, bs, accum, world, device):
    if a.steps is None:
        steps = 0
        try:
            while True:
                step()
                steps += 1
        except StopIteration:
            pass
        print(f"trained {steps} optimizer steps over {a.epochs} epoch(s)")
        return
    for _ in range(5):  # warm-up: workers start, compile, autotune
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    sync()
    seconds = time.perf_counter() - t0
    if world > 1:  # all ranks' samples over the slowest rank's time
        t = torch.tensor([seconds], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        seconds = t.item()
    if world == 1 or dist.get_rank() == 0:
        print(f"samples/sec: {a.steps * bs * accum * world / seconds:.1f} over {a.steps} steps")


if __name__ == "__main__":
    main()
