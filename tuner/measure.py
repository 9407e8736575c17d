"""Honest measurement of one Trainer: warm-up, timed windows, per-epoch and one-time
costs apart, peak memory (device and host process tree), NVML sampling.

Method (see DESIGN.md, "Measuring honestly"):

- warm-up steps first (worker start, compile, autotune), each timed;
- then timed windows of whole optimizer steps, synchronized at window edges only;
  the window clock stops while a new epoch starts, and those epoch starts are
  measured apart;
- the steady rate is the median window; while the windows disagree so much that
  the median's standard error exceeds ``target_error``, more windows are
  measured (up to ``max_windows``);
- ``samples_per_sec`` is the sustained rate of real training: the steady step
  rate with the per-epoch cost spread over an epoch of the planned size.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

from tuner.loop import Trainer, synchronize

perf_counter = time.perf_counter


@dataclass
class MeasureSettings:
    """How a config is measured (the ``measure:`` section of space.yaml)."""

    warmup_steps: int = 3
    """Optimizer steps before timing (compile and worker start happen here)."""
    window_s: float = 1.0
    """Target seconds per timed window; the window's step count is derived from warm-up."""
    min_windows: int = 5
    max_windows: int = 12
    target_error: float = 0.01
    """Add windows (up to max_windows) while the median's relative standard error,
    estimated robustly from the windows' median absolute deviation, exceeds this."""
    epoch_steps: int | None = None
    """Optimizer steps per measured epoch; None: short enough to cross 2+ epoch boundaries."""
    max_timed_s: float = 60.0
    """Stop adding windows once this much time was timed."""


@dataclass
class RunPlan:
    """The training run a projection is made for (the ``run:`` section)."""

    epochs: int = 1
    epoch_size: int | None = None
    """Samples per epoch; None: the dataset's length."""


# ---- peak memory ---------------------------------------------------------------------


def tree_memory_bytes(pid: int) -> int:
    """Proportional set size (PSS) of a process and all its descendants.

    PSS splits shared pages between the processes that map them, so forked
    DataLoader workers are not counted once per copy of the parent's pages.
    Falls back to RSS where PSS cannot be read.
    """
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            info = p.memory_full_info()
            total += getattr(info, "pss", 0) or info.rss
        except psutil.Error:
            continue
    return total


class HostMemorySampler:
    """Samples the PSS of a process tree in a background thread; keeps the peak.

    Reading PSS makes the kernel walk each process's page tables: every 50 ms that
    cost ~12% of a core for a torch process (measured here), CPU taken from the trial
    it measures on a small machine. Every 250 ms costs a fifth of that; allocations
    held for less than that can be missed.
    """

    def __init__(self, pid: int | None = None, interval_s: float = 0.25):
        self.pid = pid or os.getpid()
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="host-memory")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_memory_bytes(self.pid))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> HostMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_memory_bytes(self.pid))


class NvmlSampler:
    """GPU utilization, memory used, power and SM clock, sampled during timed windows.

    Without pynvml, a driver or a GPU, ``available`` is False and ``summary()`` says why.
    """

    def __init__(self, device: torch.device, interval_s: float = 0.1):
        self.samples: list[tuple[float, float, float, float]] = []
        self.reason: str | None = None
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._handle = None
        if device.type != "cuda":
            self.reason = "no CUDA device"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            # NVML numbers GPUs physically; map through CUDA_VISIBLE_DEVICES (Ray sets it).
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                ids = [v.strip() for v in visible.split(",") if v.strip()]
                if index < len(ids) and ids[index].isdigit():
                    index = int(ids[index])
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:  # no library, no driver: a handled case
            self.reason = f"NVML unavailable: {type(exc).__name__}: {exc}"

    @property
    def available(self) -> bool:
        return self._handle is not None

    def _run(self) -> None:
        n, h = self._nvml, self._handle
        while not self._stop.is_set():
            try:
                util = n.nvmlDeviceGetUtilizationRates(h).gpu
                mem = n.nvmlDeviceGetMemoryInfo(h).used / 2**20
                power = n.nvmlDeviceGetPowerUsage(h) / 1000.0
                clock = n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)
                self.samples.append((util, mem, power, clock))
            except Exception as exc:
                self.reason = f"NVML sampling failed: {exc}"
                return
            self._stop.wait(self.interval_s)

    def __enter__(self) -> NvmlSampler:
        if self.available:
            self._thread = threading.Thread(target=self._run, daemon=True, name="nvml")
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.available:
            self._stop.set()
            self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {"gpu_util_pct": None, "gpu_memory_used_mb": None, "gpu_power_w": None,
                    "gpu_sm_clock_mhz": None, "nvml_note": self.reason or "no samples"}
        util, mem, power, clock = zip(*self.samples, strict=True)
        return {"gpu_util_pct": statistics.mean(util), "gpu_memory_used_mb": max(mem),
                "gpu_power_w": statistics.mean(power), "gpu_sm_clock_mhz": statistics.median(clock),
                "nvml_note": None}


# ---- peak FLOP/s, for MFU --------------------------------------------------------------

# Dense peak TFLOP/s per GPU model (bf16/fp16 tensor cores; tf32; fp32 without tensor cores).
_GPU_PEAK_TFLOPS = {
    "H200": (989.0, 494.0, 67.0), "H100": (989.0, 494.0, 67.0), "A100": (312.0, 156.0, 19.5),
    "L40S": (362.0, 183.0, 91.6), "A10": (125.0, 62.5, 31.2), "L4": (121.0, 60.0, 30.3),
    "V100": (125.0, 15.7, 15.7), "T4": (65.0, 8.1, 8.1), "RTX 4090": (165.0, 82.6, 82.6),
}


def peak_flops(device: torch.device, precision: str, tf32: bool) -> float | None:
    """The device's dense peak FLOP/s for this precision, or None where unknown (CPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, tf, fp32) in _GPU_PEAK_TFLOPS.items():
        if key in name:
            tflops = half if precision in ("bf16", "fp16") else (tf if tf32 else fp32)
            return tflops * 1e12
    return None


# ---- the measurement ---------------------------------------------------------------------


def _spread(values: list[float]) -> float:
    """(max - min) / median: how much the windows disagree."""
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med > 0 else math.inf


def median_error(values: list[float]) -> float:
    """Relative standard error of the median, from the median absolute deviation
    (robust to the odd disturbed window that a shared machine produces)."""
    med = statistics.median(values)
    if med <= 0 or len(values) < 2:
        return math.inf
    mad = statistics.median(abs(v - med) for v in values)
    return 1.2533 * 1.4826 * mad / math.sqrt(len(values)) / med


def measure(trainer: Trainer, settings: MeasureSettings, plan: RunPlan, *,
            startup_s: float = 0.0, progress: Callable[[str], None] | None = None) -> dict:
    """Measure a built Trainer; returns the metrics as a plain dict.

    ``startup_s`` is the one-time cost already spent building the trainer.
    A non-finite loss stops the measurement early with ``loss_finite: False``.
    """
    say = progress or (lambda msg: None)
    device = trainer.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    # -- warm-up: worker start, compile, autotune. Each step timed (syncs are fine here).
    t0 = perf_counter()
    # The first epoch ends with the warm-up, so the timed phase starts on an epoch start.
    trainer.set_epoch_limit(settings.warmup_steps * trainer.samples_per_step)
    trainer.start()
    warm_steps: list[float] = []
    for i in range(settings.warmup_steps):
        say(f"warm-up step {i + 1}/{settings.warmup_steps}")
        s0 = perf_counter()
        trainer.step()
        synchronize(device)
        warm_steps.append(perf_counter() - s0)
    warmup_s = perf_counter() - t0
    if not trainer.loss_finite():
        return _nonfinite(trainer, warmup_s)

    # -- size the windows from the last warm-up steps, and shorten epochs so that
    #    the timed phase crosses epoch boundaries.
    est = min(warm_steps[-2:]) if len(warm_steps) >= 2 else warm_steps[-1]
    window_steps = max(1, math.ceil(settings.window_s / max(est, 1e-6)))
    epoch_steps = settings.epoch_steps or max(2, math.ceil(settings.min_windows * window_steps / 3))
    trainer.set_epoch_limit(epoch_steps * trainer.samples_per_step)

    rates: list[float] = []
    waits: list[float] = []
    timed_s = 0.0
    starts_before = len(trainer.epoch_start_s)
    nvml = NvmlSampler(device)
    with nvml:
        while True:
            synchronize(device)
            w0, dw0, e0 = perf_counter(), trainer.data_wait_s, len(trainer.epoch_start_s)
            for _ in range(window_steps):
                trainer.step()
            synchronize(device)
            paused = sum(trainer.epoch_start_s[e0:])  # epoch starts are measured apart
            elapsed = perf_counter() - w0 - paused
            timed_s += elapsed
            rates.append(window_steps * trainer.samples_per_step / elapsed)
            waits.append((trainer.data_wait_s - dw0 - paused) / elapsed)
            say(f"window {len(rates)}: {rates[-1]:.1f} samples/s")
            if not trainer.loss_finite():
                return _nonfinite(trainer, warmup_s)
            enough = len(rates) >= settings.min_windows
            if enough and (median_error(rates) <= settings.target_error or len(rates) >= settings.max_windows
                           or timed_s >= settings.max_timed_s):
                break

    steady = statistics.median(rates)
    step_s = trainer.samples_per_step / steady
    micro_fetch_s = statistics.median(waits) * step_s / trainer.accum
    starts = trainer.epoch_start_s[starts_before:]
    # What an epoch start costs beyond an ordinary batch fetch (workers respawned,
    # dataset reopened, the prefetch pipeline refilled).
    epoch_overhead_s = max(0.0, statistics.median(starts) - micro_fetch_s) if starts else None

    epoch_size = plan.epoch_size or _dataset_len(trainer) or trainer.workload.epoch_size
    if epoch_size is not None:
        steps_per_epoch = max(1, epoch_size // trainer.samples_per_step)
        epoch_s = steps_per_epoch * step_s + (epoch_overhead_s or 0.0)
        sustained = steps_per_epoch * trainer.samples_per_step / epoch_s
        scale = sustained / steady
    else:
        steps_per_epoch, epoch_s, scale = None, None, 1.0
    sustained_rates = [r * scale for r in rates]
    one_time_s = startup_s + max(0.0, warmup_s - settings.warmup_steps * step_s)
    compile_s = max(0.0, warmup_s - settings.warmup_steps * step_s) if trainer.config["compile"] != "off" else 0.0
    projected = plan.epochs * epoch_s + one_time_s if epoch_s is not None else None

    flops = trainer.workload.flops_per_sample
    peak = peak_flops(device, trainer.config["precision"], trainer.config["tf32"])
    result = {
        "samples_per_sec": statistics.median(sustained_rates),
        "samples_per_sec_spread": _spread(rates),
        "samples_per_sec_error": median_error(rates),
        "samples_per_sec_windows": sustained_rates,
        "steady_samples_per_sec": steady,
        "step_time_ms": step_s * 1e3,
        "data_wait_fraction": min(1.0, max(0.0, statistics.median(waits))),
        "windows": len(rates),
        "window_steps": window_steps,
        "timed_s": timed_s,
        "warmup_s": warmup_s,
        "startup_s": startup_s,
        "compile_s": compile_s,
        "one_time_s": one_time_s,
        "epoch_overhead_s": epoch_overhead_s,
        "epoch_starts_measured": len(starts),
        "epoch_size": epoch_size,
        "epoch_s": epoch_s,
        "projected_run_s": projected,
        "loss_finite": True,
        "mfu": flops * steady / peak if flops and peak else None,
        "achieved_tflops": flops * steady / 1e12 if flops else None,
        "peak_device_memory_mb": None,
        "peak_device_reserved_mb": None,
    }
    if device.type == "cuda":
        result["peak_device_memory_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        result["peak_device_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
    result.update(nvml.summary())
    return result


def _dataset_len(trainer: Trainer) -> int | None:
    try:
        return len(trainer.dataset)
    except TypeError:
        return None


def _nonfinite(trainer: Trainer, warmup_s: float) -> dict:
    return {"loss_finite": False, "samples_per_sec": None, "warmup_s": warmup_s,
            "reason": "non-finite loss (NaN or inf)"}

