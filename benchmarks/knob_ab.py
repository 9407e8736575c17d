"""What one knob buys, by ``tuner bench`` and by the user's own plain loop.

For each workload (``benchmarks/truth.py``'s cases: the built-ins and two Hugging Face
models) and one of its configs, four runs per round, in a shuffled order each round:

- ``bench`` with the knob off and on (``python -m tuner bench SPACE --set ... --json``);
- ``plain`` with the knob off and on (``truth.py``'s plain loop, as a user writes it,
  in a fresh process for whole epochs; a knob the user sets in the environment, such as
  ``malloc_retain``, is set there).

Per workload: the medians, the paired on/off ratio of each side (geometric mean of the
rounds' own ratios, 90% interval), and bench's ``page_faults_per_step``. The two ratios
agreeing is what lets a search's pick stand for the user's run.

    python benchmarks/knob_ab.py --knob malloc_retain --rounds 3
    python benchmarks/knob_ab.py --knob malloc_retain --workloads conv,hf_gpt2 --pick 1
    python benchmarks/knob_ab.py --knob gc_freeze --device cuda --workloads rows   # truth.py's GPU cases

Prints a table and writes JSON (default benchmarks/out/knob_ab_<knob>.json).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import truth  # the plain loop
from common import REFS, paired_interval, run_bench, space_file, stamp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--knob", default="malloc_retain")
    ap.add_argument("--off", default="false", help="the knob's first value (JSON)")
    ap.add_argument("--on", default="true", help="the knob's second value (JSON)")
    ap.add_argument("--workloads", default="conv,transformer,multisource,files")
    ap.add_argument("--pick", type=int, default=0, help="which of truth.py's configs per workload")
    ap.add_argument("--set", action="append", default=['precision="fp32"'], metavar="KNOB=JSON",
                    help="override a knob in every config (default: precision fp32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs of the plain loop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (truth.py's GPU cases)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--resume", action="store_true", help="keep the rows already in --out; measure the rest")
    a = ap.parse_args()
    off, on = json.loads(a.off), json.loads(a.on)
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)}
    out = Path(a.out or Path(__file__).parent / "out" / f"knob_ab_{a.knob}.json")
    rng = random.Random(a.seed)
    rows = json.loads(out.read_text())["rows"] if a.resume and out.exists() else []
    with tempfile.TemporaryDirectory() as tmp:
        for workload in a.workloads.split(","):
            if any(row["workload"] == workload for row in rows):
                continue
            args, configs = (truth.GPU_CASES if a.device == "cuda" else truth.CASES)[workload]
            base = {**configs[a.pick], **overrides}
            space = space_file(Path(tmp), workload, args, device=a.device)
            runs: dict[str, list[dict]] = {"bench_off": [], "bench_on": [], "plain_off": [], "plain_on": []}
            for r in range(a.rounds):
                order = list(runs)
                rng.shuffle(order)
                for side in order:
                    config = {**base, a.knob: on if side.endswith("_on") else off}
                    t = time.time()
                    if side.startswith("bench"):
                        rec = run_bench(space, config)
                        keep = {k: rec.get(k) for k in ("samples_per_sec", "page_faults_per_step", "gc_share",
                                                        "peak_host_memory_mb", "spread", "disturbed")}
                    else:
                        keep = truth.run_plain(REFS.get(workload, workload), args, config, a.epochs, a.device)
                    runs[side].append({**keep, "round": r, "seconds": time.time() - t})
                    print(f"  {workload} round {r} {side}: {keep['samples_per_sec']:.1f} samples/s"
                          + (f", {keep['page_faults_per_step']:,.0f} faults/step"
                             if keep.get("page_faults_per_step") is not None else ""), flush=True)
            row = {"workload": workload, "device": a.device, "config": base, "knob": a.knob, "off": off, "on": on, "runs": runs}
            for side in ("bench", "plain"):
                x = [s["samples_per_sec"] for s in runs[f"{side}_on"]]
                y = [s["samples_per_sec"] for s in runs[f"{side}_off"]]
                row[f"{side}_median_off"], row[f"{side}_median_on"] = statistics.median(y), statistics.median(x)
                row[f"{side}_on_off"] = paired_interval(x, y)
            for side in ("bench", "plain"):
                for v in ("off", "on"):
                    row[f"{side}_faults_per_step_{v}"] = statistics.median(s.get("page_faults_per_step") or 0
                                                                           for s in runs[f"{side}_{v}"])
            if any(s.get("gc_share") is not None for s in runs["bench_off"]):  # the collections' share
                for v in ("off", "on"):
                    row[f"bench_gc_share_{v}"] = statistics.median(s.get("gc_share") or 0.0
                                                                   for s in runs[f"bench_{v}"])
            rows.append(row)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({**stamp(), "knob": a.knob, "rounds": a.rounds, "rows": rows}, indent=2))
    print(f"\n{a.knob}: {off} -> {on}, {a.rounds} rounds (medians; paired on/off ratio, 90% interval)")
    print(f"{'workload':<12} {'bench off':>10} {'bench on':>10} {'bench on/off':>22} "
          f"{'plain off':>10} {'plain on':>10} {'plain on/off':>22} {'bench faults off -> on':>22} {'plain faults off -> on':>22}")
    for row in rows:
        b, p = row["bench_on_off"], row["plain_on_off"]
        print(f"{row['workload']:<12} {row['bench_median_off']:>10.1f} {row['bench_median_on']:>10.1f} "
              f"{b[0]:>7.3f} ({b[1]:.3f}-{b[2]:.3f}) {row['plain_median_off']:>10.1f} "
              f"{row['plain_median_on']:>10.1f} {p[0]:>7.3f} ({p[1]:.3f}-{p[2]:.3f}) "
              f"{row['bench_faults_per_step_off']:>10,.0f} -> {row['bench_faults_per_step_on']:<8,.0f}"
              f"{row.get('plain_faults_per_step_off', 0):>10,.0f} -> {row.get('plain_faults_per_step_on', 0):<8,.0f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
