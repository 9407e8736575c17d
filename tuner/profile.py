"""``tuner profile``: a config's steps under torch.profiler, a Chrome trace and a summary.

The config is first measured the usual way (no profiler), so the throughput
printed is an honest one; then a few more steps run under the profiler for the
trace and the breakdown. The profiler's overhead is in no throughput figure.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tuner.trial import TrialRequest

import torch

DATA_LABEL = "tuner::data_wait"
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
            "cudaEventSynchronize")
COPY_OPS = ("aten::copy_", "aten::to", "aten::_to_copy", "Memcpy HtoD", "Memcpy DtoH", "cudaMemcpyAsync")


class _LabelledLoader:
    """Wraps a DataLoader so each batch fetch shows in the trace as ``tuner::data_wait``."""

    def __init__(self, loader: Any):
        self.loader = loader

    def __iter__(self) -> Any:
        it = iter(self.loader)

        class _It:
            def __iter__(self) -> Any:
                return self

            def __next__(self) -> Any:
                with torch.profiler.record_function(DATA_LABEL):
                    return next(it)

        return _It()


class Infeasible(Exception):
    """The profiled config cannot run (its reason is the message)."""


def profile_config(request: TrialRequest, out_dir: Path, steps: int = 6, hot_path: bool = True) -> dict:
    """Measure (unprofiled), then profile ``steps`` optimizer steps; write the trace and
    summary; ``hot_path``: then run the hot-path check (``tuner.hotpath``) on the config."""
    from torch.profiler import ProfilerActivity, profile

    from tuner.loop import Trainer, synchronize
    from tuner.measure import measure
    from tuner.settings import MeasureSettings, RunPlan
    from tuner.trial import resolve_config, workload_facts

    config, notes, workload, device = resolve_config(request)
    trainer = Trainer(workload, config, device, baseline=request.baseline, seed=request.seed)
    metrics = measure(trainer, MeasureSettings(**request.measure), RunPlan(**request.run))
    if not metrics.get("loss_finite", True):
        raise Infeasible(metrics.get("reason") or "non-finite loss")
    trainer.loader = _LabelledLoader(trainer.loader)
    trainer.start()  # a new epoch over the labelled loader
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / "trace.json"
    synchronize(device)
    t0 = time.perf_counter()
    with profile(activities=activities, record_shapes=False) as prof:
        for _ in range(steps):
            trainer.step()
        synchronize(device)
    profiled_s = time.perf_counter() - t0
    prof.export_chrome_trace(str(trace))
    summary = summarize_profile(prof, device)
    summary.update({
        "trace": str(trace),
        "profiled_steps": steps,
        "profiled_wall_s": profiled_s,
        # from the unprofiled measurement: the profiler's overhead is in no throughput figure
        "samples_per_sec": metrics.get("samples_per_sec"),
        "data_wait_fraction_unprofiled": metrics.get("data_wait_fraction"),
        "num_workers": config["num_workers"],
        # a record as a trial's: the diagnosis below reads the config and the workload's facts
        "measurement": {**{k: v for k, v in metrics.items() if k != "samples_per_sec_windows"},
                        "config": config, **workload_facts(workload, trainer)},
        "config": config, "notes": notes,
    })
    if hot_path:
        from tuner.hotpath import UserCode, check

        # after the measurement and the trace: the check's instrumentation is in neither
        summary["hot_path"] = check(trainer, UserCode.of_workload(request.workload, request.base_dir))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def summarize_profile(prof: Any, device: torch.device) -> dict:
    """Top operators by self time; time in data loading, host-device copies, synchronizations."""
    events = prof.key_averages()
    use_cuda = device.type == "cuda"

    def self_us(e: Any) -> float:
        if use_cuda:
            return float(getattr(e, "self_device_time_total", 0.0) or 0.0) + float(e.self_cpu_time_total)
        return float(e.self_cpu_time_total)

    total_cpu = sum(float(e.self_cpu_time_total) for e in events) or 1.0
    ops = [e for e in events if not e.key.startswith(("tuner::", "ProfilerStep", "Optimizer."))]
    top = sorted(ops, key=self_us, reverse=True)[:15]
    data = sum(float(e.cpu_time_total) for e in events if e.key == DATA_LABEL)
    copies = sum(self_us(e) for e in events if e.key in COPY_OPS)
    syncs = [e for e in events if e.key in SYNC_OPS]
    return {
        "top_ops": [{"name": e.key, "self_ms": self_us(e) / 1e3, "calls": e.count} for e in top],
        "data_loading_ms": data / 1e3,
        "data_loading_share": data / total_cpu if total_cpu else None,
        "copies_ms": copies / 1e3,
        "syncs": {e.key: e.count for e in syncs},
        "total_self_cpu_ms": total_cpu / 1e3,
    }


def print_profile(summary: dict, out: Any) -> None:
    print(f"trace: {summary['trace']}  (open in chrome://tracing or https://ui.perfetto.dev)", file=out)
    sps = summary.get("samples_per_sec")
    if sps is not None:
        print(f"throughput (measured without the profiler): {sps:,.1f} samples/s", file=out)
    in_workers = summary.get("num_workers", 0) > 0
    where = (f" (in the main process only: the {summary['num_workers']} DataLoader worker(s) load in "
             f"processes the trace does not see)" if in_workers else "")
    print(f"profiled {summary['profiled_steps']} steps: data loading {summary['data_loading_ms']:.1f} ms "
          f"({(summary['data_loading_share'] or 0):.0%} of CPU self time{where}), host-device copies "
          f"{summary['copies_ms']:.1f} ms, syncs {summary['syncs'] or 'none'}", file=out)
    measured = summary.get("measurement")
    if measured and measured.get("loss_finite"):
        from tuner.diagnose import diagnose
        from tuner.tables import print_diagnosis

        # the same verdict as `bench`, from the unprofiled measurement (the time blocked on
        # the DataLoader sees the workers' work, which the trace does not)
        print_diagnosis("bottleneck (unprofiled measurement)", diagnose(measured), out)
    print(f"{'operator':<40} {'self ms':>9} {'calls':>6}", file=out)
    for op in summary["top_ops"]:
        print(f"{op['name'][:40]:<40} {op['self_ms']:>9.2f} {op['calls']:>6}", file=out)
    from tuner.tables import hot_path_lines

    for line in hot_path_lines(summary.get("hot_path")):
        print(line, file=out)
