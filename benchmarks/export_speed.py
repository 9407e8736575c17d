"""Does the exported training script run as fast as ``bench`` measured the config?

For each built-in workload and config: ``export --format python`` writes the script
(``tuner.results.python_script``, what ``export`` writes), and it runs in a fresh
process with ``--steps N`` (N optimizer steps after its own 5 warm-up steps, epoch
boundaries included: N covers ``--epochs`` epochs). ``bench`` measures the same config
(``python -m tuner bench SPACE --set ... --json``). Runs interleaved A/B then B/A,
``--rounds`` rounds, medians; the target is a ratio within 10%.

Prints a table and writes JSON (default benchmarks/out/export_speed.json).

    python benchmarks/export_speed.py [--rounds 3] [--workloads conv,transformer]
"""

from __future__ import annotations

import argparse
import atexit
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import run_bench, space_file, stamp

CASES = {
    "conv": ({"size": 1024}, [
        {"precision": "bf16", "micro_batch_size": 64, "channels_last": True, "torch_threads": 2},
        {"precision": "bf16", "micro_batch_size": 64, "channels_last": True, "num_workers": 1,
         "persistent_workers": True, "torch_threads": 1},
    ]),
    "transformer": ({"size": 512}, [
        {"precision": "bf16", "micro_batch_size": 32, "torch_threads": 2},
    ]),
}


def script_for(workload: str, args: dict, config: dict, folder: Path) -> Path:
    from framework_speed import payload_for

    from tuner.results import python_script

    payload = payload_for(workload, args, config)
    path = folder / f"train_{workload}_{abs(hash(json.dumps(config, sort_keys=True)))}.py"
    path.write_text(python_script(payload))
    return path


def run_script(path: Path, steps: int) -> float:
    out = subprocess.run([sys.executable, str(path), "--steps", str(steps)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{path.name} failed: {out.stderr.strip()[-500:]}")
    return float(re.search(r"samples/sec: ([\d.]+)", out.stdout).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2, help="epochs the script's timed steps cover")
    ap.add_argument("--out", default="benchmarks/out/export_speed.json")
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="export-speed-"))
    atexit.register(shutil.rmtree, tmp, True)  # scratch: what it measured is in --out
    rows = []
    for workload in a.workloads.split(","):
        args, configs = CASES[workload]
        space = space_file(tmp, workload, args, name="export")
        for config in configs:
            script = script_for(workload, args, config, tmp)
            steps = a.epochs * args["size"] // config["micro_batch_size"]
            bench, exported = [], []
            for r in range(a.rounds):
                for which in (("bench", "script") if r % 2 == 0 else ("script", "bench")):
                    if which == "bench":
                        bench.append(run_bench(space, config)["samples_per_sec"])
                    else:
                        exported.append(run_script(script, steps))
            b, s = statistics.median(bench), statistics.median(exported)
            rows.append({"workload": workload, "args": args, "config": config, "steps": steps,
                         "bench_samples_per_sec": b, "script_samples_per_sec": s, "script_over_bench": s / b,
                         "bench_runs": bench, "script_runs": exported, "within_10pct": abs(s / b - 1) <= 0.10})
            print(f"{workload:<12} {json.dumps(config):<110} bench {b:8.1f}  script {s:8.1f}  ratio {s / b:5.3f}",
                  flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({**stamp(), "rounds": a.rounds, "rows": rows}, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
