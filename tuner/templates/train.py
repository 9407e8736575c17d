"""Train with the config tuner chose, in a plain PyTorch loop.

    python train_tuned.py               # one epoch
    python train_tuned.py --steps 50    # time 50 optimizer steps after a warm-up; print samples/sec

Written by `tuner export --format python`; the CONFIG below is the exported config.
"""

import argparse
import importlib
import importlib.util
import inspect
import random
import sys
import time
from pathlib import Path

import torch

WORKLOAD = None  # "file.py:make", "pkg.module:make" or a built-in name
WORKLOAD_ARGS = {}
BASE_DIR = None  # where a relative workload file lives (the space file's folder)
DEVICE = "cpu"
CONFIG = {}
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


class BySource(torch.utils.data.Sampler):
    """batch_grouping=by_source: each batch holds samples of one source."""

    def __init__(self, groups, batch_size):
        self.groups, self.batch_size = groups, batch_size

    def __len__(self):
        return sum(len(g) // self.batch_size for g in self.groups)

    def __iter__(self):
        batches = []
        for g in self.groups:
            g = random.sample(g, len(g))
            batches += [g[i:i + self.batch_size] for i in range(0, len(g) - self.batch_size + 1, self.batch_size)]
        random.shuffle(batches)
        return iter(batches)


def main():
    ap = argparse.ArgumentParser(description="train with the exported config")
    ap.add_argument("--steps", type=int, help="time this many optimizer steps (after 5 warm-up steps)")
    ap.add_argument("--epochs", type=int, default=1)
    a = ap.parse_args()
    c = CONFIG
    device = torch.device(DEVICE)
    if c["torch_threads"]:
        torch.set_num_threads(c["torch_threads"])
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = c["cudnn_benchmark"]
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = c["tf32"]

    wl = load_factory()(**WORKLOAD_ARGS)
    model = wl.model().to(device)
    if c["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    if c["activation_checkpointing"]:
        from torch.utils.checkpoint import checkpoint

        for blocks in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
            for block in blocks:
                block.forward = (lambda f: lambda *x, **k: checkpoint(f, *x, use_reentrant=False, **k))(block.forward)
    model.train()
    opt = wl.optimizer(model.parameters()) if wl.optimizer else torch.optim.AdamW(model.parameters(), lr=1e-3)
    if c["fused_optimizer"]:  # the same optimizer and hyperparameters, fused kernels
        allowed = inspect.signature(type(opt)).parameters
        kw = {k: v for k, v in opt.defaults.items() if k in allowed and k not in ("fused", "foreach", "params")}
        opt = type(opt)(model.parameters(), **kw, fused=True)
    if c["compile"] != "off":
        model = torch.compile(model, mode=None if c["compile"] == "default" else c["compile"])
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(c["precision"])
    scaler = torch.amp.GradScaler(device.type) if c["precision"] == "fp16" else None

    dataset = wl.dataset()
    kw = {"num_workers": c["num_workers"], "collate_fn": wl.collate}
    if c["num_workers"] > 0:
        kw["persistent_workers"] = c["persistent_workers"]
        if c["prefetch_factor"]:
            kw["prefetch_factor"] = c["prefetch_factor"]
    if device.type == "cuda":
        kw["pin_memory"] = c["pin_memory"]
    bs = c["micro_batch_size"]
    if c["batch_grouping"] == "by_source" and wl.groups:
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=BySource(wl.groups(dataset), bs), **kw)
    else:
        loader = torch.utils.data.DataLoader(dataset, batch_size=bs, shuffle=True, drop_last=True, **kw)
    non_blocking = c["non_blocking"] and device.type == "cuda"
    accum = c["grad_accum_steps"]

    def batches():
        for _ in range(a.epochs if a.steps is None else 10**9):  # --steps: as many epochs as it takes
            yield from loader

    it = batches()

    def step():
        """One optimizer step over `accum` micro-batches (StopIteration when the epochs end)."""
        for _ in range(accum):
            batch = move(next(it), device, non_blocking, c["channels_last"])
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = wl.loss(model, batch)
            loss = loss / accum if accum > 1 else loss
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)  # no loss.item() per step: it waits for the device

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

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
    print(f"samples/sec: {a.steps * bs * accum / seconds:.1f} over {a.steps} steps")

if __name__ == "__main__":
    main()
