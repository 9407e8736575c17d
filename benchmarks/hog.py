"""A CPU hog in the middle of a measurement: how close the figure stays to quiet runs,
with the tuner's disturbance detection on and off.

Each round measures one config four times, as trials (``tuner.trial.run_isolated``):
a quiet run, a run with a hog, the same hog with the detection off
(``max_interference: 1``, ``max_steal: 1``: no window is ever redone or left out), and
a quiet run; the two hogged runs swap places every round. The hog is one spinning
process per core, started when the measurement reports its first window, for
``--hog-s`` seconds. Each hogged figure is divided by the mean of its round's two quiet
runs; the medians over rounds are the figures (this VM's own speed drifts by up to 2x
within seconds, so single rounds say little).

Prints a table and writes JSON (default benchmarks/out/hog.json).

    python benchmarks/hog.py [--workload conv] [--rounds 6] [--hog-s 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from common import stamp

# the very hog the disturbance test starts (tests/helpers.py), from the repository's root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import hog_from_first_window  # noqa: E402
from tuner.hardware import describe, usable_cores  # noqa: E402
from tuner.trial import make_request, run_isolated  # noqa: E402

MEASURE = {"warmup_steps": 3, "window_s": 0.5, "min_windows": 6, "max_windows": 8, "max_timed_s": 30}
OFF = {"max_interference": 1.0, "max_steal": 1.0}


def measure(workload: str, config: dict, settings: dict, hog_s: float | None) -> dict:
    req = make_request(workload=workload, workload_args={}, config=config, device="cpu", measure=settings)
    if hog_s is None:
        return run_isolated(req, timeout_s=600)
    with hog_from_first_window(hog_s) as progress:
        return run_isolated(req, timeout_s=600, progress=progress)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="conv")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--hog-s", type=float, default=4.0)
    ap.add_argument("--out", default="benchmarks/out/hog.json")
    args = ap.parse_args()
    config = {"micro_batch_size": 32, "torch_threads": usable_cores(), "num_workers": 0}
    rounds = []
    for i in range(args.rounds):
        runs = {"quiet_before": measure(args.workload, config, MEASURE, None)}
        order = ["detection_on", "detection_off"] if i % 2 == 0 else ["detection_off", "detection_on"]
        for name in order:
            settings = MEASURE if name == "detection_on" else {**MEASURE, **OFF}
            runs[name] = measure(args.workload, config, settings, args.hog_s)
        runs["quiet_after"] = measure(args.workload, config, MEASURE, None)
        bad = [f"{k}: {r.get('reason')}" for k, r in runs.items() if r["status"] != "ok"]
        if bad:
            raise SystemExit(f"round {i + 1}: " + "; ".join(bad))
        quiet = (runs["quiet_before"]["samples_per_sec"] + runs["quiet_after"]["samples_per_sec"]) / 2
        row = {"round": i + 1, "quiet_samples_per_sec": quiet,
               "quiet_windows": [runs[k]["samples_per_sec_windows"] for k in ("quiet_before", "quiet_after")],
               "quiet_agreement": min(runs["quiet_before"]["samples_per_sec"], runs["quiet_after"]["samples_per_sec"])
               / max(runs["quiet_before"]["samples_per_sec"], runs["quiet_after"]["samples_per_sec"])}
        for name in ("detection_on", "detection_off"):
            r = runs[name]
            row[name] = {"samples_per_sec": r["samples_per_sec"], "ratio_to_quiet": r["samples_per_sec"] / quiet,
                         "disturbed": r["disturbed"], "windows_dropped": r["disturbed_windows_dropped"],
                         "windows_left_out": r["disturbed_windows_left_out"],
                         "max_outside_cores_in_figure": max((c or 0.0) for c in r["interference_cores_windows"]),
                         "steal_cores": r["steal_cores"], "windows": r["samples_per_sec_windows"],
                         "outside_cores_windows": r["interference_cores_windows"]}
        rounds.append(row)
        print(f"round {i + 1}: quiet {quiet:.1f} (before/after agree {row['quiet_agreement']:.2f}); "
              + "; ".join(f"{n.replace('_', ' ')} {row[n]['ratio_to_quiet']:.2f}"
                          f"{' (marked disturbed)' if row[n]['disturbed'] else ''}"
                          f", {row[n]['windows_dropped']} redone, {row[n]['windows_left_out']} left out"
                          for n in ("detection_on", "detection_off")), flush=True)

    def med(name: str, only_unmarked: bool = False) -> float | None:
        vals = [r[name]["ratio_to_quiet"] for r in rounds if not (only_unmarked and r[name]["disturbed"])]
        return statistics.median(vals) if vals else None

    summary = {name: {"median_ratio_to_quiet": med(name), "median_ratio_unmarked": med(name, True),
                      "rounds_within_10pct": sum(1 for r in rounds if abs(r[name]["ratio_to_quiet"] - 1) <= 0.10),
                      "rounds_marked_disturbed": sum(1 for r in rounds if r[name]["disturbed"])}
               for name in ("detection_on", "detection_off")}
    summary["median_quiet_agreement"] = statistics.median(r["quiet_agreement"] for r in rounds)
    print(f"\n{args.workload}, {config}, {len(rounds)} rounds, hog {args.hog_s:.0f} s on every core")
    print(f"{'':15} {'median hogged/quiet':>20} {'within 10%':>11} {'marked':>7}")
    for name in ("detection_on", "detection_off"):
        s = summary[name]
        print(f"{name.replace('_', ' '):15} {s['median_ratio_to_quiet']:>20.3f} "
              f"{s['rounds_within_10pct']:>8}/{len(rounds)} {s['rounds_marked_disturbed']:>7}")
    print(f"quiet runs before/after agree (median min/max): {summary['median_quiet_agreement']:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**stamp(), "machine": describe(), "workload": args.workload, "config": config,
                               "measure": MEASURE, "hog_s": args.hog_s, "rounds": rounds,
                               "summary": summary}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
