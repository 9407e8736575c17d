"""dataset_cache on and off, side by side: ``tuner bench`` of the same config of an
input-bound workload (benchmarks/data_workloads.py: JPEG decode per item), with and
without the cache, in interleaved rounds; the cache's fill and memory beside the rates;
and the twin whose items differ between reads, which bench must refuse (exit 2).
``--augment``: the pair is the augmentation in the workers against on the device (GPU).
``--workload tokenized``: items tokenized per read, as Python lists of ids (writes
``cache_pairs_tokenized.json``).

    python benchmarks/cache_pairs.py [--rounds 3] [--device cuda] [--augment] [--workload jpeg|tokenized]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import HERE, paired_interval, run_bench, space_file, stamp

MEASURE = {"window_s": 0.5, "min_windows": 5, "max_windows": 8}
# per workload: its arguments, the config measured, and its twin's arguments (items that
# differ between reads)
WORKLOADS = {
    "jpeg": ({"size": 512, "image": 64}, {"micro_batch_size": 32, "num_workers": 1, "persistent_workers": True},
             {"random_crop": True}),
    "tokenized": ({"size": 8192}, {"micro_batch_size": 256, "num_workers": 1, "persistent_workers": True},
                  {"word_dropout": 0.1}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--augment", action="store_true",
                    help="the pair is augment_on host against device (cache on), not the cache off and on")
    ap.add_argument("--workload", default="jpeg", choices=sorted(WORKLOADS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    workload, (args, config, twin_args) = f"{HERE / 'data_workloads.py'}:{a.workload}", WORKLOADS[a.workload]
    sides: dict[bool, list[dict]] = {False: [], True: []}
    pair = ({False: {"dataset_cache": True, "augment_on": "host"}, True: {"dataset_cache": True, "augment_on": "device"}}
            if a.augment else {False: {"dataset_cache": False}, True: {"dataset_cache": True}})
    with tempfile.TemporaryDirectory() as tmp:
        space = space_file(Path(tmp), workload, args, name="cache", device=a.device, measure=MEASURE)
        for r in range(a.rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):  # interleaved, order alternated
                rec = run_bench(space, {**config, **pair[on]})
                sides[on].append({k: rec.get(k) for k in ("samples_per_sec", "cache_fill_s", "cache_mb",
                                                           "peak_host_memory_mb", "projected_run_s",
                                                           "data_wait_fraction", "startup_s")})
                print(f"{pair[on]}: {rec['samples_per_sec']:.1f} samples/s", flush=True)
        twin = space_file(Path(tmp), workload, {**args, **twin_args}, name="twin", measure=MEASURE)
        refused = subprocess.run([sys.executable, "-m", "tuner", "bench", str(twin), "--set", "dataset_cache=true"],
                                 capture_output=True, text=True)
    ratio, lo, hi = paired_interval([s["samples_per_sec"] for s in sides[True]],
                                    [s["samples_per_sec"] for s in sides[False]])
    print(f"cached / uncached = {ratio:.2f} (90% {lo:.2f}-{hi:.2f}); twin: exit {refused.returncode}: "
          f"{refused.stderr.strip()}")
    name = "augment_pairs" if a.augment else "cache_pairs" if a.workload == "jpeg" else f"cache_pairs_{a.workload}"
    out = Path(a.out or HERE / "out" / f"{name}.json")
    out.write_text(json.dumps({**stamp(), "workload": workload.rsplit("/", 1)[-1], "args": args, "config": config,
                               "pair": {"off": pair[False], "on": pair[True]}, "device": a.device,
                               "measure": MEASURE, "rounds": a.rounds, "uncached": sides[False], "cached": sides[True],
                               "cached_over_uncached": ratio, "interval_90": [lo, hi],
                               "twin": {"exit": refused.returncode, "stderr": refused.stderr.strip()}}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
