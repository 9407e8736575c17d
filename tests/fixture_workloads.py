"""Workloads with known behaviour, for tests (referenced as fixture_workloads.py:NAME)."""

from __future__ import annotations

import mmap
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, get_worker_info

from tuner import Workload


class Numbers(Dataset):
    """Deterministic (x, y) pairs: sample i is always the same."""

    def __init__(self, size: int = 64, dim: int = 8):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, dim, generator=g)
        self.y = torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def _mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def linear(size: int = 64, dim: int = 8, lr: float = 0.1, clip: float | None = None, ema: bool = False) -> Workload:
    """A linear regression: deterministic, no BatchNorm; gradients comparable across batchings.
    ``clip``: gradient clipping; ``ema``: an exponential moving average of the weights,
    updated after each optimizer step (kept on the module: ``ema``, ``ema_steps``)."""

    def after_step(model, optimizer):
        if not hasattr(model, "ema_steps"):
            model.ema, model.ema_steps = [p.detach().clone() for p in model.parameters()], 0
        torch._foreach_lerp_(model.ema, [p.detach() for p in model.parameters()], 0.01)
        model.ema_steps += 1

    return Workload(model=lambda: nn.Linear(dim, 1), dataset=lambda: Numbers(size, dim), loss=_mse,
                    optimizer=lambda p: torch.optim.SGD(p, lr=lr), clip_grad_norm=clip,
                    after_step=after_step if ema else None)


def leaky(width: int = 2048, keep: bool = True) -> Workload:
    """A regression whose loss function keeps every step's hidden activations in a list
    (``keep``), as features kept for an epoch-end metric without ``.detach()`` are: each
    holds a micro-batch x ``width`` floats and its graph, step after step. (A kept loss
    holds less: backward frees its graph's saved tensors, and what stays grows the heap by
    fits and starts.)"""
    kept: list = []

    def loss(model, batch):
        x, y = batch
        hidden = model[1](model[0](x))
        if keep:
            kept.append(hidden)
        return nn.functional.mse_loss(model[2](hidden), y)

    return Workload(model=lambda: nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 1)),
                    dataset=lambda: Numbers(4096, 8), loss=loss, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))

class Hoard(Numbers):
    """``Numbers`` whose ``__getitem__`` keeps a ``kb`` KB copy of each item it reads
    (``keep``), as the guides' dataset appended to its cache with the cache off, and
    sleeps ``item_s`` an item: a rate, and so a growth per second, that a loaded
    machine does not change much."""

    def __init__(self, size: int, kb: int, keep: bool, item_s: float):
        super().__init__(size)
        self.kb, self.keep, self.item_s = kb, keep, item_s
        self.kept: list[torch.Tensor] = []

    def __getitem__(self, i: int):
        time.sleep(self.item_s)
        if self.keep:
            self.kept.append(torch.full((self.kb * 256,), float(i)))
        return super().__getitem__(i)


def hoarding(kb: int = 16, keep: bool = True, item_s: float = 0.0005) -> Workload:
    """A linear regression over ``Hoard``: with DataLoader workers, their heaps grow."""
    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Hoard(4096, kb, keep, item_s), loss=_mse)


def lingering_thread(size: int = 64, pid_file: str = "") -> Workload:
    """A linear regression whose dataset starts a non-daemon thread that never ends (a
    library's background thread, say): an interpreter's exit waits for it for good. Each
    process that collates a batch (the DataLoader's workers) appends its id to ``pid_file``."""
    import os
    import threading

    def dataset():
        threading.Thread(target=threading.Event().wait, daemon=False).start()
        return Numbers(size)

    def collate(items):
        if pid_file:
            with open(pid_file, "a") as f:
                f.write(f"{os.getpid()}\n")
        return torch.utils.data.default_collate(items)

    return Workload(model=lambda: nn.Linear(8, 1), dataset=dataset, loss=_mse, collate=collate)


class Stream(torch.utils.data.IterableDataset):
    """``size`` samples as a stream (no ``len``), split among the DataLoader's workers."""

    def __init__(self, size: int, dim: int = 8):
        self.size, self.dim = size, dim

    def __iter__(self):
        info = get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(first, self.size, step):
            x = torch.full((self.dim,), float(i % 7))
            yield x, x.sum(0, keepdim=True)


def stream(size: int = 64, dim: int = 8) -> Workload:
    """``linear``'s regression read from an iterable dataset: no sampler can shuffle it."""
    return Workload(model=lambda: nn.Linear(dim, 1), dataset=lambda: Stream(size, dim), loss=_mse,
                    epoch_size=size)


class Unsplit(Stream):
    """A stream every DataLoader worker yields whole: it ignores get_worker_info()."""

    def __iter__(self):
        for i in range(self.size):
            x = torch.full((self.dim,), float(i % 7))
            yield x, x.sum(0, keepdim=True)


def unsplit_stream(size: int = 64, dim: int = 8) -> Workload:
    """``stream`` that forgot to split itself among the workers: with two, every item
    comes twice an epoch."""
    return Workload(model=lambda: nn.Linear(dim, 1), dataset=lambda: Unsplit(size, dim), loss=_mse)


class SparseRec(nn.Module):
    """A recommender's two embedding tables with sparse gradients, and a small MLP."""

    def __init__(self):
        super().__init__()
        self.users, self.items = nn.Embedding(500, 8, sparse=True), nn.Embedding(800, 8, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, u, i):
        return self.mlp(torch.cat([self.users(u), self.items(i)], -1)).squeeze(-1)


def sparse_embeddings(size: int = 512) -> Workload:
    """Embeddings with sparse gradients under SGD: a step no fused optimizer takes."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 500, (size,), generator=g),
                                          torch.randint(0, 800, (size,), generator=g), torch.rand(size, generator=g))
    return Workload(model=SparseRec, dataset=lambda: data,
                    loss=lambda m, b: nn.functional.mse_loss(m(b[0], b[1]), b[2]),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def small_items(size: int = 20000, dim: int = 4) -> Workload:
    """Items of a few numbers each, collated by the thousand in the training process: each
    step makes thousands of Python objects, and the interpreter's full garbage collection
    comes every few dozen steps. A tiny model: the step is mostly that."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(size, dim, generator=g), torch.randn(size, 1, generator=g))
    return Workload(model=lambda: nn.Sequential(nn.Linear(dim, 16), nn.ReLU(), nn.Linear(16, 1)),
                    dataset=lambda: data, loss=_mse)


class Reopened(Stream):
    """A stream that costs ``open_s`` to open at each epoch (a file, a list of shards)."""

    def __init__(self, size: int, open_s: float):
        super().__init__(size)
        self.open_s = open_s

    def __iter__(self):
        time.sleep(self.open_s)
        yield from super().__iter__()


def reopened_stream(size: int = 32, open_s: float = 0.1, step_s: float = 0.02) -> Workload:
    """An iterable dataset without ``len`` or ``epoch_size``, whose epochs end every few
    steps and cost ``open_s`` each to start; each step sleeps ``step_s``."""

    def loss(model, batch):
        time.sleep(step_s)
        return _mse(model, batch)

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Reopened(size, open_s), loss=loss)


def sleepy(step_s: float = 0.02, size: int = 256) -> Workload:
    """Each micro-batch takes step_s seconds (a sleep in the loss): a known true rate."""

    def loss(model, batch):
        time.sleep(step_s)
        return _mse(model, batch)

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Numbers(size), loss=loss)


def drifting(records: str, step_s: float = 0.01, after: int = 2, factor: float = 2.0) -> Workload:
    """``sleepy`` on a machine that drifts between the search and its confirm rounds: a
    trial that starts once ``after`` full measurements are in ``records`` (a search's
    trials.jsonl) steps ``factor`` times slower. Configs alike stay alike in every round
    while the noise between two figures of one config is wide, so the rounds race on."""
    import json
    from pathlib import Path

    slow: list[float] = []

    def loss(model, batch):
        if not slow:
            path = Path(records)
            lines = path.read_text().splitlines() if path.exists() else []
            full = [r for r in map(json.loads, filter(None, lines))
                    if r.get("status") == "ok" and not r.get("screened") and r.get("phase") != "baseline"]
            slow.append(factor if len(full) >= after else 1.0)
        time.sleep(step_s * slow[0])
        return _mse(model, batch)

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Numbers(256), loss=loss)


def started_as(path: str, step_s: float = 0.01) -> Workload:
    """``sleepy``, whose every trial adds a JSON line to ``path`` saying how its process
    started: its parent, its command line, and whether Ray was imported in it."""
    import json
    import os
    import sys

    import psutil

    def dataset():
        with open(path, "a") as f:
            f.write(json.dumps({"ppid": os.getppid(), "cmdline": psutil.Process().cmdline(),
                                "ray_imported": "ray" in sys.modules}) + "\n")
        return Numbers(256)

    base = sleepy(step_s)
    return Workload(model=base.model, dataset=dataset, loss=base.loss)


_HELD = []


class HungryInWorkers(Dataset):
    """Each DataLoader worker allocates (and touches) `mb` MB on its first sample."""

    def __init__(self, mb: int):
        self.mb = mb

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int):
        if get_worker_info() is not None and not _HELD:
            _HELD.append(np.ones(self.mb * 2**20, dtype=np.uint8))
        return torch.zeros(8), torch.zeros(1)


def hungry_workers(mb: int = 300) -> Workload:
    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: HungryInWorkers(mb), loss=_mse)


def nan_in(precision_dtype: str = "float16") -> Workload:
    """Finite in fp32; NaN when the forward runs under autocast to `precision_dtype`."""
    dtype = getattr(torch, precision_dtype)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, x):
            out = self.lin(x)
            if out.dtype == dtype:
                return out * float("nan")
            return out

    return Workload(model=Model, dataset=lambda: Numbers(), loss=_mse)


def oom_above(max_batch: int = 16) -> Workload:
    """Raises torch.OutOfMemoryError for micro-batches larger than max_batch."""

    def loss(model, batch):
        if batch[0].shape[0] > max_batch:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated for batch {batch[0].shape[0]})")
        return _mse(model, batch)

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Numbers(256), loss=loss)


def hangs(when_workers: int = 1) -> Workload:
    """Hangs forever in the loss (a deadlock stand-in)."""

    def loss(model, batch):
        while True:
            time.sleep(1)

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Numbers(), loss=loss)


class Stalling(Dataset):
    """Numbers whose reads block for good after ``after`` reads in a process: a DataLoader
    worker stuck on a dead network filesystem, say."""

    def __init__(self, after: int):
        self.after, self.reads = after, 0

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int):
        self.reads += 1
        while self.reads > self.after:
            time.sleep(1)
        return torch.randn(8), torch.randn(1)


def stalls(after: int = 200) -> Workload:
    """Trains at a fast step, then its data never comes again."""
    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Stalling(after), loss=_mse)


class WorkerBlocked(Numbers):
    """Numbers that never come from a worker of a loader with ``workers`` workers: a worker
    deadlocked at its start, the most common hang of a real loader."""

    def __init__(self, workers: int):
        super().__init__(256)
        self.workers = workers

    def __getitem__(self, i: int):
        info = torch.utils.data.get_worker_info()
        while info is not None and info.num_workers == self.workers:
            time.sleep(1)
        return super().__getitem__(i)


def hangs_in_workers(workers: int = 2, step_s: float = 0.01) -> Workload:
    """Trains without workers (or with another number); with ``workers`` it waits for good."""
    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: WorkerBlocked(workers),
                    loss=sleepy(step_s).loss)


def busy_first_step(seconds: float = 40.0) -> Workload:
    """The first step spins a core for ``seconds`` (a long compile stands so: busy, with no
    step to show for it), then steps are quick."""
    first = []

    def loss(model, batch):
        if not first:
            first.append(True)
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass
        return _mse(model, batch)

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Numbers(256), loss=loss)


def raises() -> Workload:
    raise RuntimeError("my dataset path does not exist")


def raises_in_loss() -> Workload:
    def loss(model, batch):
        raise KeyError("label")

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Numbers(), loss=loss)


class DtypeProbe(nn.Module):
    """Records the dtype its inner matmul produced and the memory format of its input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.lin = nn.Linear(4, 1)
        self.seen_dtype = None
        self.seen_channels_last = None

    def forward(self, x):
        self.seen_channels_last = x.is_contiguous(memory_format=torch.channels_last)
        h = self.conv(x).mean(dim=(2, 3))
        out = self.lin(h)
        self.seen_dtype = out.dtype
        return out.float()


class Images(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        return torch.randn(3, 8, 8), torch.randn(1)


def probe() -> Workload:
    return Workload(model=DtypeProbe, dataset=Images, loss=_mse)


def faulty(oom_above: int = 32, hang_at: int = 8, step_s: float = 0.01) -> Workload:
    """Behaviour by knob: micro-batch > oom_above OOMs, == hang_at hangs, fp16 gives NaN."""

    def loss(model, batch):
        n = batch[0].shape[0]
        if n > oom_above:
            raise torch.OutOfMemoryError(f"out of memory (simulated, batch {n})")
        if n == hang_at:
            while True:
                time.sleep(1)
        time.sleep(step_s)
        out = model(batch[0])
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16:
            out = out * float("nan")
        return nn.functional.mse_loss(out.float(), batch[1])

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Numbers(512), loss=loss)


_BALLAST = []


def ballast(mb_per_sample: int = 4, step_s: float = 0.02) -> Workload:
    """Host memory grows with the micro-batch (mb_per_sample MB held per sample);
    a fixed time per micro-batch, so larger batches are faster: a memory/speed trade-off."""

    def loss(model, batch):
        n = batch[0].shape[0]
        if not _BALLAST:
            _BALLAST.append(np.ones(n * mb_per_sample * 2**20, dtype=np.uint8))
        time.sleep(step_s)
        return _mse(model, batch)

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Numbers(512), loss=loss)


class SlowData(Dataset):
    """Each sample takes sample_s seconds to load: a sleep, which costs no CPU (a read
    from a slow disk), or with ``spin`` a busy loop, which costs a core (a decode)."""

    def __init__(self, sample_s: float, size: int = 512, spin: bool = False):
        self.sample_s, self.size, self.spin = sample_s, size, spin

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        if self.spin:
            end = time.perf_counter() + self.sample_s
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(self.sample_s)
        return torch.ones(8) * (i % 7), torch.zeros(1)


def slow_data(sample_s: float = 0.002, step_s: float = 0.01, size: int = 512, spin: bool = False,
              collate_s: float = 0.0) -> Workload:
    """Loading a batch of 8 takes 8 * sample_s (slept, or spun with ``spin``); the step
    takes step_s (a sleep); with ``collate_s``, the collate sleeps that long per item."""

    def loss(model, batch):
        time.sleep(step_s)
        return _mse(model, batch)

    def collate(items):
        time.sleep(collate_s * len(items))
        return torch.utils.data.default_collate(items)

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: SlowData(sample_s, size, spin), loss=loss,
                    collate=collate if collate_s else None)


class SlowExitWorkers(Dataset):
    """Each DataLoader worker takes exit_s seconds to exit (a finalizer at worker exit):
    without persistent workers, PyTorch waits for it inside the next() that ends the epoch."""

    def __init__(self, exit_s: float, size: int = 64):
        self.exit_s, self.size = exit_s, size
        self._armed = False

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        if get_worker_info() is not None and not self._armed:
            from multiprocessing import util

            util.Finalize(None, time.sleep, args=(self.exit_s,), exitpriority=0)
            self._armed = True
        return torch.zeros(8), torch.zeros(1)


def slow_exit_workers(exit_s: float = 0.3, size: int = 64) -> Workload:
    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: SlowExitWorkers(exit_s, size), loss=_mse)


_MAIN_BALLAST = []


def main_ballast(mb: int = 200) -> Workload:
    """The first loss call allocates and touches mb MB in the trial process, then frees
    it: a short-lived peak that a sampler could miss and the kernel's high-water mark keeps."""

    def loss(model, batch):
        if not _MAIN_BALLAST:
            block = np.ones(mb * 2**20, dtype=np.uint8)  # np.ones writes every page
            _MAIN_BALLAST.append(int(block[::4096].sum()))
            del block
        return _mse(model, batch)

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Numbers(), loss=loss)


def faulting(pages: int = 2048) -> Workload:
    """Each loss call maps `pages` fresh pages and writes one byte to each: at least
    `pages` minor page faults per micro-batch, which the kernel cannot avoid."""

    def loss(model, batch):
        if pages:
            with mmap.mmap(-1, pages * mmap.PAGESIZE) as block:
                for i in range(0, pages * mmap.PAGESIZE, mmap.PAGESIZE):
                    block[i] = 1
        return _mse(model, batch)

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Numbers(), loss=loss)


def churning(mb: int = 48) -> Workload:
    """Each loss call fills and frees an `mb` MB buffer (malloc, written), as a step's
    activations come and go. Over glibc's largest automatic mmap threshold (32 MB),
    malloc maps it fresh every time: one page fault per page written, unless the
    allocator keeps it (malloc_retain)."""

    def loss(model, batch):
        if mb:
            bytearray(mb << 20)  # malloc'd and zeroed: every page written, then freed
        return _mse(model, batch)

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Numbers(), loss=loss)


def collecting(items: int = 20000, in_collate: bool = False) -> Workload:
    """Each loss call (or, ``in_collate``, each collate: in the DataLoader's workers where
    there are any) builds and drops ``items`` small lists, as collating a batch of that
    many items does: the survivors of the young collections reach the oldest generation,
    and every few steps a full collection scans every object the process holds (torch's
    own among them), unless they were frozen (gc_freeze)."""

    def churn() -> None:
        junk = [[i] for i in range(items)]
        del junk

    def loss(model, batch):
        if not in_collate:
            churn()
        return _mse(model, batch)

    def collate(batch):
        churn()
        return torch.utils.data.default_collate(batch)

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Numbers(), loss=loss,
                    collate=collate if in_collate else None)


def anomalous(inside: bool = False) -> Workload:
    """Autograd's anomaly detection left on, as a debugging session leaves it: turned on
    in the model's factory (for the whole process), or in each loss call."""

    def model():
        if not inside:
            torch.autograd.set_detect_anomaly(True)  # left on: the whole process
        return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))

    def loss(m, batch):
        if inside:
            with torch.autograd.detect_anomaly():  # left on: each step
                return _mse(m, batch)
        return _mse(m, batch)

    return Workload(model=model, dataset=lambda: Numbers(), loss=loss)


class _Bf16Forward(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))

    @torch.autocast("cpu", dtype=torch.bfloat16)  # own autocast: decorator
    def forward(self, x):
        return self.body(x)


def half_model() -> Workload:
    """A model built in bfloat16, as one loaded with ``torch_dtype=torch.bfloat16`` is."""

    def loss(m, batch):
        x, y = batch
        return nn.functional.mse_loss(m(x.to(torch.bfloat16)).float(), y)

    return Workload(model=lambda: nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1)).to(torch.bfloat16),
                    dataset=lambda: Numbers(), loss=loss)


def own_autocast(how: str = "with") -> Workload:
    """A step that turns autocast on itself: a loss copied from a bf16 training script
    (``with``), or a model whose forward is decorated (``decorator``). ``off``: a region
    with autocast turned off only (a loss kept in fp32), which leaves the precision knob be."""

    def loss(m, batch):
        if how == "with":
            with torch.autocast("cpu", dtype=torch.bfloat16):  # own autocast: with
                return _mse(m, batch)
        if how == "off":
            with torch.autocast("cpu", enabled=False):
                return _mse(m, batch)
        return _mse(m, batch)

    model = _Bf16Forward if how == "decorator" else (lambda: nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1)))
    return Workload(model=model, dataset=lambda: Numbers(), loss=loss)


def compiled_in_factory(how: str = "wrap") -> Workload:
    """A model factory that compiles what it builds, as a training script does:
    ``torch.compile(model)`` (``wrap``), one compiled submodule (``submodule``), or
    ``model.compile()`` in place (``method``)."""

    def model():
        m = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
        if how == "wrap":
            return torch.compile(m)
        if how == "submodule":
            m[0] = torch.compile(m[0])
        else:
            m.compile()
        return m

    return Workload(model=model, dataset=lambda: Numbers(), loss=_mse)


def seeded_for_reproducibility() -> Workload:
    """A model factory that calls a seeding helper of the kind training scripts carry:
    deterministic algorithms on, and a float64 default dtype for a scientific model."""

    def model():
        torch.manual_seed(0)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.set_default_dtype(torch.float64)
        return nn.Linear(8, 1)

    def loss(m, batch):
        x, y = batch
        return nn.functional.mse_loss(m(x.to(torch.get_default_dtype())), y.to(torch.get_default_dtype()))

    return Workload(model=model, dataset=lambda: Numbers(), loss=loss)


def decay_by_name() -> Workload:
    """An optimizer factory written against the model, as a training script's
    ``configure_optimizers`` is: weight decay on the weights, by name, not on biases."""

    def optimizer(model):
        named = list(model.named_parameters())
        return torch.optim.AdamW([{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
                                  {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0}],
                                 lr=1e-3)

    return Workload(model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)),
                    dataset=lambda: Numbers(), loss=_mse, optimizer=optimizer)


class _Lines(Dataset):
    """Token lines of different lengths, as text is before padding; ``broken`` raises on
    that item, as a bad row of a user's file does."""

    def __init__(self, broken: int | None = None):
        self.broken = broken

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        if i == self.broken:
            raise ValueError(f"bad row {i}")
        return torch.arange(8 + i % 8) % 50, torch.tensor(i % 2)


def uneven(broken: int | None = None, padded: bool = False) -> Workload:
    """A bag-of-tokens classifier on lines of different lengths: without a padding collate
    PyTorch's default cannot stack them (``padded`` gives one)."""

    def pad(items):
        return nn.utils.rnn.pad_sequence([x for x, _ in items], batch_first=True), torch.stack([y for _, y in items])

    return Workload(model=lambda: nn.Sequential(nn.EmbeddingBag(50, 16), nn.Linear(16, 2)),
                    dataset=lambda: _Lines(broken), collate=pad if padded else None,
                    loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))


def gpu_defects() -> Workload:
    """A step with the GPU's own hot-path defects, each on its own line: a pageable host
    tensor copied to the device, a value read back, a device-wide wait and the allocator's
    cache emptied (``tests/test_gpu.py``)."""
    scale = torch.ones(8)  # on the host, unpinned

    def loss(m, batch):
        x, y = batch
        x = x * scale.to(x.device)  # gpu defect: unpinned_copy
        out = _mse(m, (x, y))
        loss.seen = out.item()  # gpu defect: sync
        torch.cuda.synchronize()  # gpu defect: synchronize
        torch.cuda.empty_cache()  # gpu defect: empty_cache
        return out

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Numbers(), loss=loss)


def sets_threads(build: int = 1, step: int | None = None) -> Workload:
    """Calls ``torch.set_num_threads`` itself, as a script's leftover does: in its model's
    factory (``build``), and in each loss call where ``step`` is given."""

    def model():
        torch.set_num_threads(build)
        return nn.Linear(8, 1)

    def loss(m, batch):
        if step is not None:
            torch.set_num_threads(step)
        return _mse(m, batch)

    return Workload(model=model, dataset=lambda: Numbers(), loss=loss)


def burn(dim: int = 512, size: int = 4096) -> Workload:
    """Compute-bound on the CPU (matmuls, every core): its rate drops when another process
    takes cores, which is what the disturbance detection must see."""
    return Workload(model=lambda: nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 1)),
                    dataset=lambda: Numbers(size, dim), loss=_mse)


class RaisesInWorker(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        if get_worker_info() is not None and i % 4 == 3:
            raise ValueError(f"sample {i} is corrupt")
        return torch.zeros(8), torch.zeros(1)


def raises_in_worker() -> Workload:
    """The dataset raises inside a DataLoader worker: the user's message must survive."""
    return Workload(model=lambda: nn.Linear(8, 1), dataset=RaisesInWorker, loss=_mse)


def not_a_workload() -> int:
    return 3


def _encoding_collate(samples):
    """Batches as a Hugging Face ``BatchEncoding`` (a ``UserDict``, not a ``dict``)."""
    from torch.utils.data import default_collate
    from transformers import BatchEncoding

    x, y = default_collate(samples)
    return BatchEncoding({"x": x, "y": y})


def _encoding_loss(model, batch):
    device = next(model.parameters()).device
    assert batch["x"].device == device and batch["y"].device == device, "batch left on the host"
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def encoding_batches(size: int = 64) -> Workload:
    """Hugging Face-style batches: each tensor must reach the model's device."""
    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Numbers(size), loss=_encoding_loss,
                    collate=_encoding_collate)


class _Unused(nn.Module):
    """A linear model with a layer the loss never reaches (DDP then needs
    find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x):
        return self.used(x)


def ddp_spy(out: str, size: int = 256, step_s: float = 0.0, unused_layer: bool = False,
            fail_rank: int = -1, hang_rank: int = -1, hang_after: int = 0,
            hoard_rank: int = -1, hoard_pause_s: float = 0.0, hoard_cap_mb: int = 8192) -> Workload:
    """What DDP each rank's loss sees, appended as JSON lines to ``out``: the rank, the
    DDP settings, whether this backward all-reduces. ``fail_rank`` raises there;
    ``hang_rank`` hangs there once DDP wraps the model, after ``hang_after`` steps of it
    (the other rank then waits in the all-reduce); ``hoard_rank`` keeps 64 MB more every
    ``hoard_pause_s`` there once DDP wraps the model, until the OOM killer ends it (or it
    holds ``hoard_cap_mb``, and waits)."""
    import json
    import os

    wrapped = []  # the steps of the DDP-wrapped model so far

    def loss(model, batch):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        ddp = getattr(model, "_orig_mod", model)
        with open(out, "a") as f:
            f.write(json.dumps({
                "rank": rank, "pid": os.getpid(), "world": dist.get_world_size() if dist.is_initialized() else 1,
                "ddp": type(ddp).__name__ == "DistributedDataParallel",
                "bucket_bytes": getattr(ddp, "bucket_bytes_cap", None),
                "as_view": getattr(ddp, "gradient_as_bucket_view", None),
                "static": getattr(ddp, "static_graph", None),
                "unused": getattr(ddp, "find_unused_parameters", None),
                "hook": [h.__name__ for h, _ in getattr(ddp, "_comm_hooks", [])],
                "sync": getattr(ddp, "require_backward_grad_sync", None),
                "x0": float(batch[0][0, 0]),
                "params": [float(v) for p in model.parameters() for v in p.detach().flatten()]}) + "\n")
        if rank == fail_rank:
            # wait (a while) until every rank has written a line, so a test can name
            # each rank's process: failing at once can end the others before they write
            world = dist.get_world_size() if dist.is_initialized() else 1
            deadline = time.time() + 60
            while time.time() < deadline and len({json.loads(line)["pid"] for line in open(out)}) < world:
                time.sleep(0.1)
            raise ValueError(f"rank {rank} was told to fail")
        if type(ddp).__name__ == "DistributedDataParallel":
            wrapped.append(1)
            if rank == hang_rank and len(wrapped) > hang_after:
                time.sleep(3600)
            if rank == hoard_rank:
                held = []
                while len(held) < hoard_cap_mb // 64:
                    held.append(torch.ones(2**24))  # 64 MB of float32
                    time.sleep(hoard_pause_s)
                time.sleep(3600)
        if step_s:
            time.sleep(step_s)
        return _mse(model, batch)

    model = _Unused if unused_layer else (lambda: nn.Linear(8, 1))
    return Workload(model=model, dataset=lambda: Numbers(size), loss=loss)


class TwoSources(Dataset):
    """Samples from two sources, even and odd indices: (x, y, source)."""

    def __init__(self, size: int):
        self.numbers = Numbers(size)

    def __len__(self) -> int:
        return len(self.numbers)

    def __getitem__(self, i: int):
        return *self.numbers[i], i % 2


def uneven_sources(even_s: float = 0.036, odd_s: float = 0.004, size: int = 480) -> Workload:
    """Batches of one source each (``batch_grouping: by_source``) cost ``even_s`` or
    ``odd_s`` (a sleep): steps of unequal cost, in an order the sampler's seed fixes."""

    def loss(model, batch):
        x, y, source = batch
        time.sleep(odd_s if int(source[0]) else even_s)
        return _mse(model, (x, y))

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: TwoSources(size), loss=loss,
                    groups=lambda ds: [list(range(0, len(ds), 2)), list(range(1, len(ds), 2))])


class Decoded(Dataset):
    """Items that cost ``decode_s`` each to produce (a sleep standing in for decoding),
    the same on every read; ``random``: plus a draw from the global RNG, as a random
    augmentation in ``__getitem__`` does."""

    def __init__(self, size: int = 256, decode_s: float = 0.002, random: bool = False):
        self.size, self.decode_s, self.random = size, decode_s, random

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        time.sleep(self.decode_s)
        x = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(i))
        if self.random:
            x = x + torch.rand(())
        return x, i % 4


def _flip(batch):
    """A per-batch random augmentation, torch ops only: it runs on the host or the device."""
    x, y = batch
    return torch.where(torch.rand(x.shape[0], 1, 1, 1, device=x.device) < 0.5, x.flip(-1), x), y


def decoded(size: int = 256, decode_s: float = 0.002, random: bool = False, augment: bool = False) -> Workload:
    def model():
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(8, 4))

    return Workload(model=model, dataset=lambda: Decoded(size, decode_s, random),
                    loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]),
                    augment=_flip if augment else None)


def recompiles_at(step: int = 40, step_s: float = 0.005, trace_s: float = 0.3) -> Workload:
    """``sleepy`` whose loss passes through a compiled helper (dynamo, eager backend) that
    sees a new input shape once, at micro-batch ``step`` (inside the timed windows), and
    takes ``trace_s`` more there: a one-time recompile, as a padded batch of a new length
    causes in a compiled model."""
    calls = [0]

    @torch.compile(backend="eager", dynamic=False)
    def helper(t: torch.Tensor) -> torch.Tensor:
        return t.sum() * 0.0

    def loss(model, batch):
        calls[0] += 1
        n = 5 if calls[0] == step else 4
        if n == 5:
            time.sleep(trace_s)  # the recompile's cost, beyond dynamo's own trace
        time.sleep(step_s)
        return _mse(model, batch) + helper(torch.ones(n))

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Numbers(256), loss=loss)


class Detections(Dataset):
    """An image and its targets (boxes, labels) per item, as torchvision's detection
    datasets give them: a batch of them is a tuple of per-item tensors, not one tensor."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int):
        return torch.randn(8), {"boxes": torch.randn(4, 4), "labels": torch.zeros(4, dtype=torch.long)}


def _per_item(samples):
    return tuple(zip(*samples, strict=True))


def _detection_loss(model, batch):
    images, targets = batch
    return sum(model(x).sum() + t["boxes"].sum() * 0 for x, t in zip(images, targets, strict=True)) / len(images)


def detections() -> Workload:
    """Batches of per-item tensors: DataLoader workers hand each tensor over as one file
    descriptor, three per item."""
    return Workload(model=lambda: nn.Linear(8, 1), dataset=Detections, loss=_detection_loss, collate=_per_item)


class Sentences(Dataset):
    """Token lists of lengths 2-``longest`` (an item's length is ``2 + i * 7919 %
    (longest - 1)``: every length, in no order), each the same on every read."""

    def __init__(self, size: int = 256, longest: int = 40, tail: int = 0, tails: int = 1):
        self.lengths = [2 + (i * 7919) % (longest - 1) for i in range(size)]
        for k in range(tails if tail else 0):  # items of that length: the batches that hold them cost the most by far
            self.lengths[k * size // tails] = tail

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int):
        return torch.arange(1, self.lengths[i] + 1) % 50, i % 2


def _pad(items):
    tokens, labels = zip(*items, strict=True)
    return torch.nn.utils.rnn.pad_sequence(tokens, batch_first=True), torch.tensor(labels)


class BagOfTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(50, 16, padding_idx=0), nn.Linear(16, 2)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1))


def padded(size: int = 256, longest: int = 40, lengths: str = "ok", iterable: bool = False,
           ms_per_position: float = 0.0, tail: int = 0, tails: int = 1) -> Workload:
    """Sentences padded per batch by the collate, with their lengths (``group_by_length``);
    ``lengths``: ``ok``, ``short`` (one too few), ``negative``, ``raises`` or ``none``;
    ``tail``: ``tails`` items that long, spread over the dataset.
    ``ms_per_position``: each step also sleeps that long per position of its padded batch
    (a step whose cost grows with its padding, known exactly)."""

    def given(ds):
        if lengths == "raises":
            raise KeyError("length")
        return {"ok": ds.lengths, "short": ds.lengths[1:], "negative": [-1] + ds.lengths[1:]}[lengths]

    def loss(model, batch):
        tokens, y = batch
        if ms_per_position:
            time.sleep(tokens.shape[1] * ms_per_position / 1e3)
        return nn.functional.cross_entropy(model(tokens), y)

    def dataset():
        ds = Sentences(size, longest, tail, tails)
        return IterableSentences(ds) if iterable else ds

    return Workload(model=BagOfTokens, dataset=dataset, loss=loss, collate=_pad,
                    lengths=None if lengths == "none" else given)


class IterableSentences(torch.utils.data.IterableDataset):
    def __init__(self, ds: Sentences):
        self.ds, self.lengths = ds, ds.lengths

    def __iter__(self):
        return (self.ds[i] for i in range(len(self.ds)))


def dies(how: str = "kill") -> Workload:
    """The trial's process ends at its third step without a word: SIGKILL (``kill``, as
    the OOM killer ends one) or ``os._exit(3)`` (``exit``, as a native library that
    calls exit() does)."""
    import os
    import signal

    steps = [0]

    def loss(model, batch):
        steps[0] += 1
        if steps[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL) if how == "kill" else os._exit(3)
        return _mse(model, batch)

    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: Numbers(64), loss=loss)


class _Hoarder(Numbers):
    """Each item read in a DataLoader worker adds ``mb`` MB the worker keeps (an
    augmentation's buffers never let go of); read in the trial's own process, nothing."""

    def __init__(self, mb: int):
        super().__init__(256)
        self.mb, self.kept = mb, []

    def __getitem__(self, i: int):
        if get_worker_info() is not None:
            self.kept.append(np.ones(self.mb * 2**20, dtype=np.uint8))
        return super().__getitem__(i)


def hoarding_workers(mb: int = 64) -> Workload:
    """A DataLoader worker that holds more with every item, until something stops it."""
    return Workload(model=lambda: nn.Linear(8, 1), dataset=lambda: _Hoarder(mb), loss=_mse)
