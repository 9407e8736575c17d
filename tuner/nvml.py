"""GPU utilization, memory, power and clock from NVML, sampled during a trial's timed
windows; another process on the trial's GPU. Without pynvml, a driver or a GPU, a
handled case."""

from __future__ import annotations

import os
import statistics
import threading

import psutil
import torch


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

    def other_processes(self) -> int:
        """Compute processes on the trial's GPU that are not this process or its children
        (another job sharing the GPU). 0 where NVML cannot tell (no driver, a container
        that hides host pids: then every pid is foreign, which would flag every window,
        so a pid not visible here is not counted)."""
        if not self.available:
            return 0
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:
            return 0
        me = psutil.Process()
        ours = {me.pid} | {c.pid for c in me.children(recursive=True)}
        return sum(1 for p in procs if p.pid not in ours and psutil.pid_exists(p.pid))

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
