"""What reading a batch from dataset_cache costs the DataLoader, per item: the cache read
one item at a time (``__getitem__``, as PyTorch's fetcher reads a dataset without
``__getitems__``) against a batch at once (``__getitems__``, which the fetcher calls
where a dataset has it), with the same items held in a Python list beside them (what a
dataset already in memory costs). Epochs of a DataLoader with no workers, shuffled,
through the case's collate; the variants interleaved in rounds, each figure the median
epoch over its item count.

    python benchmarks/cache_read.py [--rounds 3] [--epochs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import HERE, stamp
from torch.utils.data import DataLoader, Dataset

from tuner.data import cached


class OneByOne(Dataset):
    """``items`` read one at a time: PyTorch's fetcher reads so a dataset without
    ``__getitems__`` (the cache, through this wrapper; a list is read so as it is)."""

    def __init__(self, items: Dataset | list):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def _pad(items: list) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(t) for t, _ in items)
    x = torch.zeros(len(items), n, dtype=torch.long)
    for j, (t, _) in enumerate(items):
        x[j, :len(t)] = t
    return x, torch.tensor([y for _, y in items])


def cases() -> dict[str, tuple[list, int, object]]:
    """name -> (items, batch, collate): rows of a table, token sequences of varying
    length with a padding collate, images."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 129, (20_000,), generator=g).tolist()
    return {
        "rows (64 floats, a label)": ([(torch.randn(64, generator=g), float(i % 2)) for i in range(50_000)], 4096, None),
        "tokens (20-128, padded)": ([(torch.randint(0, 5000, (n,), generator=g), i % 4)
                                     for i, n in enumerate(lengths)], 400, _pad),
        "images (3x64x64, a label)": ([(torch.randn(3, 64, 64, generator=g), i % 10) for i in range(4_000)], 128, None),
    }


def epoch_us(ds: Dataset, batch: int, collate: object) -> float:
    loader = DataLoader(ds, batch_size=batch, shuffle=True, collate_fn=collate)
    t0 = time.perf_counter()
    for _ in loader:
        pass
    return (time.perf_counter() - t0) / len(ds) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "out" / "cache_read.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, (items, batch, collate) in cases().items():
        cache = cached(items)
        variants = {"listed": items, "cache_one_by_one": OneByOne(cache), "cache_batch": cache}
        seen: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(a.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for k in order:
                seen[k] += [epoch_us(variants[k], batch, collate) for _ in range(a.epochs)]
        row = {"case": name, "items": len(items), "batch": batch,
               **{f"{k}_us_per_item": statistics.median(v) for k, v in seen.items()}}
        row["one_by_one_over_batch"] = row["cache_one_by_one_us_per_item"] / row["cache_batch_us_per_item"]
        rows.append(row)
        print(f"{name}: listed {row['listed_us_per_item']:.2f} us/item, cache one by one "
              f"{row['cache_one_by_one_us_per_item']:.2f}, cache batch {row['cache_batch_us_per_item']:.2f} "
              f"({row['one_by_one_over_batch']:.2f}x)")
    out = Path(a.out)
    out.write_text(json.dumps({**stamp(), "rounds": a.rounds, "epochs": a.epochs, "threads": 1, "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
