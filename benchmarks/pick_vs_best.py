"""Does a live search's pick hold against the best config of a recorded landscape?

The search's pick (``summary.json``'s best) and the landscape's best config (the highest
median over its grid figure and repeats) are each measured by ``tuner bench`` on the
search's space, interleaved: A/B in odd rounds, B/A in even ones, so that a drift of the
machine hits both. Knobs the landscape held fixed are set as it resolved them; a knob left
unset (``None``) is resolved by bench alike on both sides.

    python benchmarks/pick_vs_best.py --results /tmp/results/gpu_resnet50 \
        --landscape gpu_resnet50 --space search_spaces/gpu_resnet50.yaml --rounds 2

Writes JSON after every run (an interrupted run keeps what it measured); stops starting
runs where the next one would pass ``--deadline-s``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import paired_interval, run_bench, stamp

HERE = Path(__file__).parent
FIGURES = ("samples_per_sec", "joules_per_sample", "gpu_power_w", "peak_device_memory_mb", "compile_s",
           "trial_wall_s", "data_wait_fraction")


def landscape_best(name: str) -> tuple[dict, list[float]]:
    """The config the replay judges best on the landscape (``search_replay.judged_rates``:
    the mean of its repeats where the top configs have them, else first figures), resolved
    in full as the landscape ran it, and its recorded figures."""
    from search_replay import _load, judged_rates

    from tuner.spec import Canonical, SearchSpace

    landscape, space, ctx = _load(name)
    canon, ss = Canonical(space, ctx), SearchSpace(space, ctx)
    rates, _ = judged_rates(landscape, canon, ss)
    best = max(rates, key=rates.get)
    row = next(g for g in landscape["grid"] if canon(ss.active(g["config"])) == best)
    repeats = next((r["samples_per_sec"] for r in landscape.get("repeats") or []  # they begin with the grid's
                    if canon(ss.active(r["config"])) == best), [row["samples_per_sec"]])
    return json.loads(row["key"]), list(repeats)


def settable(config: dict) -> dict:
    """The knobs to pass with ``--set``: those with a value (``None`` is bench's own default)."""
    return {k: v for k, v in config.items() if v is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", required=True, help="the search's results folder (summary.json)")
    ap.add_argument("--landscape", required=True, help="a landscape in benchmarks/landscapes/")
    ap.add_argument("--space", required=True, help="the space bench measures both on")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--deadline-s", type=float, default=float("inf"))
    ap.add_argument("--out", default="benchmarks/out/pick_vs_best.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    summary = json.loads((Path(args.results) / "summary.json").read_text())
    pick = summary["best"]["config"]
    best, best_figures = landscape_best(args.landscape)
    sides = {"pick": settable(pick), "best": settable(best)}
    out = {"benchmark": "pick_vs_best", **stamp(), "landscape": args.landscape, "space": args.space,
           "search": {"configs": summary.get("trials"), "measurements": summary.get("measurements"),
                      "search_wall_s": summary.get("search_wall_s"), "pick_search_figure": summary["best"].get("samples_per_sec")},
           "landscape_best_figures": best_figures, "configs": sides, "runs": []}
    last_wall = 0.0
    for r in range(args.rounds):
        for side in (("pick", "best") if r % 2 == 0 else ("best", "pick")):
            if time.perf_counter() - t0 + last_wall > args.deadline_s:
                print(f"stopped before round {r + 1} {side}: the deadline is near", flush=True)
                break
            start = time.perf_counter()
            try:
                rec = run_bench(Path(args.space), sides[side])
                row = {"round": r + 1, "side": side, **{k: rec.get(k) for k in FIGURES}}
            except RuntimeError as err:
                row = {"round": r + 1, "side": side, "error": str(err)[-300:]}
            last_wall = time.perf_counter() - start
            out["runs"].append(row)
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
    got = {s: [x["samples_per_sec"] for x in out["runs"] if x["side"] == s and x.get("samples_per_sec")]
           for s in sides}
    if got["pick"] and got["best"]:
        out["pick_over_best"] = statistics.median(got["pick"]) / statistics.median(got["best"])
        n = min(len(got["pick"]), len(got["best"]))
        if n:
            out["paired"] = paired_interval(got["pick"][:n], got["best"][:n])
        print(f"pick / best: {out['pick_over_best']:.3f} (medians of {len(got['pick'])} and {len(got['best'])})")
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
