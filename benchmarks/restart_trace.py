"""What a DataLoader worker started anew each epoch does to the training process, step by step.

A user's loop (as ``user_loop.py`` writes it: a fresh process, the workload's model and
optimizer, ``DataLoader(shuffle=True, drop_last=True)`` with 1 worker) runs ``--epochs``
whole epochs, with ``persistent_workers`` on and off, ``--processes`` processes a side,
interleaved. Every step is timed and its minor page faults counted (getrusage). Per
setting:

- ``first_step_faults``: the page faults of an epoch's first step after the first epoch
  (with a worker started anew: the parent's pages copied on write after the fork);
- ``after_start``: the rate of steps 2-7 of the epochs after the first, where the user's
  loop puts a window that would hold a boundary;
- ``mid_epoch``: per process and epoch, the rate and page faults per step of the steps
  from the 9th to the epoch's end (bench's steady windows lie there);
- ``later_over_first``: per process, the later epochs' mid-epoch rate over the first's.

Prints a summary and writes JSON (default benchmarks/out/restart_trace.json).

    python benchmarks/restart_trace.py [--workload benchmarks/hf_workloads.py:gpt2] [--epochs 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HF_GPT2 = str(Path(__file__).with_name("hf_workloads.py")) + ":gpt2"


def trace(workload: str, args: dict, config: dict, epochs: int) -> list[dict]:
    """In this (fresh) process: every step's seconds and page faults, epoch by epoch."""
    import resource
    import time

    import torch
    from torch.utils.data import DataLoader

    from tuner.workloads import load_workload

    if config.get("torch_threads"):
        torch.set_num_threads(config["torch_threads"])
    torch.manual_seed(0)
    wl = load_workload(workload, args)
    model = wl.model()
    model.train()
    opt = wl.make_optimizer(model.parameters())
    loader = DataLoader(wl.dataset(), batch_size=config["micro_batch_size"], shuffle=True, drop_last=True,
                        collate_fn=wl.collate, num_workers=config["num_workers"],
                        persistent_workers=config["persistent_workers"])
    steps = []
    for e in range(epochs):
        it = iter(loader)  # a new worker forked here where it is not persistent
        for i in range(len(loader)):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            batch = next(it)  # the fetch is timed with the step: a user's run pays both
            loss = wl.loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps.append({"epoch": e, "step": i, "s": time.perf_counter() - t0,
                          "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0})
    return steps


def summarize(runs: list[list[dict]], bs: int) -> dict:
    def rate(steps: list[dict]) -> float:
        return bs * len(steps) / sum(x["s"] for x in steps)

    mid, later_first, after, first_faults = [], [], [], []
    for steps in runs:
        epochs = sorted({x["epoch"] for x in steps})
        per = [[x for x in steps if x["epoch"] == e and x["step"] >= 8] for e in epochs]
        mid.append([{"samples_per_sec": rate(p), "faults_per_step": statistics.mean(x["faults"] for x in p)}
                    for p in per])
        later_first.append(statistics.mean(rate(p) for p in per[1:]) / rate(per[0]))
        after.append(rate([x for x in steps if x["epoch"] > 0 and 1 <= x["step"] <= 6]))
        first_faults += [x["faults"] for x in steps if x["epoch"] > 0 and x["step"] == 0]
    return {"first_step_faults": [min(first_faults), statistics.median(first_faults), max(first_faults)],
            "after_start_samples_per_sec": after, "later_over_first": later_first, "mid_epoch": mid}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default=HF_GPT2)
    ap.add_argument("--args", default='{"size": 512}', help="the workload's arguments, as JSON")
    ap.add_argument("--config", default='{"precision": "fp32", "micro_batch_size": 16, "num_workers": 1, '
                                        '"torch_threads": 2}', help="the knobs, as JSON")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/out/restart_trace.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(trace(*json.loads(a.child))))
        return
    from common import stamp

    args, config = json.loads(a.args), json.loads(a.config)
    runs: dict[str, list] = {"persistent": [], "started_anew": []}
    for r in range(a.processes):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for setting in order:
            cfg = {**config, "persistent_workers": setting == "persistent"}
            out = subprocess.run([sys.executable, __file__, "--child", json.dumps([a.workload, args, cfg, a.epochs])],
                                 capture_output=True, text=True, check=True)
            runs[setting].append(json.loads(out.stdout.strip().splitlines()[-1]))
    repo = str(Path(__file__).resolve().parent.parent) + "/"
    result = {**stamp(), "workload": a.workload.replace(repo, ""), "args": args, "config": config, "epochs": a.epochs,
              "processes": a.processes,
              "settings": {k: summarize(v, config["micro_batch_size"]) for k, v in runs.items()}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    for k, s in result["settings"].items():
        mids = [round(e["samples_per_sec"]) for p in s["mid_epoch"] for e in p]
        print(f"{k:<13} first-step faults {s['first_step_faults']}  steps 2-7 "
              f"{[round(x) for x in s['after_start_samples_per_sec']]}  mid-epoch {min(mids)}-{max(mids)}  "
              f"later/first {[round(x, 3) for x in s['later_over_first']]}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
