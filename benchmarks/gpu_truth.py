"""Does ``tuner bench`` agree with a plain loop on a GPU, on models of real size?

Two Hugging Face models built from their configs on synthetic data
(``benchmarks/hf_workloads.py``): GPT-2 124M (1024-token sequences) and ResNet-50
(224-pixel images made on each read, so the DataLoader's workers matter), 3 configs each:

- ``bench``: ``python -m tuner bench SPACE --set ... --json``, the real command, at its
  default measurement settings;
- ``plain``: ``benchmarks/user_loop.py --device cuda --epochs N``, the loop a user writes
  (the batch moved with ``.to(device, non_blocking=...)``, a ``torch.cuda.synchronize()``
  before each clock read), in a fresh process, given the config bench resolved (every
  knob, defaults included). Its figure is N whole epochs timed end to end (``--epochs``,
  0: the median of 5 windows of 6 steps inside epochs instead): where an epoch boundary
  costs (ResNet-50's 8 workers refill their queues at each one, about a fifth of a
  32-step epoch), windows inside epochs read above what a training run gets;
- interleaved: A/B in odd rounds, B/A in even ones; ``--rounds`` rounds; the ratio of the
  medians, the rounds' own ratios and their 90% interval (geometric mean, Student's t on
  the logs), peak device memory of both sides.

    python benchmarks/gpu_truth.py --models gpt2_124m,resnet50 --rounds 2 --out benchmarks/out/gpu_truth.json

Writes JSON after every row (an interrupted run keeps what it measured).
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import paired_interval
from common import run_bench as bench_command

ROOT = Path(__file__).resolve().parent.parent
HF = str(ROOT / "benchmarks" / "hf_workloads.py")
# Knobs set on every row so that the space's recommended values (compile on a GPU,
# malloc_retain on glibc) do not decide a row silently: the plain loop gets them too.
COMMON = {"compile": "off", "malloc_retain": False, "grad_accum_steps": 1}
MODELS = {
    "gpt2_124m": (f"{HF}:gpt2", {"size": 1024, "seq_len": 1024, "n_layer": 12, "n_embd": 768, "vocab": 50257}, [
        {"precision": "fp32", "micro_batch_size": 8, "num_workers": 0, "tf32": False, "fused_optimizer": False},
        {"precision": "bf16", "micro_batch_size": 16, "num_workers": 2, "persistent_workers": True,
         "pin_memory": True, "non_blocking": True, "fused_optimizer": True, "tf32": True},
        {"precision": "fp16", "micro_batch_size": 16, "num_workers": 0, "fused_optimizer": True, "tf32": True},
    ]),
    "resnet50": (f"{HF}:resnet50", {"size": 4096}, [
        {"precision": "fp32", "micro_batch_size": 64, "num_workers": 0, "channels_last": False,
         "cudnn_benchmark": False, "tf32": False, "fused_optimizer": False},
        {"precision": "bf16", "micro_batch_size": 128, "num_workers": 8, "persistent_workers": True,
         "pin_memory": True, "non_blocking": True, "channels_last": True, "cudnn_benchmark": True,
         "fused_optimizer": True},
        {"precision": "fp16", "micro_batch_size": 128, "num_workers": 4, "persistent_workers": False,
         "pin_memory": True, "non_blocking": True, "channels_last": True, "cudnn_benchmark": True},
    ]),
}


def resolved_config(space: Path, overrides: dict) -> dict:
    """The config bench measures for these overrides: the space's recommended config
    with them applied, every knob resolved (what the plain loop must be given)."""
    from tuner import spec
    from tuner.trial import bench_request

    return dict(bench_request(spec.load(space), overrides).config)


def run_bench(space: Path, overrides: dict) -> dict:
    r = bench_command(space, overrides)
    return {"samples_per_sec": r["samples_per_sec"], "steady_samples_per_sec": r.get("steady_samples_per_sec"),
            "epoch_overhead_s": r.get("epoch_overhead_s"), "peak_device_memory_mb": r.get("peak_device_memory_mb"),
            "mfu": r.get("mfu"), "windows": r.get("windows"), "gpu_util_pct": r.get("gpu_util_pct"),
            "gpu_power_w": r.get("gpu_power_w")}


def run_plain(ref: str, args: dict, config: dict, timeout: int, epochs: int) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "user_loop.py"), ref, json.dumps(args), json.dumps(config),
           "--device", "cuda", "--epochs", str(epochs)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode or not lines:
        raise RuntimeError(f"plain loop failed ({p.returncode}): {p.stderr[-800:]}")
    r = json.loads(lines[-1])
    r["windows_samples_per_sec"] = r["samples_per_sec"]
    if epochs:
        r["samples_per_sec"] = r["epochs_samples_per_sec"]
    return r


def describe_gpu() -> dict:
    from tuner.hardware import describe, nvml_status

    return {**describe(), "nvml": nvml_status()[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pick", default=None, help="only these configs per model, by index: 0,2")
    ap.add_argument("--epochs", type=int, default=3, help="whole epochs the plain loop times (0: windows)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per plain-loop run (bench stops at the space's trial time limit)")
    ap.add_argument("--out", default="benchmarks/out/gpu_truth.json")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpu-truth-"))
    atexit.register(shutil.rmtree, tmp, True)  # scratch: what it measured is in --out
    rows: list[dict] = []
    head = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": describe_gpu(),
            "command": "python benchmarks/gpu_truth.py " + " ".join(sys.argv[1:]), "rounds": a.rounds,
            "plain_epochs": a.epochs}

    def save() -> None:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({**head, "rows": rows}, indent=2, default=str))

    for name in a.models.split(","):
        ref, args, configs = MODELS[name]
        space = tmp / f"{name}.yaml"
        space.write_text(json.dumps({"name": name, "workload": ref, "workload_args": args, "device": "cuda",
                                     "knobs": {"micro_batch_size": [8]}}))
        picks = [int(i) for i in a.pick.split(",")] if a.pick else range(len(configs))
        for i in picks:
            overrides = {**COMMON, **configs[i]}
            config = resolved_config(space, overrides)
            bench, plain = [], []
            for r in range(a.rounds):
                order = ("bench", "plain") if r % 2 == 0 else ("plain", "bench")
                for side in order:
                    try:
                        if side == "bench":
                            bench.append(run_bench(space, overrides))
                        else:
                            plain.append(run_plain(ref, args, config, a.timeout, a.epochs))
                    except (RuntimeError, subprocess.SubprocessError) as exc:
                        print(f"{name} #{i} {side}: {exc}", file=sys.stderr)
            b = [x["samples_per_sec"] for x in bench]
            p = [x["samples_per_sec"] for x in plain]
            ratios = [x / y for x, y in zip(b, p, strict=False)]
            row = {"model": name, "config": configs[i], "resolved": config, "bench": b, "plain": p,
                   "ratio": statistics.median(b) / statistics.median(p) if b and p else None,
                   "round_ratios": ratios,
                   "interval90": list(paired_interval(b[:len(ratios)], p[:len(ratios)])[1:]) if len(ratios) > 1 else None,
                   "bench_peak_device_mb": [x["peak_device_memory_mb"] for x in bench],
                   "plain_peak_device_mb": [x.get("peak_device_memory_mb") for x in plain],
                   "plain_windows": [x["windows_samples_per_sec"] for x in plain],
                   "bench_steady": [x["steady_samples_per_sec"] for x in bench],
                   "bench_epoch_overhead_s": [x["epoch_overhead_s"] for x in bench],
                   "mfu": [x["mfu"] for x in bench], "gpu_util_pct": [x["gpu_util_pct"] for x in bench],
                   "gpu_power_w": [x["gpu_power_w"] for x in bench]}
            rows.append(row)
            save()
            ratio = f"{row['ratio']:.3f}" if row["ratio"] else "n/a"
            print(f"{name:10} #{i} {json.dumps(configs[i])[:80]:80} bench {statistics.median(b) if b else 0:8.1f} "
                  f"plain {statistics.median(p) if p else 0:8.1f} ratio {ratio} rounds {[round(x, 3) for x in ratios]}",
                  flush=True)
    save()


if __name__ == "__main__":
    main()
