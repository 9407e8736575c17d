"""dataset_cache on and off, side by side: ``tuner bench`` of the same config of an
input-bound workload (benchmarks/data_workloads.py: JPEG decode per item), with and
without the cache, in interleaved rounds; the cache's fill and memory beside the rates;
and the twin whose items differ between reads, which bench must refuse (exit 2).
``--augment``: the pair is the augmentation in the workers against on the device (GPU).

    python benchmarks/cache_pairs.py [--rounds 3] [--device cuda] [--augment]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import HERE, paired_interval, run_bench, space_file, stamp

WORKLOAD = f"{HERE / 'data_workloads.py'}:jpeg"
ARGS = {"size": 512, "image": 64}
MEASURE = {"window_s": 0.5, "min_windows": 5, "max_windows": 8}
CONFIG = {"micro_batch_size": 32, "num_workers": 1, "persistent_workers": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--augment", action="store_true",
                    help="the pair is augment_on host against device (cache on), not the cache off and on")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sides: dict[bool, list[dict]] = {False: [], True: []}
    pair = ({False: {"dataset_cache": True, "augment_on": "host"}, True: {"dataset_cache": True, "augment_on": "device"}}
            if a.augment else {False: {"dataset_cache": False}, True: {"dataset_cache": True}})
    with tempfile.TemporaryDirectory() as tmp:
        space = space_file(Path(tmp), WORKLOAD, ARGS, name="cache", device=a.device, measure=MEASURE)
        for r in range(a.rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):  # interleaved, order alternated
                rec = run_bench(space, {**CONFIG, **pair[on]})
                sides[on].append({k: rec.get(k) for k in ("samples_per_sec", "cache_fill_s", "cache_mb",
                                                           "peak_host_memory_mb", "projected_run_s",
                                                           "data_wait_fraction", "startup_s")})
                print(f"{pair[on]}: {rec['samples_per_sec']:.1f} samples/s", flush=True)
        twin = space_file(Path(tmp), WORKLOAD, {**ARGS, "random_crop": True}, name="twin", measure=MEASURE)
        refused = subprocess.run([sys.executable, "-m", "tuner", "bench", str(twin), "--set", "dataset_cache=true"],
                                 capture_output=True, text=True)
    ratio, lo, hi = paired_interval([s["samples_per_sec"] for s in sides[True]],
                                    [s["samples_per_sec"] for s in sides[False]])
    print(f"cached / uncached = {ratio:.2f} (90% {lo:.2f}-{hi:.2f}); twin: exit {refused.returncode}: "
          f"{refused.stderr.strip()}")
    out = Path(a.out or HERE / "out" / ("augment_pairs.json" if a.augment else "cache_pairs.json"))
    out.write_text(json.dumps({**stamp(), "workload": WORKLOAD.rsplit("/", 1)[-1], "args": ARGS, "config": CONFIG,
                               "pair": {"off": pair[False], "on": pair[True]}, "device": a.device,
                               "measure": MEASURE, "rounds": a.rounds, "uncached": sides[False], "cached": sides[True],
                               "cached_over_uncached": ratio, "interval_90": [lo, hi],
                               "twin": {"exit": refused.returncode, "stderr": refused.stderr.strip()}}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
