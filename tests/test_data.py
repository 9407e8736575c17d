"""dataset_cache (tuner.data): items read once into shared memory, refused where wrong."""

import collections
import json
import subprocess
import sys

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from tests.fixture_workloads import Decoded
from tests.helpers import ref, space_lines
from tuner.data import CacheRefused, cached


class Mixed(torch.utils.data.Dataset):
    """Dicts of a tensor, a variable-length tensor, a numpy array and numbers."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(2, 3, generator=g), "tokens": torch.arange(i % 7 + 1),
                "arr": np.full(3, i, dtype=np.float32), "label": i % 3, "weight": 0.5 * i}


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def test_a_deterministic_dataset_is_cached_and_read_back_equal():
    ds = Mixed()
    c = cached(ds, workers=2)
    assert len(c) == len(ds) and c.fill_s > 0 and c.nbytes > 0
    assert all(same(c[i], ds[i]) for i in range(len(ds)))
    c[3]["x"].zero_()  # a caller writing into an item does not write the cache
    assert same(c[3], ds[3])


def test_a_batch_read_at_once_is_the_items_read_one_by_one():
    """The DataLoader reads a batch through ``__getitems__``: a field whose items share a
    shape is gathered in one copy (x, arr and the numbers here), the variable-length one
    item by item; either way the items equal ``__getitem__``'s, of the same types, and a
    caller writing into one does not write the cache."""
    ds = Mixed()
    c = cached(ds)
    assert [shape is not None for shape in c.uniform] == [True, False, True, True, True]
    indices = [5, 0, 39, -1, 7, 7]
    batch = c.__getitems__(indices)
    assert len(batch) == len(indices) and all(same(item, ds[i % len(ds)]) for item, i in zip(batch, indices, strict=True))
    batch[0]["x"].zero_()
    batch[1]["tokens"].zero_()
    batch[1]["arr"][:] = -1
    assert same(c[5], ds[5]) and same(c[0], ds[0])
    # through a DataLoader (a collate that keeps the items: the tokens differ in length)
    assert same(list(DataLoader(c, batch_size=8, collate_fn=list)), list(DataLoader(ds, batch_size=8, collate_fn=list)))

    # items of every structure come back as they went in: one tensor, a flat tuple or list
    # (made directly), a namedtuple and a nested one (unflattened), empty tensors among them
    pair = collections.namedtuple("pair", "x y")
    for make in (lambda i: torch.full((2,), float(i)), lambda i: (torch.arange(i), i), lambda i: [float(i), i],
                 lambda i: pair(torch.full((2,), float(i)), i), lambda i: ({"a": i}, torch.zeros(i % 3))):
        items = [make(i) for i in range(5)]
        c = cached(items)
        assert same(c.__getitems__([0, 3, -1]), [items[i] for i in (0, 3, 4)])
        assert type(c.__getitems__([1])[0]) is type(items[1])


class Rows(torch.utils.data.Dataset):
    """Items as a tokenizer or a table gives them: Python lists of numbers whose length
    differs from item to item (token ids, a few ids per field, possibly none), floats a
    float32 would round, and booleans."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": list(range(100, 100 + 3 + i * 7 % 20)), "fields": [[i] * (i % 4), [i, i + 1]],
                "label": 0.1 * i, "weights": [0.1 * i] * (i % 3), "flag": i % 2 == 0}


def test_lists_of_numbers_that_differ_in_length_are_cached_and_read_back_as_lists():
    """Lists of numbers are one part of an item each, whatever their length, so items whose
    lists differ in length share one structure; they come back as lists of the same
    numbers, floats exact, one by one and a batch at once."""
    ds = Rows()
    c = cached(ds)
    assert c.numeric == ["list", "list", "list", "float", "list", "bool"]
    assert all(same(c[i], ds[i]) for i in range(len(ds)))
    assert same(c.__getitems__([29, 0, 4, 4]), [ds[i] for i in (29, 0, 4, 4)])
    assert c[7]["label"] == 0.1 * 7  # a float32 would read 0.699999988079071
    # through a DataLoader and PyTorch's own collate, the batches are the uncached ones
    for a, b in zip(DataLoader(c, batch_size=1), DataLoader(ds, batch_size=1), strict=True):
        assert same(a, b)


def test_items_that_differ_in_structure_are_refused_before_the_cache_reads_them():
    """A key present in some items only is found in the sample read up front, naming two
    items, not after the whole dataset was read."""
    reads = []

    class Ragged(Rows):
        def __getitem__(self, i: int) -> dict:
            reads.append(i)
            item = super().__getitem__(i)
            return item if i < 20 else {**item, "extra": 1}

    with pytest.raises(CacheRefused, match=r"^dataset_cache: items 0 and 20 differ in structure"):
        cached(Ragged())
    assert max(reads) == 20 and len(reads) < len(Ragged())  # the sample up to the first that differs


def test_a_random_dataset_and_an_iterable_one_are_refused_naming_the_cache():
    with pytest.raises(CacheRefused, match=r"^dataset_cache: item \d+ differs between two reads") as refused:
        cached(Decoded(16, 0.0, random=True))
    assert refused.value.refusal == {"knob": "dataset_cache", "values": [True]}  # no other cached config runs

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(CacheRefused, match="^dataset_cache: the dataset is iterable"):
        cached(Stream())
    with pytest.raises(CacheRefused, match="over the 0 MB allowed"):
        cached(Mixed(), max_bytes=10)


def _cache_pages(worker: psutil.Process, cache) -> list[tuple[str, int, int]]:
    """The mappings of ``worker`` that hold the cache: their file, resident bytes and
    bytes of their own (pages no other process maps)."""
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
             for t in cache.data]
    held = []
    for m in worker.memory_maps(grouped=False):
        lo, hi = (int(a, 16) for a in m.addr.split("-"))
        if any(lo < b and a < hi for a, b in spans):
            held.append((m.path, m.rss, m.private_clean + m.private_dirty))
    return held


@pytest.mark.parametrize("persistent", [True, False])
def test_workers_read_one_shared_copy_across_epochs(persistent):
    class Big(torch.utils.data.Dataset):  # about 256 MB of items
        def __len__(self) -> int:
            return 512

        def __getitem__(self, i: int):
            return torch.full((128, 1024), float(i)), i

    c = cached(Big())
    assert c.nbytes > 250 * 2**20
    loader = DataLoader(c, batch_size=32, num_workers=2, persistent_workers=persistent, shuffle=True)
    seen_by_epoch, maps = [], []
    try:
        for _ in range(2):  # the second epoch: workers kept, or started anew
            seen = {}
            for n, (x, y) in enumerate(loader, 1):
                seen.update({int(i): float(v[0, 0]) for i, v in zip(y, x, strict=True)})
                if n == len(loader) - 1:
                    maps.append([_cache_pages(w, c) for w in psutil.Process().children()
                                 if w.name() == "pt_data_worker"])
            seen_by_epoch.append(seen)
    finally:
        del loader  # persistent workers end here, whatever is asserted
    for workers in maps:
        # each worker has read items all over the cache through a shared-memory file that
        # every process maps (none of its pages the worker's own): one copy, not one each.
        # (A worker's whole memory is no measure: a forked worker's garbage collection
        # copies the pages of whatever objects the parent process holds.)
        assert len(workers) == 2 and all(held for held in workers), workers
        assert all(path.startswith(("/dev/shm/", "/memfd:")) and private == 0
                   for held in workers for path, _, private in held), workers
        assert sum(resident for held in workers for _, resident, _ in held) > 0.8 * c.nbytes, (workers, c.nbytes)
    assert seen_by_epoch == [{i: float(i) for i in range(512)}] * 2


def test_bench_with_the_cache_records_its_fill_and_a_random_twin_exits_2(tmp_path):
    space = tmp_path / "s.yaml"
    space.write_text(f"name: c\nworkload: {ref('decoded')}\nworkload_args: {{size: 64, decode_s: 0.001}}\n"
                     "knobs:\n  micro_batch_size: [8]\n  num_workers: 1\n  dataset_cache: [false, true]\n"
                     + space_lines())
    r = subprocess.run([sys.executable, "-m", "tuner", "bench", str(space), "--set", "dataset_cache=true", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["config"]["dataset_cache"] is True and rec["cache_fill_s"] >= 64 * 0.001 * 0.9
    assert rec["cache_mb"] > 0 and rec["startup_s"] >= rec["cache_fill_s"]  # paid once, up front
    twin = tmp_path / "t.yaml"
    twin.write_text(space.read_text().replace("decode_s: 0.001}", "decode_s: 0.0, random: true}"))
    r = subprocess.run([sys.executable, "-m", "tuner", "bench", str(twin), "--set", "dataset_cache=true"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "dataset_cache" in r.stderr, r.stderr


def test_a_search_holds_the_cache_off_with_a_note_where_items_differ(tmp_path, capsys):
    from tuner import spec
    from tuner.cli import _check_cache

    space_file = tmp_path / "s.yaml"
    space_file.write_text(f"name: c\nworkload: {ref('decoded')}\nworkload_args: {{decode_s: 0.0, random: true}}\n"
                          "knobs:\n  micro_batch_size: [8, 16]\n  dataset_cache: [false, true]\n")
    space = spec.load(space_file)
    _check_cache(space)
    assert space.domain["dataset_cache"] == [False] and space.model.knobs["dataset_cache"] is False
    assert "holds dataset_cache off" in capsys.readouterr().err


def test_augment_runs_in_the_workers_collate_or_on_the_device():
    from tuner.loop import AugmentedCollate, Trainer
    from tuner.trial import make_request, resolve_config

    for place in ("host", "device"):
        req = make_request(workload=ref("decoded"), workload_args={"size": 64, "decode_s": 0.0, "augment": True},
                           device="cpu", config={"augment_on": place, "num_workers": 1, "micro_batch_size": 8,
                                                 "dataset_cache": True})
        config, _, workload, device = resolve_config(req)
        t = Trainer(workload, config, device)
        assert isinstance(t.loader.collate_fn.collate, AugmentedCollate) == (place == "host")  # inside its clock
        assert t.augment_on_device == (place == "device")
        t.start()
        for _ in range(3):
            t.step()
        assert t.loss_finite()


class Constant(IterableDataset):
    """Every worker yields the same item over and over: nothing tells whether it splits."""

    def __iter__(self):
        return iter([torch.ones(3)] * 16)


def test_an_iterable_dataset_that_every_worker_reads_whole_is_told_apart():
    from tests.fixture_workloads import Numbers, Stream, Unsplit
    from tuner.data import workers_repeat

    assert workers_repeat(Unsplit(32))
    assert not workers_repeat(Stream(32))  # split by get_worker_info()
    assert not workers_repeat(Constant())  # no verdict: one item over and over
    assert not workers_repeat(Numbers(32))  # map-style: the sampler splits it
    assert not workers_repeat(Unsplit(1))  # too short to tell: one item per worker
    # a batch object whose == gives a tensor (no truth value) cannot be told the same: no refusal, no error
    from collections import UserDict

    from tuner.data import same_items

    assert not same_items(UserDict(x=torch.ones(3)), UserDict(x=torch.ones(3)))


# A DataLoader whose two workers deliver one epoch of 8 batches; its `timeout` (argv[1])
# turns a loader that waits for ever for its first batch into an error.
_LOADS = ("import sys, torch\nfrom torch.utils.data import DataLoader\n"
          "print(sum(1 for _ in DataLoader(torch.arange(64.0), batch_size=8, num_workers=2, "
          "timeout=float(sys.argv[1]))))")


def _padded(root, length: int):
    """A folder under ``root`` whose path is ``length`` characters long."""
    folder = root / ("p" * (length - len(str(root)) - 1))
    folder.mkdir(exist_ok=True)
    assert len(str(folder)) == length
    return folder


def _workers_deliver(tmpdir, timeout_s: float) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-c", _LOADS, str(timeout_s)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TMPDIR": str(tmpdir)})


def test_workers_that_could_not_hand_batches_over_are_told_at_the_temp_paths_where_they_hang(temp_dir, monkeypatch):
    """A worker hands its batches over through a Unix socket under TMPDIR; where that path
    would pass the OS's limit, the worker's handover fails in a thread and the loader
    waits for ever. The probe refuses exactly the TMPDIR lengths at which a real
    DataLoader's workers deliver nothing, and leaves nothing behind."""
    import tempfile

    from tuner.data import workers_refused

    def refused(length: int) -> str | None:
        monkeypatch.setattr(tempfile, "tempdir", str(_padded(temp_dir, length)))
        workers_refused.cache_clear()
        return workers_refused()

    short = len(str(temp_dir)) + 2
    try:
        assert refused(short) is None
        first = next(n for n in range(short, 300) if refused(n))
        why = refused(first)
    finally:
        workers_refused.cache_clear()  # the next test in this process probes its own TMPDIR
    assert "set TMPDIR to a shorter folder" in why and why.endswith(f": {_padded(temp_dir, first)}")
    assert list(_padded(temp_dir, short).iterdir()) == []  # the probe's folder and socket are gone
    fits = _workers_deliver(_padded(temp_dir, first - 1), timeout_s=60)
    assert fits.returncode == 0 and fits.stdout.strip() == "8", fits.stderr[-2000:]
    too_long = _workers_deliver(_padded(temp_dir, first), timeout_s=5)  # it would wait for ever
    assert too_long.returncode != 0 and "AF_UNIX path too long" in too_long.stderr, too_long.stderr[-2000:]
