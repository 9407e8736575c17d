"""The optimized loop at good settings vs the plain PyTorch loop, and vs the hardware limit.

For each built-in workload, on this machine:

- naive: the plain loop (fp32, num_workers=0, a .item() each step), ``bench --baseline``;
- good: the config the tuner itself picks (``run_search`` with the guided sampler,
  12 trials over precision, workers, threads, channels_last, malloc_retain and micro-batch, the top 3
  re-measured twice), each trial measured as always (``tuner.trial.run_isolated``);
- limit: on a GPU the compute-only ceiling (same step, data already on the device);
  on a CPU, where loading and compute share the cores, the work bound
  cores / (preprocessing s/sample + compute s/sample), each measured alone on one core;
- repeatability: the good config measured ``--repeats`` times, interleaved with as many
  plain-loop runs (good, naive, naive, good, ...); coefficient of variation.

Prints a table and writes JSON (default benchmarks/out/loop_vs_naive.json).

    python benchmarks/loop_vs_naive.py [--workloads conv,transformer,multisource] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import stamp
from torch.utils.data import default_collate

from tuner import apply, knobs
from tuner.hardware import usable_cores
from tuner.loop import Trainer, synchronize
from tuner.trial import make_request, run_isolated
from tuner.workloads import load_workload

MEASURE = {"warmup_steps": 3, "window_s": 1.0, "min_windows": 5, "max_windows": 12}
KNOBS = {
    # the knobs that matter on a CPU; on a GPU pin_memory/non_blocking/compile/cudnn join
    "cpu": {"precision": ["fp32", "bf16"], "num_workers": [0, 1, 2], "torch_threads": [1, 2],
            "channels_last": [False, True], "micro_batch_size": [32, 64, 128], "persistent_workers": [True],
            "malloc_retain": [False, True]},
    "cuda": {"precision": ["fp32", "bf16"], "num_workers": [0, 2, 4, 8], "micro_batch_size": [64, 128, 256],
             "persistent_workers": [True], "pin_memory": [True], "non_blocking": [True],
             "compile": ["off", "default"], "cudnn_benchmark": [True]},
}
# Datasets of a realistic epoch (the built-ins' defaults are small for quick tests).
ARGS = {"conv": {"size": 16384}, "transformer": {"size": 8192}, "multisource": {"size": 65536}}


def measure(workload: str, config: dict, baseline: bool = False, args: dict | None = None) -> dict:
    req = make_request(workload=workload, workload_args=args or {}, config=config, baseline=baseline,
                       device="auto", measure=MEASURE)
    return run_isolated(req, timeout_s=600)


def prep_seconds_per_sample(workload: str, args: dict, n: int = 512) -> float:
    """Dataset __getitem__ + collate, one core, in this process."""
    wl = load_workload(workload, args)
    ds = wl.dataset()
    collate = wl.collate or default_collate
    t = time.perf_counter()
    for i in range(0, n, 64):
        collate([ds[j % len(ds)] for j in range(i, i + 64)])
    return (time.perf_counter() - t) / n


def compute_seconds_per_sample(workload: str, args: dict, config: dict, device: torch.device,
                               threads: int | None) -> float:
    """The training step alone, data already in memory (on the device), ``threads`` threads;
    in a fresh process: a config's process-wide settings (malloc_retain's allocator
    thresholds and variables) must not reach this one, whose later searches start Ray."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_compute_seconds_per_sample, workload, args, config, str(device), threads).result()


def _compute_seconds_per_sample(workload: str, args: dict, config: dict, device: str | torch.device,
                                threads: int | None) -> float:
    device = torch.device(device)
    wl = load_workload(workload, args)
    ctx = apply.context_for(device, wl)
    cfg = knobs.resolve({**config, "num_workers": 0, "torch_threads": threads}, ctx, strict=False)[0]
    t = Trainer(wl, cfg, device)
    ds = t.dataset
    collate = wl.collate or default_collate
    bs = cfg["micro_batch_size"]
    batches = [collate([ds[j] for j in range(i * bs, (i + 1) * bs)]) for i in range(4)]
    t.feed(batches)
    for _ in range(3):
        t.step()
    rates = []
    for _ in range(5):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(5):
            t.step()
        synchronize(device)
        rates.append((time.perf_counter() - t0) / (5 * t.samples_per_step))
    return statistics.median(rates)


def tuner_pick(workload: str, args: dict, device: torch.device, out: Path) -> tuple[dict, dict]:
    """Run the tuner's own search; return its winner's config and the summary."""
    import shutil

    from tuner import spec
    from tuner.search import run_search

    knobs_ = dict(KNOBS[device.type])
    if workload == "multisource":
        knobs_["batch_grouping"] = ["mixed", "by_source"]
    space = spec.parse({"name": f"lvn-{workload}", "workload": workload, "workload_args": args,
                        "knobs": knobs_, "budget": {"trials": 12, "trial_timeout_s": 300},
                        "baseline": {"micro_batch_size": 64}, "measure": MEASURE})
    shutil.rmtree(out / space.name, ignore_errors=True)
    summary = run_search(space, results_root=out, quiet=True)
    return summary["best"]["config"], summary


def run(workload: str, args: dict, repeats: int, out: Path) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"\n== {workload} on {device.type}", flush=True)
    config, summary = tuner_pick(workload, args, device, out)
    print(f"  tuner's pick: {config} ({summary['search_wall_s']:.0f} s search)", flush=True)
    # The pick and the plain loop interleaved (good, naive, naive, good, ...): this VM's
    # speed drifts by tens of percent over minutes, which a plain loop measured once
    # before the search would put on the ratio.
    runs, naive_runs = [], []
    for i in range(repeats):
        for which in (("good", "naive") if i % 2 == 0 else ("naive", "good")):
            if which == "good":
                runs.append(measure(workload, config, args=args))
            else:
                naive_runs.append(measure(workload, {"micro_batch_size": 64}, baseline=True, args=args))
    naive = {"samples_per_sec": statistics.median(r["samples_per_sec"] for r in naive_runs)}
    print(f"  naive: {naive['samples_per_sec']:.1f} samples/s", flush=True)
    reps = [r["samples_per_sec"] for r in runs]
    steady = statistics.median(r["steady_samples_per_sec"] for r in runs)
    cv = statistics.stdev(reps) / statistics.mean(reps) if len(reps) > 1 else None
    if device.type == "cuda":
        compute = compute_seconds_per_sample(workload, args, config, device, None)
        limit, prep = 1.0 / compute, None
        limit_kind = "compute-only ceiling (data on the device)"
    else:
        cores = usable_cores()
        prep = prep_seconds_per_sample(workload, args)
        compute = compute_seconds_per_sample(workload, args, config, device, threads=1)
        limit = cores / (prep + compute)
        limit_kind = f"work bound: {cores} cores / (prep + compute s/sample, each alone on one core)"
    good_rate = statistics.median(reps)
    out = {
        "workload": workload, "args": args, "device": device.type,
        "naive_samples_per_sec": naive["samples_per_sec"],
        "naive_repeats": [r["samples_per_sec"] for r in naive_runs],
        "good_config": config, "good_samples_per_sec": good_rate, "good_steady_samples_per_sec": steady,
        "good_repeats": reps, "good_cv": cv,
        "prep_s_per_sample": prep, "compute_s_per_sample": compute,
        "limit_samples_per_sec": limit, "limit_kind": limit_kind,
        "good_over_naive": good_rate / naive["samples_per_sec"],
        "good_over_limit": good_rate / limit,
        "good_steady_over_limit": steady / limit,
        "search": {k: summary[k] for k in ("trials", "measurements", "search_wall_s", "overhead_ratio",
                                            "speedup_vs_baseline")},
    }
    print(f"  good {good_rate:.1f} (steady {steady:.1f}; cv {cv:.1%} over {repeats}) | naive {naive['samples_per_sec']:.1f} | "
          f"limit {limit:.1f} | good/naive {out['good_over_naive']:.2f} | good/limit {out['good_over_limit']:.2f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="conv,transformer,multisource")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/out/loop_vs_naive.json")
    a = ap.parse_args()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    results = [run(w, ARGS.get(w, {}), a.repeats, Path(a.out).parent / "results") for w in a.workloads.split(",")]
    Path(a.out).write_text(json.dumps({**stamp(), "measure": MEASURE, "results": results},
                                      indent=2, default=str))
    print(f"\n{'workload':<12} {'naive':>8} {'good':>8} {'limit':>8} {'good/naive':>10} {'good/limit':>10} "
          f"{'steady/limit':>12} {'cv':>6}")
    for r in results:
        print(f"{r['workload']:<12} {r['naive_samples_per_sec']:>8.1f} {r['good_samples_per_sec']:>8.1f} "
              f"{r['limit_samples_per_sec']:>8.1f} {r['good_over_naive']:>10.2f} {r['good_over_limit']:>10.2f} "
              f"{r['good_steady_over_limit']:>12.2f} {r['good_cv']:>6.1%}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
