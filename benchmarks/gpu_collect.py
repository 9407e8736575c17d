"""Gather what ``benchmarks/gpu_check.sh`` brought back from a lent GPU into one current
JSON, ``benchmarks/out/gpu.json``, for the results page:

- the GPU tests (``test_gpu.log``: passed or not, the known-rate line);
- the truth rows (``gpu_truth_*.json``: bench against a plain loop on the GPU);
- a knob's pair (``knob_ab_*_gpu.json``, ``gpu_check.sh gc``), copied to ``benchmarks/out/`` as it is;
- the searches (``gpu_<space>_trials.jsonl``, ``_summary.json``): the baseline (a plain
  PyTorch loop at PyTorch's defaults), the pick, its speed-up, MFU and NVML readings,
  beside a published MFU for the same model class on the same GPU where one is known.

    python benchmarks/gpu_collect.py [benchmarks/out/gpu]
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent

# Published MFU of the same model class on the same GPU, where one is known (which one
# and where it was said).
PUBLISHED = {
    "gpu_gpt2": {
        "mfu": 1.04 * 312 / 989,
        "what": "nanoGPT's train.py (GPT-2 124M, bf16, torch.compile, batch 12 x 1024 tokens) on one H100 "
                "80GB HBM3 printed 'mfu 104%' against the A100's 312 TFLOP/s, i.e. 33% of the H100's 989 "
                "(karpathy/nanoGPT pull request 464, 2024-03-24); FLOPs counted as here (6N + 12LHQT)",
    },
}


# The knobs of a GPU search's space that a page row shows of a config.
SHOWN = ("precision", "micro_batch_size", "num_workers", "persistent_workers", "pin_memory", "non_blocking",
         "compile", "channels_last", "cudnn_benchmark", "tf32", "fused_optimizer")


def _doctor_gpu(folder: Path) -> str | None:
    """The GPU the last `setup` stage saw (``doctor.log``'s "gpu 0" line): the tests ran there."""
    text = (folder / "doctor.log").read_text() if (folder / "doctor.log").is_file() else ""
    found = re.search(r"gpu 0\s+(.+?), [\d.]+ GiB", text)
    return found.group(1) if found else None


def _tests(folder: Path) -> dict:
    text = (folder / "test_gpu.log").read_text() if (folder / "test_gpu.log").is_file() else ""
    passed = re.search(r"(\d+) passed", text)
    failed = re.search(r"(\d+) failed", text)
    known = re.search(r"known rate ([\d.]+), tuner ([\d.]+), plain loop ([\d.]+)", text)
    out = {"passed": int(passed.group(1)) if passed else 0, "failed": int(failed.group(1)) if failed else 0,
           "log": "benchmarks/out/gpu/test_gpu.log", "gpu": _doctor_gpu(folder)}
    if known:
        ideal, tuner, plain = map(float, known.groups())
        out["known_rate"] = {"ideal": ideal, "tuner": tuner, "plain_loop": plain, "tuner_over_plain": tuner / plain}
    return out


def _truth(folder: Path) -> tuple[dict, list[dict]]:
    rows, device = [], {}
    for path in sorted(folder.glob("gpu_truth_*.json")):
        data = json.loads(path.read_text())
        device = data.get("device") or device
        for r in data["rows"]:
            rows.append({"model": r["model"], "config": r["config"], "plain": "windows" if path.stem.endswith(
                "_windows") or not data.get("plain_epochs") else f"{data['plain_epochs']} epochs",
                "date": data["date"], "bench": statistics.median(r["bench"]), "plain_rate": statistics.median(r["plain"]),
                "ratio": r["ratio"], "round_ratios": r["round_ratios"], "interval90": r["interval90"],
                "bench_peak_device_mb": max(r["bench_peak_device_mb"]),
                "plain_peak_device_mb": max(r["plain_peak_device_mb"]), "mfu": statistics.median(r["mfu"])})
    return device, rows


def _search(folder: Path, space: str) -> dict | None:
    trials = folder / f"gpu_{space}_trials.jsonl"
    if not trials.is_file():
        return None
    records = [json.loads(line) for line in trials.read_text().splitlines() if line.strip()]
    summary = json.loads((folder / f"gpu_{space}_summary.json").read_text())
    best = summary["best"]
    pick = [r for r in records if r.get("config") == best["config"] and r.get("status") == "ok"]
    # a config held back unrun (a compiled config under a time budget: its eager twin runs) is no measurement
    searched = [r for r in records if r.get("phase") == "search" and not r.get("skipped")]

    def med(key: str) -> float | None:
        xs = [r[key] for r in pick if r.get(key) is not None]
        return statistics.median(xs) if xs else None

    # parts of this page may come from different lent machines: each search names its own
    out = {"space": f"search_spaces/gpu_{space}.yaml", "gpu": summary.get("hardware", {}).get("gpu"),
           "date": time.strftime("%Y-%m-%d", time.gmtime(min(r["started_at"] for r in records if "started_at" in r))),
           "configs_measured": len(searched),
           "measurements": len([r for r in records if not r.get("skipped")]),
           "time_budget_s": _budget(folder / f"gpu_{space}_space.yaml"), "ended": (summary.get("policy") or {}).get("ended"),
           "pick_joules_per_sample": best.get("joules_per_sample"), "baseline_samples_per_sec": summary["baseline"]["samples_per_sec"],
           "pick_samples_per_sec": best["samples_per_sec"], "speedup": summary["speedup_vs_baseline"],
           "pick": {k: v for k, v in best["config"].items() if k in SHOWN},
           "pick_mfu": med("mfu"), "pick_tflops": med("achieved_tflops"), "gpu_util_pct": med("gpu_util_pct"),
           "gpu_power_w": med("gpu_power_w"), "gpu_sm_clock_mhz": med("gpu_sm_clock_mhz"),
           "gpu_memory_used_mb": med("gpu_memory_used_mb"), "peak_device_memory_mb": best.get("peak_device_memory_mb"),
           "compile_s": best.get("compile_s"), "data_wait_fraction": best.get("data_wait_fraction"),
           "baseline_mfu": statistics.median([r["mfu"] for r in records if r.get("phase") == "baseline"
                                              and r.get("mfu") is not None] or [0.0])}
    log = folder / f"gpu_{space}_search.log"
    wall = re.search(r"(\d+) trials, (\d+) measurements, (\d+) s", log.read_text()) if log.is_file() else None
    if wall:
        out["wall_s"] = int(wall.group(3))
    if f"gpu_{space}" in PUBLISHED:
        out["published"] = PUBLISHED[f"gpu_{space}"]
    side = folder / f"gpu_{space}_pick_vs_best.json"
    if side.is_file():
        out["pick_vs_best"] = _pick_vs_best(json.loads(side.read_text()))
    return out


def _budget(space_file: Path) -> float | None:
    """The ``--time-budget`` a search ran under (its results folder's ``space.yaml``)."""
    if not space_file.is_file():
        return None
    import yaml

    time_s = (yaml.safe_load(space_file.read_text()).get("budget") or {}).get("time_s")
    return float(time_s) if time_s is not None else None


def _pick_vs_best(data: dict) -> dict:
    """``benchmarks/pick_vs_best.py``'s runs: each side's median rate and J/sample."""
    def med(side: str, key: str) -> float | None:
        xs = [r[key] for r in data["runs"] if r["side"] == side and r.get(key) is not None]
        return statistics.median(xs) if xs else None

    return {"date": data["date"][:10], "landscape": data["landscape"], "rounds": max(r["round"] for r in data["runs"]),
            "runs": len(data["runs"]), "pick_over_best": data.get("pick_over_best"),
            "best": {k: v for k, v in data["configs"]["best"].items() if k in SHOWN}, "landscape_best_figures": data["landscape_best_figures"],
            **{f"{side}_{k}": med(side, k) for side in ("pick", "best")
               for k in ("samples_per_sec", "joules_per_sample", "gpu_power_w", "peak_device_memory_mb")}}


def _pairs(folder: Path) -> dict:
    """The input pipeline's and the hot path's pairs on the GPU (``gpu_check.sh pairs``): the
    augment pair's JSON, and the hot-path pairs' lines of a log where the run was cut before
    its JSON (the script writes it at its end)."""
    out: dict = {}
    aug = folder / "augment_pairs_gpu.json"
    if aug.is_file():
        d = json.loads(aug.read_text())
        out["augment"] = {"date": d["date"][:10], "rounds": d["rounds"], "workload": d["workload"], "args": d["args"],
                          "config": d["config"], "pair": d["pair"],
                          "host": statistics.median(x["samples_per_sec"] for x in d["uncached"]),
                          "device": statistics.median(x["samples_per_sec"] for x in d["cached"]),
                          "device_over_host": d["cached_over_uncached"], "interval_90": d["interval_90"],
                          "data_wait_host": statistics.median(x["data_wait_fraction"] for x in d["uncached"]),
                          "data_wait_device": statistics.median(x["data_wait_fraction"] for x in d["cached"])}
    hot = folder / "hotpath_pairs_gpu.json"
    log = folder / "hotpath_pairs_gpu.log"
    if hot.is_file():
        out["hotpath"] = {"complete": True, **json.loads(hot.read_text())}
    elif log.is_file():
        rows: dict = {}
        for mode, side, rate in re.findall(r"^compile (\S+) (defects|fixed): ([\d.]+)$", log.read_text(), re.M):
            rows.setdefault(mode, {})[side] = float(rate)
        out["hotpath"] = {"complete": False, "log": f"benchmarks/out/gpu/{log.name}", "rounds": 1, "rows": rows}
    return out


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "out" / "gpu"
    device, truth = _truth(folder)
    doctor = (folder / "doctor.log").read_text() if (folder / "doctor.log").is_file() else ""
    # keyed as the truth rows' models are, so the page can set a pick beside them
    searches = {m: r for s, m in (("gpt2", "gpt2_124m"), ("resnet50", "resnet50")) if (r := _search(folder, s))}
    dates = sorted({r["date"][:10] for r in truth})
    data = {"date": dates[-1] if dates else None, "hardware": {"gpu": device.get("gpu"), **device},
            "command": "bash benchmarks/gpu_check.sh setup tests truth search; python benchmarks/gpu_collect.py",
            "doctor": [line.strip() for line in doctor.splitlines() if line.strip()],
            "tests": _tests(folder), "truth": truth, "searches": searches, "pairs": _pairs(folder)}
    out = HERE / "out" / "gpu.json"
    out.write_text(json.dumps(data, indent=2, default=str))
    print(f"wrote {out}")
    for ab in sorted(folder.glob("knob_ab_*_gpu.json")):  # knob_ab's own JSON, a section of its own on the page
        (HERE / "out" / ab.name).write_bytes(ab.read_bytes())
        print(f"wrote {HERE / 'out' / ab.name}")


if __name__ == "__main__":
    main()
