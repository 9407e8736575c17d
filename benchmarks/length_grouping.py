"""What ``group_by_length`` buys, by ``tuner bench`` and by a plain loop over whole epochs.

For each case (``data_workloads.py``: ``reviews``, a transformer encoder layer that
computes on the padding, masked; ``gru_reviews``, a GRU over packed sequences that skips
most of it; ``reviews_respawned``, reviews loaded by one DataLoader worker that is started
again each epoch, ``persistent_workers`` off; ``utterances``, two encoder layers over
long-tailed turns whose epoch outlasts a trial, at bench's default windows and, as
``utterances_search``, at a search's), one config, four runs per round in a shuffled
order:

- ``bench`` with ``group_by_length`` off and on (``python -m tuner bench SPACE --set ...
  --json``);
- ``plain`` off and on: a user's loop in a fresh process, an untimed epoch and then three
  whole epochs, its DataLoader shuffled (off) or drawing the batches the exported script
  draws (on: ``tuner.loop.GroupedBatchSampler`` with the lengths).

Per workload: the medians, the paired on/off ratio of each side (geometric mean of the
rounds' own ratios, 90% interval), the share of the padded batches' positions that is
padding, and bench's window spread. The two ratios agreeing is what lets a search's pick
stand for the user's run.

    python benchmarks/length_grouping.py --rounds 3

Prints a table and writes JSON (default benchmarks/out/length_grouping.json); cases not run
(``--cases``) keep their last figures there.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REFS, paired_interval, plain_env, run_bench, space_file, stamp

CONFIG = {"precision": "fp32", "micro_batch_size": 64, "num_workers": 0, "malloc_retain": True}
# an epoch of turns several times longer than a search's trial: its figure is fitted on the
# batches the windows ran (windows.length_fit)
UTTERANCES = {"micro_batch_size": 32, "num_workers": 2, "persistent_workers": True, "torch_threads": 2}
# case -> (workload, its args, the config's knobs that differ from CONFIG, bench's measure
# settings where not its defaults)
CASES = {"reviews": ("reviews", {"size": 2048}, {}, None), "gru_reviews": ("gru_reviews", {"size": 2048}, {}, None),
         "reviews_respawned": ("reviews", {"size": 2048}, {"num_workers": 1, "persistent_workers": False}, None),
         "utterances": ("utterances", {}, UTTERANCES, None),
         # a search's trial: min_windows windows, no more (policy.measure_settings)
         "utterances_search": ("utterances", {}, UTTERANCES, {"window_s": 0.5, "min_windows": 5, "max_windows": 5})}


def _config(case: str) -> dict:
    return {**CONFIG, **CASES[case][2]}


def plain(case: str, on: bool, epochs: int = 3) -> float:
    """The plain loop in a fresh process (this file, ``--plain``): samples/sec."""
    out = subprocess.run([sys.executable, __file__, "--plain", case, "--on" if on else "--off",
                          "--epochs", str(epochs)], capture_output=True, text=True,
                         env=plain_env(_config(case)), check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _plain_here(case: str, on: bool, epochs: int) -> float:
    import data_workloads
    import torch

    from tuner.loop import GroupedBatchSampler

    workload, args, *_ = CASES[case]
    config = _config(case)
    wl = getattr(data_workloads, workload)(**args)
    if "torch_threads" in config:
        torch.set_num_threads(config["torch_threads"])
    torch.manual_seed(0)
    model, dataset = wl.model(), wl.dataset()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bs, workers = config["micro_batch_size"], config["num_workers"]
    loading = {"collate_fn": wl.collate, "num_workers": workers,
               **({"persistent_workers": config.get("persistent_workers", False)} if workers else {})}
    if on:
        sampler = GroupedBatchSampler(None, bs, lengths=wl.lengths(dataset), size=len(dataset), seed=1)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, **loading)
    else:
        loader = torch.utils.data.DataLoader(dataset, batch_size=bs, shuffle=True, drop_last=True, **loading)

    def step(batch) -> None:
        wl.loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for batch in loader:  # an untimed epoch: each padded shape's first kernels and allocations
        step(batch)
    n, t0 = 0, time.perf_counter()
    for _ in range(epochs):
        for batch in loader:
            step(batch)
            n += bs
    return n / (time.perf_counter() - t0)


def padding(case: str, on: bool) -> float:
    """The share of an epoch's padded batch positions that is padding."""
    import data_workloads

    from tuner.loop import GroupedBatchSampler

    workload, args, *_ = CASES[case]
    wl = getattr(data_workloads, workload)(**args)
    lengths, bs = wl.lengths(wl.dataset()), _config(case)["micro_batch_size"]
    if on:
        batches = list(GroupedBatchSampler(None, bs, lengths=lengths, size=len(lengths), seed=1))[1:]
    else:
        order = random.Random(1).sample(range(len(lengths)), len(lengths))
        batches = [order[i:i + bs] for i in range(0, len(order) - bs + 1, bs)]
    positions = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1 - sum(lengths[i] for b in batches for i in b) / positions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "length_grouping.json"))
    ap.add_argument("--plain", help=argparse.SUPPRESS)
    ap.add_argument("--on", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--off", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--epochs", type=int, default=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.plain:
        print(_plain_here(a.plain, a.on, a.epochs))
        return
    # A case not run this time keeps its last figures (each case says when it was measured).
    out = Path(a.out)
    kept = json.loads(out.read_text()).get("cases", {}) if out.exists() else {}
    results = {**stamp(), "config": CONFIG, "cases": kept}
    with tempfile.TemporaryDirectory() as tmp:
        for case in a.cases.split(","):
            workload, args, _, measure = CASES[case]
            space = space_file(Path(tmp), REFS[workload], args, name=f"length-{case}", measure=measure)
            runs: dict[str, list[float]] = {"bench_off": [], "bench_on": [], "plain_off": [], "plain_on": []}
            spread: dict[str, list[float]] = {"off": [], "on": []}
            for r in range(a.rounds):
                order = list(runs)
                random.Random(r).shuffle(order)
                for run in order:
                    side, on = run.split("_")[0], run.endswith("_on")
                    if side == "bench":
                        rec = run_bench(space, {**_config(case), "group_by_length": on})
                        runs[run].append(rec["samples_per_sec"])
                        spread["on" if on else "off"].append(rec["samples_per_sec_spread"])
                    else:
                        runs[run].append(plain(case, on))
                    print(f"{case} round {r + 1}: {run} {runs[run][-1]:,.1f}", flush=True)
            bench = paired_interval(runs["bench_on"], runs["bench_off"])
            user = paired_interval(runs["plain_on"], runs["plain_off"])
            results["cases"][case] = {
                "workload": workload, "args": args, "config": _config(case), "measure": measure, "rounds": a.rounds,
                "measured": results["date"], **runs,
                "medians": {k: statistics.median(v) for k, v in runs.items()},
                "bench_ratio": bench, "plain_ratio": user,
                "padding_off": padding(case, False), "padding_on": padding(case, True),
                "bench_spread": {k: statistics.median(v) for k, v in spread.items()}}
            print(f"{case}: padding {results['cases'][case]['padding_off']:.0%} -> "
                  f"{results['cases'][case]['padding_on']:.0%}; on/off bench {bench[0]:.2f} "
                  f"({bench[1]:.2f}-{bench[2]:.2f}), plain {user[0]:.2f} ({user[1]:.2f}-{user[2]:.2f})")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
