"""What a trial costs beyond its timed windows: its process's start, and its end.

A search's time budget buys trials, and every trial pays a fixed part that measures
nothing: the spawned process imports torch and builds the workload before its first
step, and after its result is sent the process ends. For a few configs of the built-in
conv workload, ``--trials`` trials each, run one after another as a search runs them
(``tuner.trial.run_isolated``, the suite's short measure), each trial's wall is split at
the first message of its process and at its last window:

- ``start_s``: from the spawn to the process's first phase (interpreter, imports of
  torch and the workload, the request);
- ``measure_s``: from there to the last window (the model and DataLoader built, the
  warm-up, the windows);
- ``end_s``: from the last window to the driver holding an ended process (the record,
  the send, the exit, the join).

And the exit alone: ``python -c "import torch, torch._dynamo"`` against the same ending in
``os._exit(0)``, interleaved, ``--trials`` rounds: what the interpreter's teardown would
add to every trial's end (a trial's process skips it: ``tuner.trial._exit_now``).

Prints a table and writes JSON (default benchmarks/out/trial_overhead.json).

    python benchmarks/trial_overhead.py [--trials 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import stamp

from tuner import trial as trial_mod
from tuner.trial import make_request, run_isolated

MEASURE = {"warmup_steps": 2, "window_s": 0.2, "min_windows": 3, "max_windows": 4, "max_timed_s": 5.0}
CONFIGS = {
    "no workers": {"micro_batch_size": 32},
    "2 persistent workers": {"micro_batch_size": 32, "num_workers": 2, "persistent_workers": True},
}
IMPORTS = "import torch, torch._dynamo"


def one_trial(config: dict) -> dict:
    """One trial's wall, split at its process's first message and at its last window."""
    heard: list[float] = []
    original = trial_mod._Vigil.heard

    def heard_at(self, msg, now, progress):  # the driver's own clock, as each message lands
        heard.append(now)
        return original(self, msg, now, progress)

    trial_mod._Vigil.heard = heard_at
    try:
        t0 = time.perf_counter()
        r = run_isolated(make_request(workload="conv", workload_args={"size": 1024}, config=config,
                                      device="cpu", measure=MEASURE))
        t1 = time.perf_counter()
    finally:
        trial_mod._Vigil.heard = original
    if r["status"] != "ok" or not heard:
        raise SystemExit(f"trial {config} did not measure: {r.get('reason')}")
    return {"start_s": heard[0] - t0, "measure_s": heard[-1] - heard[0], "end_s": t1 - heard[-1], "wall_s": t1 - t0}


def exit_cost(rounds: int) -> dict:
    """The interpreter's teardown with torch imported: a process that imports it and ends,
    against one that ends in ``os._exit``, interleaved (the order turns each round)."""
    walls: dict[str, list[float]] = {"teardown": [], "os._exit": []}
    codes = {"teardown": IMPORTS, "os._exit": IMPORTS + "; import os; os._exit(0)"}
    for i in range(rounds):
        for name in (list(codes) if i % 2 == 0 else list(codes)[::-1]):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", codes[name]], check=True)
            walls[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in walls.items()}
    return {"with_teardown_s": med["teardown"], "with_os_exit_s": med["os._exit"],
            "teardown_s": med["teardown"] - med["os._exit"], "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "trial_overhead.json"))
    args = ap.parse_args()
    rows = []
    for name, config in CONFIGS.items():
        runs = [one_trial(config) for _ in range(args.trials)]
        row = {"config": name, "trials": len(runs),
               **{k: statistics.median(r[k] for r in runs) for k in ("start_s", "measure_s", "end_s", "wall_s")}}
        row["fixed_share"] = (row["start_s"] + row["end_s"]) / row["wall_s"]
        rows.append(row)
        print(f"{name:24s} start {row['start_s']:.2f} s  measure {row['measure_s']:.2f} s  "
              f"end {row['end_s']:.2f} s  wall {row['wall_s']:.2f} s  (medians of {len(runs)})", flush=True)
    teardown = exit_cost(args.trials)
    print(f"interpreter teardown with torch imported: {teardown['teardown_s']:.2f} s "
          f"({teardown['with_teardown_s']:.2f} s against {teardown['with_os_exit_s']:.2f} s)")
    out = {**stamp(), "measure": MEASURE, "rows": rows, "teardown": teardown}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
