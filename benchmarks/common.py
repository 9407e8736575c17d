"""What the benchmarks share: the stamp every JSON opens with, the workloads by case name,
the ``tuner bench`` runner, the plain loop's environment, and the paired interval of
interleaved rounds. The scripts beside it import it (``python benchmarks/X.py`` puts this
folder on the path); the package is imported by its public names only."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).parent
# Hugging Face model definitions on synthetic data, as a user wraps them
# (hf_workloads.py: BatchEncoding and dict batches, the model's own loss).
HF = str(HERE / "hf_workloads.py")
# a case name -> the workload
REFS = {"hf_gpt2": f"{HF}:gpt2", "hf_resnet": f"{HF}:resnet", "conv_long": "conv",
        "hf_gpt2_long": f"{HF}:gpt2", "hf_resnet_long": f"{HF}:resnet", "tiny": f"{HF}:tiny",
        "rows": str(HERE / "data_workloads.py") + ":rows",
        "reviews": str(HERE / "data_workloads.py") + ":reviews",
        "gru_reviews": str(HERE / "data_workloads.py") + ":gru_reviews",
        "utterances": str(HERE / "data_workloads.py") + ":utterances",
        # held-out landscapes' workloads, written after the measurement's rules
        **{name: str(HERE / "landscape_workloads.py") + f":{name}" for name in ("ocr", "csvrows", "mae")}}


def stamp() -> dict:
    """When, on what, and the command that wrote a benchmark's JSON."""
    from tuner.hardware import describe

    return {"date": time.strftime("%Y-%m-%d %H:%M"), "hardware": describe(),
            "command": " ".join(["python", *sys.argv])}


def plain_env(config: dict) -> dict:
    """The environment a user's own run of ``config`` starts with (``malloc_retain``: glibc's
    variables set)."""
    from tuner.knobs import MALLOC_RETAIN_ENV

    return {**os.environ, **(MALLOC_RETAIN_ENV if config.get("malloc_retain") else {})}


def on_core(core: int | None):
    """A ``preexec_fn`` that pins the new process (and all it starts) to one core, or None."""
    return None if core is None else (lambda: os.sched_setaffinity(0, {core}))


def space_file(folder: Path, workload: str, args: dict, name: str = "truth", device: str = "cpu",
               measure: dict | None = None) -> Path:
    """A space file for ``tuner bench`` on a case (``REFS``) or a built-in workload."""
    path = folder / f"{name}-{workload.rsplit('/', 1)[-1].replace(':', '-')}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "workload": REFS.get(workload, workload), "workload_args": args,
                                    "device": device, **({"measure": measure} if measure else {})}))
    return path


def run_bench(space: Path, config: dict, core: int | None = None) -> dict:
    """``python -m tuner bench SPACE --set ... --json``, the real command: its record."""
    sets = [a for k, v in config.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    out = subprocess.run([sys.executable, "-m", "tuner", "bench", str(space), *sets, "--json"],
                         capture_output=True, text=True, preexec_fn=on_core(core))
    if out.returncode != 0:
        raise RuntimeError(f"bench failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def paired_interval(a: list[float], b: list[float], level: float = 0.90) -> tuple[float, float, float]:
    """The geometric mean of the rounds' own ratios a/b and its ``level`` confidence
    interval (Student's t on the log ratios): a drift that lasts a round hits both sides
    of that round's ratio, and what is left of the noise sets the interval's width."""
    from scipy import stats

    logs = [math.log(x / y) for x, y in zip(a, b, strict=True)]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), 0.0, math.inf
    half = stats.t.ppf(0.5 + level / 2, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)
