"""A training loop written the way a user writes one, to check the tuner's figure against.

Run in a fresh ``python`` process; it imports nothing of the tuner's but the user's
workload definition (the model, dataset, loss, collate and optimizer the user wrote):

- ``torch.set_num_threads(threads)`` where the config sets threads;
- the model built after ``torch.manual_seed(0)``;
- ``DataLoader(shuffle=True, drop_last=True)``, with the config's workers, prefetch and
  persistence; with ``batch_grouping: by_source``, a batch sampler of the user's own that
  makes each batch of one source (``by_source_batches``);
- the workload's optimizer (AdamW unless it names one);
- channels_last on the model and the 4-D inputs where the config sets it;
- autocast for bf16 (and fp16 with a GradScaler);
- ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)``;
- on a GPU (``--device cuda``): the model moved there, each batch moved with
  ``.to(device, non_blocking=...)`` (``pin_memory`` in the DataLoader where the config
  pins), ``cudnn.benchmark`` and TF32 as the config sets them, ``torch.compile`` and
  ``fused=True`` where it asks, and ``torch.cuda.synchronize()`` before each clock read;
- ``--warmup`` steps, then ``--windows`` windows of ``--steps`` steps each, timed with
  ``perf_counter``; samples/sec is the median window's. A window that would hold an
  epoch boundary starts after the next epoch's first step instead (its workers started),
  so every window lies inside an epoch;
- ``--epochs N``: then also N whole epochs timed end to end, boundaries included, after
  the epoch under way is finished untimed (``epochs_samples_per_sec``): what a training
  run of whole epochs gets where a boundary costs (workers refilling their queues).

    python benchmarks/user_loop.py WORKLOAD ARGS_JSON CONFIG_JSON [--windows 5 --steps 6]

prints one JSON line: ``{"samples_per_sec": ..., "windows": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time


def fused_like(opt, params):
    """The workload's optimizer as a user asks for the fused one: the same class and
    hyperparameters, ``fused=True``."""
    import inspect

    allowed = inspect.signature(type(opt).__init__).parameters
    kw = {k: v for k, v in opt.defaults.items() if k in allowed and k not in ("fused", "foreach", "params")}
    return type(opt)(params, **kw, fused=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload")
    ap.add_argument("args", help="the workload's arguments, as JSON")
    ap.add_argument("config", help="the knobs, as JSON (precision, micro_batch_size, num_workers, ...)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--epochs", type=int, default=0)
    a = ap.parse_args()
    config, args = json.loads(a.config), json.loads(a.args)

    import torch
    from torch.utils.data import DataLoader

    from tuner.workloads import load_workload  # the user's own definition, imported

    if config.get("torch_threads"):
        torch.set_num_threads(config["torch_threads"])
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = bool(config.get("cudnn_benchmark"))
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(config.get("tf32"))
    torch.manual_seed(0)
    wl = load_workload(a.workload, args)
    model = wl.model().to(dev)
    cl = bool(config.get("channels_last"))
    if cl:
        model = model.to(memory_format=torch.channels_last)
    model.train()
    opt = wl.make_optimizer(model.parameters())
    if config.get("fused_optimizer"):
        opt = fused_like(opt, model.parameters())
    if config.get("compile", "off") != "off":
        model = torch.compile(model, mode=None if config["compile"] == "default" else config["compile"])
    workers = config.get("num_workers", 0)
    kw: dict = {"num_workers": workers}
    if workers:
        kw["persistent_workers"] = bool(config.get("persistent_workers"))
        if config.get("prefetch_factor"):
            kw["prefetch_factor"] = config["prefetch_factor"]
    bs = config["micro_batch_size"]
    if cuda and config.get("pin_memory"):
        kw["pin_memory"] = True
    ds = wl.dataset()
    if config.get("batch_grouping") == "by_source":
        loader = DataLoader(ds, batch_sampler=by_source_batches(wl.groups(ds), bs), collate_fn=wl.collate, **kw)
    else:
        loader = DataLoader(ds, batch_size=bs, shuffle=True, drop_last=True, collate_fn=wl.collate, **kw)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.get("precision", "fp32"))
    scaler = torch.amp.GradScaler(dev.type) if dtype is torch.float16 else None
    nb = bool(config.get("non_blocking"))

    def to_device(batch):
        if torch.is_tensor(batch):
            return batch.to(dev, non_blocking=nb)
        if isinstance(batch, (list, tuple)):
            return type(batch)(to_device(b) for b in batch)
        if hasattr(batch, "items"):  # a dict, or a BatchEncoding
            return {k: to_device(v) for k, v in batch.items()}
        return batch

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def nhwc(b):
        return b.contiguous(memory_format=torch.channels_last) if torch.is_tensor(b) and b.dim() == 4 else b

    def step(batch) -> None:
        if cuda:
            batch = to_device(batch)
        if cl:  # 4-D inputs in the model's memory format, as a user's loop converts them
            if isinstance(batch, (list, tuple)):
                batch = [nhwc(b) for b in batch]
            elif hasattr(batch, "items"):
                batch = {k: nhwc(v) for k, v in batch.items()}
        with torch.autocast(dev.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = wl.loss(model, batch)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    it = iter(loader)
    left = len(loader)  # steps left in the epoch under way

    def next_batch():
        nonlocal it, left
        if left == 0:
            it, left = iter(loader), len(loader)
        left -= 1
        return next(it)

    for _ in range(a.warmup):
        step(next_batch())
    rates, faults, steps = [], 0, 0  # the page faults are read for the record, not by a user
    for _ in range(a.windows):
        if left < a.steps:  # the window starts in a new epoch, after its first step (workers up)
            while left:
                step(next_batch())
            step(next_batch())
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = clock()
        for _ in range(a.steps):
            step(next_batch())
        rates.append(a.steps * bs / (clock() - t0))
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        steps += a.steps
    epochs_rate = None
    if a.epochs:
        while left:
            step(next_batch())
        t0 = clock()
        for _ in range(a.epochs * len(loader)):
            step(next_batch())
        epochs_rate = a.epochs * len(loader) * bs / (clock() - t0)
    print(json.dumps({"samples_per_sec": statistics.median(rates), "windows": rates,
                      "epochs_samples_per_sec": epochs_rate,
                      "page_faults_per_step": faults / steps,
                      "peak_device_memory_mb": torch.cuda.max_memory_allocated(dev) / 2**20 if cuda else None}))


class by_source_batches:  # noqa: N801 -- the user's own grouped batch sampler
    """Each batch from one source, shuffled, as the guides' group_collate recipe writes it."""

    def __init__(self, groups: list[list[int]], bs: int):
        self.groups, self.bs = groups, bs

    def __len__(self) -> int:
        return sum(len(g) // self.bs for g in self.groups)

    def __iter__(self):
        import random

        batches = []
        for g in self.groups:
            g = random.sample(g, len(g))
            batches += [g[i:i + self.bs] for i in range(0, len(g) - self.bs + 1, self.bs)]
        random.shuffle(batches)
        return iter(batches)


if __name__ == "__main__":
    main()
