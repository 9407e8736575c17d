"""A dataset's items read once and kept in memory that DataLoader workers share.

    from tuner.data import cached
    train_set = cached(MyDataset(...))      # reads every item once, through __getitem__
    loader = DataLoader(train_set, num_workers=4, ...)

The guides' largest data-path gain: work done per item (decoding, resizing,
tokenizing) is done once, not once per epoch. The items live in a few flat tensors in
shared memory, one per field of an item, so the DataLoader's workers (forked or spawned)
read one copy, not one each; an item costs a slice and a copy, and a batch of items of
one shape (as the DataLoader reads them, through ``__getitems__``) one gathered copy.
A field is a tensor, a numpy array, a Python number or a list of Python numbers (token
ids as a tokenizer gives them), whose length may differ between items.

Only where it is correct: a sample of items is read twice first, and a dataset whose
items differ between reads (a random augmentation drawn in ``__getitem__``) is refused
with ``CacheRefused``: a cache would replay one draw every epoch. Keep the random part
per batch (``Workload(augment=...)``) and cache the rest.

Also here, whether DataLoader workers can run as a config asks: ``workers_repeat`` (an
iterable dataset that every worker reads whole) and ``workers_refused`` (a temp folder
too long for the sockets they hand batches over through).
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, Dataset, IterableDataset

from tuner.errors import KnobRefused


class CacheRefused(KnobRefused):
    """The dataset cannot be cached as it is; the message says why, naming the cache."""

    def __init__(self, message: str):
        super().__init__(message, "dataset_cache", values=[True])


_NUMBERS = {bool, int, float}


def _number_list(v: Any) -> bool:
    """A list of Python numbers of one type (token ids, multi-hot ids, a feature row), of
    any length: one leaf of the cache, so that items whose lists differ in length share
    one structure."""
    return type(v) is list and len(types := {type(e) for e in v}) <= 1 and types <= _NUMBERS


def flatten(item: Any) -> tuple[list[Any], Any]:
    """An item's leaves and structure as the cache keeps them: tensors, numpy arrays,
    Python numbers and lists of Python numbers."""
    return pytree.tree_flatten(item, is_leaf=_number_list)


def _leaf(v: Any) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(v))
    if isinstance(v, bool | int | float) or _number_list(v):
        # exact values: a float as float64, as the default collate makes it; an empty list takes its field's type
        first = (v[0] if v else 0) if isinstance(v, list) else v
        dtype = torch.bool if isinstance(first, bool) else torch.int64 if isinstance(first, int) else torch.float64
        try:
            return torch.tensor(v, dtype=dtype)
        except (OverflowError, RuntimeError) as exc:  # an int beyond int64
            raise CacheRefused(f"dataset_cache: an item holds a number the cache cannot keep ({exc})") from None
    raise CacheRefused(f"dataset_cache: an item holds a {type(v).__name__}; the cache keeps tensors, "
                       f"numpy arrays, numbers and lists of numbers")


def _kind(v: Any) -> str:
    """How a field's leaf comes back: a tensor, a numpy array, a list or a Python number."""
    if isinstance(v, torch.Tensor):
        return "tensor"
    if isinstance(v, np.ndarray):
        return "numpy"
    return "list" if isinstance(v, list) else type(v).__name__


def same_items(a: Any, b: Any) -> bool:
    """Whether two items (or batches) hold the same structure and the same values."""
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if sa != sb or len(la) != len(lb):
        return False
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or isinstance(x, np.ndarray):
            tx, ty = torch.as_tensor(x), torch.as_tensor(y)
            if tx.shape != ty.shape or tx.dtype != ty.dtype or not torch.equal(tx, ty):
                return False
        else:
            try:
                if bool(x != y):
                    return False
            except Exception:  # a comparison that yields no truth value (an object holding tensors): not told apart
                return False
    return True


def spread(n: int, sample: int = 8) -> list[int]:
    """``sample`` indices spread over a dataset of ``n`` items, first and last included."""
    return sorted({int(k * (n - 1) / max(1, sample - 1)) for k in range(min(sample, n))})


def check_cacheable(dataset: Any, sample: int = 8) -> None:
    """Raise ``CacheRefused`` unless ``dataset`` is map-style and ``sample`` of its items,
    spread over it, read the same twice."""
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise CacheRefused("dataset_cache: the dataset is iterable (no __getitem__ and __len__); the cache "
                           "reads items by index")
    n = len(dataset)
    if n == 0:
        raise CacheRefused("dataset_cache: the dataset is empty")
    if (on := items_device(dataset)) is not None:
        raise CacheRefused(f"dataset_cache: the dataset's items are already on {on}: a cache in host memory "
                           f"would only add a copy")
    first = None
    for i in spread(n, sample):
        item = dataset[i]
        if not same_items(item, dataset[i]):
            raise CacheRefused(f"dataset_cache: item {i} differs between two reads (a random transform in "
                               f"__getitem__?), so a cache would replay one draw every epoch; move the random "
                               f"part to Workload(augment=...), which runs per batch after the cache")
        spec = flatten(item)[1]
        if first is None:
            first = (i, spec)
        elif spec != first[1]:
            raise _structure_refused(first[0], i)


def _structure_refused(i: int, j: int) -> CacheRefused:
    return CacheRefused(f"dataset_cache: items {i} and {j} differ in structure; the cache keeps items of one "
                        f"shape of nesting (the same keys, the same tuple length; lists of numbers may differ "
                        f"in length)")


def items_device(dataset: Any) -> torch.device | None:
    """Where a map-style dataset's items live when not on the host (a dataset kept on the
    GPU, as a small one often is), read from its first item; None for host items, an
    iterable dataset (reading it would consume it) or an item that raises (the loader
    raises it in its own words)."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        return None
    try:
        item = dataset[0]
    except Exception:
        return None
    return next((leaf.device for leaf in pytree.tree_leaves(item)
                 if isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu"), None)


def device_items_refusal(dataset: Any, num_workers: int, pin_memory: bool) -> KnobRefused | None:
    """DataLoader workers and pinning for items already on a device: a worker cannot use
    the device from its forked process, and there is no host memory to pin."""
    if not (num_workers or pin_memory) or (on := items_device(dataset)) is None:
        return None
    if num_workers:
        return KnobRefused(f"knob 'num_workers={num_workers}': the dataset's items are already on {on}: a DataLoader "
                           f"worker cannot use the device from its own process, and the items need no loading",
                           "num_workers", at_least=1)
    return KnobRefused(f"knob 'pin_memory=true': the dataset's items are already on {on}: there is no host memory "
                       f"to pin", "pin_memory", values=[True])


@functools.cache
def workers_refused() -> str | None:
    """Why DataLoader workers cannot run in this process's environment, in one line, or
    None. A worker hands each batch's tensors over through a Unix socket that
    multiprocessing binds in a ``pymp-*`` folder under the temp folder (TMPDIR). Where
    that path is longer than the OS allows a socket's (108 bytes on Linux: a TMPDIR of
    about 76 characters or more), the handover fails in a background thread of the
    worker, and the training process waits for its first batch for ever. The probe binds
    a socket where multiprocessing would, under a name of the same length."""
    from multiprocessing import util

    if os.name == "nt" or not hasattr(socket, "AF_UNIX"):  # Windows: multiprocessing hands over by pipes
        return None
    parent = tempfile.gettempdir()
    choose = getattr(util, "_get_base_temp_dir", None)  # newer Pythons fall back to /tmp themselves
    if choose is not None:
        try:
            parent = choose(tempfile) or parent
        except Exception:  # another signature: the folder tempfile gives is the one used before it
            pass
    try:
        folder = tempfile.mkdtemp(prefix="pymp-", dir=parent)
    except OSError as exc:
        return f"the temp folder {parent} (TMPDIR) is not writable ({exc.strerror or exc}): set TMPDIR to one that is"
    path = os.path.join(folder, "listener-" + "x" * 8)  # multiprocessing's name for it: 8 random characters
    try:
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(path)
    except OSError as exc:
        # the fix before the path: a reason is cut at 300 characters, and the path may be long
        if "too long" not in str(exc):
            return f"DataLoader workers cannot hand batches over ({exc}): set TMPDIR to another folder than {parent}"
        return (f"DataLoader workers cannot hand batches over: set TMPDIR to a shorter folder (a socket's path "
                f"under it would be {len(os.fsencode(path))} bytes, over the OS's limit): {parent}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return None


class CollectionClock:
    """A ``gc.callbacks`` entry that hands each full (oldest-generation) collection's
    seconds to ``add``: a full collection scans every object the collector tracks, and
    stops the process while it runs."""

    def __init__(self, add: Callable[[float], None]) -> None:
        self.add, self._began = add, None

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.add(time.perf_counter() - self._began)
            self._began = None


class WorkerWatch:
    """What the training process reads of its DataLoader workers, each worker writing
    from its ``worker_init_fn`` to its slot of arrays it shares with the training
    process: the seconds of its own full garbage collections (summed around the timed
    windows), and its process id, for the heap it holds (``hostload.heap_bytes``). A worker
    started anew at each epoch (``persistent_workers`` off) writes to the same slots."""

    def __init__(self, workers: int) -> None:
        import multiprocessing

        self.workers = workers
        # inherited by the workers, or sent as they spawn
        self.seconds = multiprocessing.RawArray("d", workers)
        self.pids = multiprocessing.RawArray("q", workers)

    def __call__(self, worker_id: int) -> None:
        """In a worker, as it starts."""
        import gc

        def add(seconds: float) -> None:
            self.seconds[worker_id] += seconds

        self.pids[worker_id] = os.getpid()
        gc.callbacks.append(CollectionClock(add))

    def total(self) -> float:
        """Seconds all workers have spent in full collections so far."""
        return float(sum(self.seconds))


class CollateClock:
    """The loader's collate (``collate``, PyTorch's default where None), timed in every
    loading process: its seconds and the items it collated, each process in its own slots
    of an array it shares with the training process (slot 0 the training process's,
    worker k's slot k + 1; a worker started anew at each epoch adds to the same slot).
    A loading process's time per item is reading the item and its share of the collate:
    the cache saves the first, not the second (``diagnose``)."""

    def __init__(self, collate: Callable[[list], Any] | None, workers: int) -> None:
        import multiprocessing

        from torch.utils.data import default_collate

        self.collate = collate or default_collate
        self.slots = multiprocessing.RawArray("d", 2 * (workers + 1))  # (seconds, items) per process

    def __call__(self, items: list) -> Any:
        t0 = time.perf_counter()
        batch = self.collate(items)
        info = torch.utils.data.get_worker_info()
        slot = 2 * (info.id + 1 if info is not None else 0)
        self.slots[slot] += time.perf_counter() - t0
        self.slots[slot + 1] += len(items)
        return batch

    def totals(self) -> tuple[float, float]:
        """Seconds in the collate and items collated so far, all processes."""
        values = list(self.slots)
        return sum(values[0::2]), sum(values[1::2])


def workers_repeat(dataset: Any) -> bool:
    """Read an iterable dataset's first items through two DataLoader workers and tell
    whether each worker yields the whole stream (it does not split it by
    ``torch.utils.data.get_worker_info()``): the first items of the two workers are the
    same while one worker's first two differ (a stream of identical items tells nothing
    and reads as split). Every worker added would then train each item once more per
    epoch. False for a map-style dataset (the loader's sampler splits it) and for a
    stream too short to tell."""
    if not isinstance(dataset, IterableDataset):
        return False
    # items in the loader's order: worker 0's first, worker 1's first, worker 0's second
    it = iter(DataLoader(dataset, batch_size=None, num_workers=2, collate_fn=_identity))
    try:
        items = [next(it) for _ in range(3)]
    except StopIteration:
        return False
    finally:
        del it  # its workers end here
    first, other_worker, first_worker_next = items
    return same_items(first, other_worker) and not same_items(first, first_worker_next)


def item_bytes(item: Any) -> int:
    return sum(_leaf(v).nbytes for v in flatten(item)[0])


def estimate_bytes(dataset: Any, sample: int = 8) -> int:
    """The cache's size before it is built: the mean size of ``sample`` items, spread over
    the dataset, times its length."""
    idx = spread(len(dataset), sample)
    return int(sum(item_bytes(dataset[i]) for i in idx) / len(idx) * len(dataset))


class CachedDataset(Dataset):
    """``dataset``'s items, read once (by ``workers`` DataLoader processes, as an epoch
    reads them), kept as one flat shared-memory tensor per field. ``fill_s``: what that
    first read took; ``nbytes``: what the cache holds."""

    def __init__(self, dataset: Any, *, workers: int = 0, check: int = 8, max_bytes: int | None = None):
        check_cacheable(dataset, check)
        self.estimate = estimate_bytes(dataset, check)
        if max_bytes is not None and self.estimate > max_bytes:
            raise CacheRefused(f"dataset_cache: the cache would hold about {self.estimate / 2**20:,.0f} MB, over "
                               f"the {max_bytes / 2**20:,.0f} MB allowed")
        self.length = len(dataset)
        t0 = time.perf_counter()
        fields: list[list[torch.Tensor]] | None = None
        shapes: list[list[tuple]] = []
        self.spec = None
        self.numeric: list[str] = []  # per field: "tensor", "numpy", "list" or the Python number type
        reader = DataLoader(dataset, batch_size=None, shuffle=False, num_workers=workers,
                            collate_fn=_identity, persistent_workers=False)
        for index, item in enumerate(reader):
            leaves, spec = flatten(item)
            if fields is None:
                self.spec, fields, shapes = spec, [[] for _ in leaves], [[] for _ in leaves]
                self.numeric = [_kind(v) for v in leaves]
            elif spec != self.spec:
                raise _structure_refused(0, index)
            for f, shape, v in zip(fields, shapes, leaves, strict=True):
                t = _leaf(v)
                f.append(t.reshape(-1))
                shape.append(tuple(t.shape))
        assert fields is not None
        # one flat tensor per field, offsets and shapes beside it, all in shared memory
        self.data, self.offsets = [], []
        for j, f in enumerate(fields):
            # an empty list of numbers has no type of its own: it takes its field's
            dtypes = {t.dtype for t in f if t.numel() or self.numeric[j] != "list"} or {f[0].dtype}
            if len(dtypes) > 1:
                raise CacheRefused(f"dataset_cache: field {j} of the items changes dtype ({sorted(map(str, dtypes))})")
            dtype = dtypes.pop()
            sizes = torch.tensor([t.numel() for t in f], dtype=torch.int64)
            self.offsets.append(torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]).share_memory_())
            self.data.append(torch.cat([t.to(dtype) for t in f]).share_memory_())
            f.clear()
        self.shapes = [_shape_tensor(j, lst).share_memory_() for j, lst in enumerate(shapes)]
        # per field, the one shape all its items have (None where they differ, or hold nothing)
        self.uniform = [tuple(lst[0]) if len(set(lst)) == 1 and math.prod(lst[0]) > 0 else None for lst in shapes]
        self.nbytes = sum(t.nbytes for t in self.data + self.offsets + self.shapes)
        self.fill_s = time.perf_counter() - t0

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        if i < 0:
            i += self.length
        leaves = []
        for data, off, shapes, kind in zip(self.data, self.offsets, self.shapes, self.numeric, strict=True):
            # a copy: a collate or transform that writes into an item must not write the cache
            v = data[int(off[i]):int(off[i + 1])].view(torch.Size(shapes[i].tolist())).clone()
            if kind == "numpy":
                v = v.numpy()
            elif kind == "list":
                v = v.tolist()
            elif kind != "tensor":
                v = v.item()
            leaves.append(v)
        return pytree.tree_unflatten(leaves, self.spec)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """A batch's items at once, as the DataLoader asks where a dataset has this: a
        field whose items share one shape is gathered in one copy and split into its items
        (rather than a lookup, a slice and a copy per item), and a field whose items differ
        in shape is gathered by its items' spans and split at their lengths. Copies, as
        ``__getitem__``'s."""
        ix = torch.as_tensor(indices, dtype=torch.int64)
        ix = torch.where(ix < 0, ix + self.length, ix)
        columns = []
        for data, off, shapes, kind, shape in zip(self.data, self.offsets, self.shapes, self.numeric, self.uniform,
                                                  strict=True):
            if shape is not None:
                rows = data.view(-1, math.prod(shape)).index_select(0, ix).view(len(ix), *shape)
                if kind == "tensor":
                    column = list(rows.unbind(0))
                elif kind == "numpy":
                    column = [r.numpy() for r in rows.unbind(0)]
                else:  # Python numbers, or lists of them: one per item
                    column = rows.tolist()
            else:  # the items' spans gathered in one copy too, then split at their lengths
                starts, lengths = off[ix], off[ix + 1] - off[ix]
                within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
                flat = data[torch.repeat_interleave(starts, lengths) + within]
                if kind == "list":  # one conversion to Python numbers, then cut (a tensor per item costs more)
                    values, ends = flat.tolist(), lengths.cumsum(0).tolist()
                    column = [values[end - n:end] for n, end in zip(lengths.tolist(), ends, strict=True)]
                else:
                    column = [v.view(dims) for v, dims in zip(flat.split(lengths.tolist()), shapes[ix].tolist(),
                                                              strict=True)]
                if kind == "numpy":  # (numbers are all of one shape, (), so gathered above)
                    column = [v.numpy() for v in column]
            columns.append(column)
        make = _assembler(self.spec)
        return [make(leaves) for leaves in zip(*columns, strict=True)]


def _assembler(spec: Any) -> Callable[[tuple], Any]:
    """How an item is made from its leaves. Most items are one tensor, or a flat tuple,
    list or dict of leaves: those are made directly, since ``tree_unflatten`` walks the
    spec anew for every item, which costs more than the rest of a batch read. Any other
    structure is unflattened."""
    if spec.is_leaf():
        return lambda leaves: leaves[0]
    if all(spec.child(i).is_leaf() for i in range(spec.num_children)):
        if spec.type is tuple:
            return tuple
        if spec.type is list:
            return list
        if spec.type is dict:
            keys = list(spec.context)
            return lambda leaves: dict(zip(keys, leaves, strict=True))
    return lambda leaves: pytree.tree_unflatten(list(leaves), spec)


def _shape_tensor(field: int, shapes: list[tuple]) -> torch.Tensor:
    """One field's item shapes, a row each (one number of dimensions per field)."""
    ndims = {len(s) for s in shapes}
    if len(ndims) > 1:
        raise CacheRefused(f"dataset_cache: field {field} of the items changes its number of dimensions")
    return torch.tensor(shapes, dtype=torch.int64).reshape(len(shapes), ndims.pop())


def refusal(space: Any) -> str | None:
    """Why the space's workload cannot have ``dataset_cache`` (its dataset built here, a
    sample of items read twice), or None."""
    from tuner.workloads import load_workload

    workload = load_workload(space.model.workload, space.model.workload_args, space.base_dir)
    try:
        check_cacheable(workload.dataset())
    except CacheRefused as exc:
        return str(exc)
    return None


def _identity(item: Any) -> Any:
    return item


def cached(dataset: Any, *, workers: int = 0, check: int = 8, max_bytes: int | None = None) -> CachedDataset:
    """``dataset`` read once and kept in shared memory (see the module's docstring);
    ``workers``: DataLoader processes that read it; raises ``CacheRefused`` where a cache
    would be wrong or over ``max_bytes``."""
    return CachedDataset(dataset, workers=workers, check=check, max_bytes=max_bytes)
