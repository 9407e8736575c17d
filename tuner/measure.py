"""Honest measurement of one Trainer: warm-up, timed windows, per-epoch and one-time
costs apart, peak memory (device and host process tree), NVML sampling.

Method (see DESIGN.md, "Measuring honestly"):

- warm-up steps first (worker start, compile, autotune), each timed;
- then timed windows of whole optimizer steps and whole rounds of the DataLoader's
  workers, synchronized at window edges only;
  the window clock stops while a new epoch starts, and those epoch starts are
  measured apart;
- the steady step time comes from windows that neither hold an epoch boundary, nor
  follow one, nor precede one; the cost of an epoch boundary is what the other windows
  took beyond that steady time, per boundary. (DataLoader workers restarted together
  deliver their first batches together, so the steps just after a boundary run fast;
  and the steps before it run on the batches the workers queued, with the workers
  idle: where they share the cores, those run fast too. A boundary's cost is its pause
  minus both, which the whole windows see.)
  While the windows disagree so much that the median's standard error exceeds
  ``target_error``, more windows are measured (up to ``max_windows``); windows
  disturbed by other load are redone (``Load``);
- ``samples_per_sec`` is the sustained rate of real training: the steady step
  time over an epoch of the planned size, plus one boundary's cost.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import psutil
import torch

from tuner.loop import Trainer, synchronize
from tuner.settings import HUSH_ENV, MeasureSettings, RunPlan

perf_counter = time.perf_counter
# Windows per measured epoch: one holds the boundary, the next may hold its catch-up, two
# are steady, and the last runs on the batches the workers queued (see _steady).
EPOCH_WINDOWS = 5


# ---- the trial's own process tree: CPU time and memory, read at window edges ----------


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_cpu() -> tuple[float, float, float] | None:
    """(busy, idle, stolen) CPU-seconds of the whole machine since boot, from /proc/stat.

    Stolen: time a hypervisor gave to other VMs. It is recorded apart and does not make
    a window disturbed: on a loaded VM it grows with the trial's own load, and measuring
    again cannot escape it. None where /proc/stat does not exist.
    """
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / _CLK_TCK, (idle + iowait) / _CLK_TCK, steal / _CLK_TCK


def _cpu_s(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def _private_bytes(p: psutil.Process) -> int:
    """Pages only this process holds (USS): what a forked worker adds to its parent."""
    try:
        return p.memory_full_info().uss
    except psutil.Error:
        return 0
    except AttributeError:  # no USS on this platform
        try:
            return p.memory_info().rss
        except psutil.Error:
            return 0


def _status_kb(pid: int | str, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def own_peak_rss_bytes() -> int:
    """This process's peak resident set (the kernel's high-water mark, VmHWM): every
    page it held, as the user's own process would hold them (the trial's process is a
    fresh one, torch imported by itself). Exact, and free to read (no sampling)."""
    kb = _status_kb("self", "VmHWM")
    if kb is not None:
        return kb * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


@contextlib.contextmanager
def hushed() -> Iterator[bool]:
    """While the timed windows run: a file named for this process in ``$TUNER_HUSH_DIR``
    (a folder of the search's driver, where it runs on this machine), the sign for the
    driver to leave its loop asleep (``wait_while_timed``). No folder, no file: a trial
    on another node, a bench. Yields whether the mark was made."""
    folder = os.environ.get(HUSH_ENV)
    mark = os.path.join(folder, str(os.getpid())) if folder and os.path.isdir(folder) else None
    if mark:
        try:
            open(mark, "w").close()
        except OSError:
            mark = None
    try:
        yield mark is not None
    finally:
        if mark:
            with contextlib.suppress(OSError):
                os.unlink(mark)


def wait_while_timed(folder: str | None, cap_s: float = 30.0, poll_s: float = 0.5) -> float:
    """Sleep while a trial on this machine is in its timed windows (``hushed``), at most
    ``cap_s``; returns the seconds slept. Ray Tune's driver loop wakes 10 times a second
    and used 0.006-0.013 cores beside every trial here, out of the trial's cores; asleep,
    it checks a folder twice a second. A mark whose process is gone is removed (a trial
    killed in its windows); a Ctrl-C (Tune's handler, which replaces itself on the first
    one) ends the sleep."""
    if not folder:
        return 0.0
    import signal

    t0 = time.monotonic()
    handler = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    while time.monotonic() - t0 < cap_s:
        timing = False
        with contextlib.suppress(OSError):
            for name in os.listdir(folder):
                if name.isdigit() and psutil.pid_exists(int(name)):
                    timing = True
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(folder, name))
        if not timing or (handler is not None and signal.getsignal(signal.SIGINT) is not handler):
            break
        time.sleep(poll_s)
    return time.monotonic() - t0


class TreeProbe:
    """CPU time and memory of this process and its children (DataLoader workers).

    Read at window edges only, outside the timed windows, so that it takes no CPU
    from a window it measures. Peak host memory = this process's peak RSS + the
    largest sum of its workers' private pages seen at an edge.
    ``observers``: other processes whose CPU use is reported apart (the tuner's own:
    the launcher, the Tune driver, Ray's daemons).
    """

    def __init__(self, observers: list[int] | None = None):
        self.proc = psutil.Process()
        self.workers_peak = 0
        self.observers = [p for p in (_process(pid) for pid in observers or []) if p is not None]
        self.peers: list[psutil.Process] = []
        # looked for again before each window (``refresh_peers``): processes of the
        # trial that start while it runs
        self.find_peers: Callable[[], list[int]] | None = None

    def add_peers(self, pids: list[int]) -> None:
        """The other ranks of this trial on this node: their CPU (and their workers')
        is the trial's own, not load beside it."""
        known = {p.pid for p in self.peers}
        self.peers += [p for p in (_process(pid) for pid in pids if pid not in known) if p is not None]

    def refresh_peers(self) -> None:
        if self.find_peers is not None:
            self.add_peers(self.find_peers())

    def children(self) -> list[psutil.Process]:
        try:
            return self.proc.children(recursive=True)
        except psutil.Error:
            return []

    def tree_cpu_s(self) -> float:
        t = os.times()  # reaped children (workers of past epochs) included
        peers = 0.0
        for p in self.peers:
            try:  # a peer's reaped children (its workers of past epochs) too
                c = p.cpu_times()
                peers += c.user + c.system + c.children_user + c.children_system + sum(
                    _cpu_s(q) for q in p.children(recursive=True))
            except psutil.Error:
                pass
        return t.user + t.system + t.children_user + t.children_system + peers + sum(
            _cpu_s(c) for c in self.children())

    def observers_cpu_s(self) -> float:
        return sum(_cpu_s(p) for p in self.observers)

    def sample_memory(self) -> None:
        self.workers_peak = max(self.workers_peak, sum(_private_bytes(c) for c in self.children()))

    def peak_host_bytes(self) -> int:
        return own_peak_rss_bytes() + self.workers_peak


def ray_workers_beside(probe: TreeProbe) -> list[int]:
    """Ray's worker processes on this node (process title ``ray::...``) other than this
    process, its peers and its own children; Ray's per-node agents are daemons, not
    workers, and stay outside."""
    known = {probe.proc.pid, *(p.pid for p in probe.peers), *(c.pid for c in probe.children())}
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        name = p.info.get("name") or ""
        # a worker Ray is starting has not yet taken its "ray::" title
        starting = any(a.endswith("default_worker.py") for a in (p.info.get("cmdline") or [])[:2])
        if p.pid not in known and (name.startswith("ray::") or starting) and not name.startswith(
                ("ray::Dashboard", "ray::RuntimeEnv")):
            out.append(p.pid)
    return out


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


@dataclass
class Load:
    """What ran beside a window: CPU used by processes outside the trial's tree, in cores
    (``other_cores``), the part of it that was the tuner's own (``tuner_cores``), the
    cores left idle, and other processes on the trial's GPU."""

    other_cores: float
    tuner_cores: float
    idle_cores: float
    gpu_others: int = 0
    steal_cores: float = 0.0

    def disturbed(self, max_interference: float, cpus: int, max_steal: float = 1.0) -> bool:
        cpu = self.other_cores > max_interference * cpus and self.idle_cores < 0.5
        return cpu or self.steal_cores > max_steal * cpus or self.gpu_others > 0


class LoadMeter:
    """Brackets one window: ``start()`` before, ``stop(wall_s)`` after, both untimed."""

    def __init__(self, probe: TreeProbe, nvml: NvmlSampler | None = None):
        self.probe, self.nvml = probe, nvml
        self.cpus = os.cpu_count() or 1
        self._start: tuple | None = None

    def start(self) -> None:
        self.probe.refresh_peers()
        self._start = (machine_cpu(), self.probe.tree_cpu_s(), self.probe.observers_cpu_s())

    def stop(self, wall_s: float) -> Load | None:
        if self._start is None or self._start[0] is None or wall_s <= 0:
            return None
        (busy0, idle0, steal0), tree0, obs0 = self._start
        now = machine_cpu()
        if now is None:
            return None
        busy1, idle1, steal1 = now
        tree = self.probe.tree_cpu_s() - tree0
        gpu_others = self.nvml.other_processes() if self.nvml is not None else 0
        return Load(other_cores=max(0.0, (busy1 - busy0 - tree) / wall_s),
                    tuner_cores=max(0.0, (self.probe.observers_cpu_s() - obs0) / wall_s),
                    idle_cores=max(0.0, (idle1 - idle0) / wall_s), gpu_others=gpu_others,
                    steal_cores=max(0.0, (steal1 - steal0) / wall_s))


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
    key = gpu_model_key(torch.cuda.get_device_name(device))
    if key is None:
        return None
    half, tf, fp32 = _GPU_PEAK_TFLOPS[key]
    return (half if precision in ("bf16", "fp16") else (tf if tf32 else fp32)) * 1e12


def gpu_model_key(name: str) -> str | None:
    """The peak table's entry for a CUDA device name, matching whole model names
    ("NVIDIA L40" is not an "L4"; "NVIDIA A100-SXM4-80GB" is an "A100"), or None."""
    import re

    tokens = [t for t in re.split(r"[\s\-_/]+", name.upper()) if t]
    for key in sorted(_GPU_PEAK_TFLOPS, key=len, reverse=True):
        k = key.upper().split()
        if any(tokens[i:i + len(k)] == k for i in range(len(tokens) - len(k) + 1)):
            return key
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


# Windows a screening decision never reads: the first one after the warm-up is often
# still start-up (workers filling their queues, the allocator growing, the first epoch):
# a config screened on it was one a stock search picked at 1.9x its screening figure.
SCREEN_SKIP = 1


def screen_stop(rates: list[float], screen: dict | None, screen_windows: int) -> bool:
    """Whether a config is out of the running after the windows ``rates`` so far: once
    ``screen_windows`` windows past the start-up one are in, the best of them, raised by
    the noise allowance ``screen["margin"]``, stays below ``screen["below"]``."""
    if not screen or screen_windows <= 0 or len(rates) != SCREEN_SKIP + screen_windows:
        return False
    return max(rates[SCREEN_SKIP:]) * (1 + screen["margin"]) < screen["below"]


def windows_verdict(rates: list[float], screen: dict | None, *, min_windows: int, target_error: float,
                    screen_windows: int, capped: bool = False, steady: bool = True) -> str | None:
    """Whether the windows ``rates`` so far end the measurement, and why: ``screened``
    (out of the running, ``screen_stop``), ``enough`` (``min_windows`` in, and capped or
    precise to ``target_error`` with steady windows among them), ``below_incumbent``
    (precision only matters near the top: a config clearly below the incumbent, by twice
    its own error, is no contender, and more windows would not make it one), or None:
    measure another window. (The search replay draws its windows under the same rules.)"""
    if screen_stop(rates, screen, screen_windows):
        return "screened"
    if len(rates) < min_windows:
        return None
    if capped or (median_error(rates) <= target_error and steady):
        return "enough"
    if screen and statistics.median(rates) * (1 + 2 * median_error(rates)) < screen["below"]:
        return "below_incumbent"
    return None


def measure(trainer: Trainer, settings: MeasureSettings, plan: RunPlan, *,
            startup_s: float = 0.0, progress: Callable[[str], None] | None = None,
            probe: TreeProbe | None = None, screen: dict | None = None,
            rank_info: dict | None = None) -> dict:
    """Measure a built Trainer; returns the metrics as a plain dict.

    ``startup_s`` is the one-time cost already spent building the trainer.
    A non-finite loss stops the measurement early with ``loss_finite: False``.
    ``screen``: ``{"below": samples/sec, "margin": fraction}`` from the search: after
    ``settings.screen_windows`` windows past the first, a config that cannot reach
    ``below`` even with ``margin`` of noise in its favour stops (``screened: True``,
    ``screen_stop``).
    With several data-parallel ranks (``trainer.world``), every rank calls this; the
    figures are global (all ranks' samples over the slowest rank's time) and each
    rank's own are under ``ranks`` (``rank_info`` is added to this rank's entry).

    The phases: the warm-up (``_warm_up``), the windows' size (``WindowPlan``), the timed
    windows (``_timed_windows``), the disturbed ones left out (``_leave_out_disturbed``),
    the figures with epoch boundaries (``_figures``) and the record (``_record``).
    """
    say = progress or (lambda msg: None)
    probe = probe or TreeProbe()
    agree = Agree(trainer)
    if agree.world > 1:
        here = (rank_info or {}).get("node") or os.uname().nodename
        probe.add_peers([r["pid"] for r in agree.gather({"pid": os.getpid(), "node": here})
                         if r["node"] == here and r["pid"] != os.getpid()])
        # Ray Train's controller, the trial's driver and its result box run beside the
        # ranks as Ray workers: they are how a multi-rank trial runs, not load beside it
        # (counted as outside load, a quiet 2-rank search here marked 2 of 4 disturbed).
        # Ray Train starts more of them once the ranks run (its dataset manager,
        # preemption watcher, and the workers Ray starts to host them), so they are
        # looked for again before every window.
        probe.find_peers = lambda: ray_workers_beside(probe)
        probe.refresh_peers()
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(trainer.device)
    warm = _warm_up(trainer, settings, say)
    if agree.any(not trainer.loss_finite()):
        return _nonfinite(trainer, warm.seconds)
    windows = WindowPlan.size(trainer, settings, agree, warm)
    nvml = NvmlSampler(trainer.device)
    with nvml, hushed() as driver_asleep:
        timed = _timed_windows(trainer, settings, windows, agree, LoadMeter(probe, nvml), probe, screen, say)
    if timed.nonfinite:
        return _nonfinite(trainer, warm.seconds)
    probe.sample_memory()
    left_out = _leave_out_disturbed(timed, settings)
    figures = _figures(trainer, plan, timed, warm, startup_s, settings)
    result = _record(trainer, timed, figures, probe, windows, warm, startup_s, screen, left_out)
    result["driver_asleep"] = driver_asleep  # the search's driver slept through the windows (hushed)
    result.update(nvml.summary())
    result["world_size"] = agree.world
    result["samples_per_sec_per_rank"] = result["samples_per_sec"] / agree.world
    if agree.world > 1:
        own = {"rank": trainer.rank, **(rank_info or {}),
               "step_time_ms": timed.own_s / max(1, timed.own_steps) * 1e3,
               "data_wait_fraction": min(1.0, timed.own_wait_s / timed.own_s) if timed.own_s > 0 else None,
               "peak_host_memory_mb": result["peak_host_memory_mb"],
               "peak_device_memory_mb": result["peak_device_memory_mb"]}
        result.update(across_ranks(agree.gather(own)))
    return result


@dataclass
class WarmUp:
    steps: list[float]  # each warm-up step's seconds
    seconds: float  # the whole warm-up
    start_s: float  # DataLoader workers spawned
    first_wait: float  # the first batch's wait: workers started, dataset opened


def _warm_up(trainer: Trainer, settings: MeasureSettings, say: Callable[[str], None]) -> WarmUp:
    """Worker start, compile, autotune; each step timed (syncs are fine here). The first
    epoch ends with the warm-up, so the timed phase starts on an epoch start."""
    t0 = perf_counter()
    trainer.set_epoch_limit(settings.warmup_steps * trainer.samples_per_step)
    s0 = perf_counter()
    trainer.start()
    start_s = perf_counter() - s0
    steps: list[float] = []
    first_wait = 0.0
    for i in range(settings.warmup_steps):
        say(f"warm-up step {i + 1}/{settings.warmup_steps}")
        s0 = perf_counter()
        trainer.step()
        synchronize(trainer.device)
        steps.append(perf_counter() - s0)
        if i == 0:
            first_wait = trainer.data_wait_s
    return WarmUp(steps, perf_counter() - t0, start_s, first_wait)


@dataclass
class WindowPlan:
    """How long a timed window is (in steps) and how long an epoch.

    DataLoader workers take batches in turn and deliver them in order, and after an
    epoch starts they run in step: the waits repeat every round of num_workers
    micro-batches, counted from the epoch start. Windows and epochs are whole rounds
    (whole steps too: a cycle is the least multiple of both), so every window starts
    and ends at the same point of a round. A window of, say, 3.25 rounds that ends
    just after a round arrived reads up to a round fast, and the last window of an
    epoch always does: +8% with 8 workers, before windows were whole rounds.
    """

    trainer: Trainer
    settings: MeasureSettings
    est: float  # seconds per step, from the warm-up
    cycle: int
    min_steps: int
    room: int  # steps a window may have for five to fit in an epoch (0: no limit)
    dataset_steps: int
    steps: int = 0  # per window
    cap_s: float = math.inf  # the first window is also capped in time
    sized: bool = False  # sized by the first undisturbed window

    @classmethod
    def size(cls, trainer: Trainer, settings: MeasureSettings, agree: Agree, warm: WarmUp) -> WindowPlan:
        # The warm-up can read fast: DataLoader workers fill their prefetch queues while
        # the first steps compile, and the last warm-up steps only drain them. So the first
        # window is also capped in time, and sizes the windows after it.
        est = agree.max(min(warm.steps[-2:]) if len(warm.steps) >= 2 else warm.steps[-1])[0]
        workers = getattr(trainer.loader, "num_workers", 0)
        cycle = math.lcm(workers, trainer.accum) // trainer.accum if workers else 1
        min_steps = cycle * max(1, math.ceil(2 * workers / (cycle * trainer.accum)))  # two rounds
        # Five windows must fit in an epoch (see size_epochs): where the dataset is shorter
        # than five windows of the asked length but holds five of two rounds each, the
        # windows are shortened to a fifth of it (the 8-worker test's dataset of 128 steps
        # had no two steady windows, and its figure fell back to the pauses).
        dataset_steps = (_dataset_len(trainer) or 0) // (trainer.samples_per_step * trainer.world)
        room = (dataset_steps // EPOCH_WINDOWS) // cycle * cycle if settings.epoch_steps is None else 0
        plan = cls(trainer, settings, est, cycle, min_steps, room, dataset_steps)
        plan.steps = plan.whole_cycles(settings.window_s / max(est, 1e-6))
        plan.size_epochs()
        # (With several ranks the cap is off: a break on a rank's own clock could end the
        # window at different steps on different ranks.)
        plan.cap_s = 3 * settings.window_s if agree.world == 1 else math.inf
        return plan

    def whole_cycles(self, steps: float) -> int:
        n = max(self.min_steps, self.cycle * math.ceil(steps / self.cycle))
        return min(n, self.room) if self.room >= self.min_steps else n

    def size_epochs(self, now: bool = False) -> None:
        # five windows per epoch: one holds the boundary, the next may hold its
        # catch-up, two are steady, and the last runs on the batches the workers queued
        epoch_steps = self.settings.epoch_steps or EPOCH_WINDOWS * self.steps
        self.trainer.set_epoch_limit(epoch_steps * self.trainer.samples_per_step, now=now,
                                     align=self.cycle * self.trainer.samples_per_step)

    def resize(self, steps: int, wall: float, say: Callable[[str], None]) -> None:
        """Once: the first undisturbed window sizes the windows (a disturbed one would
        size them to the disturbance)."""
        self.sized = True
        fit = self.whole_cycles(self.settings.window_s * steps / max(wall, 1e-6))
        if not self.steps / 1.5 <= fit <= self.steps * 1.5:
            say(f"warm-up read {self.est * 1e3:.1f} ms per step, the first window "
                f"{wall / steps * 1e3:.1f} ms: {fit} steps per window")
            self.steps = fit
            self.size_epochs(now=True)


@dataclass
class Timed:
    """The timed phase so far: the windows kept and what ran beside them."""

    kept: list[Window] = field(default_factory=list)
    busy: list[bool] = field(default_factory=list)  # disturbed, but kept: the redos had run out
    loads: list[Load | None] = field(default_factory=list)
    faults: list[int] = field(default_factory=list)  # minor page faults of this process, per window
    rates: list[float] = field(default_factory=list)
    disturbed: list[float] = field(default_factory=list)  # rates of windows dropped as disturbed
    screened: bool = False
    below_incumbent: bool = False  # measured to min_windows only: clearly below the incumbent
    nonfinite: bool = False
    timed_s: float = 0.0
    gap_s: float = 0.0  # untimed, between windows
    clock: list[float] = field(default_factory=list)  # the first window's start, the last one's end
    starts_before: int = 0  # epoch starts before the timed phase
    own_s: float = 0.0  # this rank's own clock
    own_wait_s: float = 0.0
    own_steps: int = 0

    def fetch_s(self) -> float:
        """An ordinary micro-batch fetch: data wait outside epoch boundaries, per micro-batch."""
        n = sum(w.micro_batches - w.boundaries for w in self.kept)
        return sum(w.wait for w in self.kept) / n if n > 0 else 0.0


def _rate(w: Window, fetch: float) -> float:
    # The clock stops for each epoch boundary (measured apart, as epoch_overhead_s,
    # beyond an ordinary fetch); the ordinary fetch of the boundary's first batch
    # belongs to the steady step and is put back.
    return w.samples / max(1e-9, w.wall - w.paused + w.boundaries * fetch)


def _timed_windows(trainer: Trainer, settings: MeasureSettings, plan: WindowPlan, agree: Agree, meter: LoadMeter,
                   probe: TreeProbe, screen: dict | None, say: Callable[[str], None]) -> Timed:
    """Windows until the figure is precise enough, capped, screened out, or clearly below
    the incumbent; a window disturbed by other load is measured again (up to
    ``max_windows`` redos)."""
    device = trainer.device
    step_samples = trainer.samples_per_step * trainer.world  # all ranks' samples per step
    t = Timed(starts_before=len(trainer.epoch_start_s))
    before = 1  # the warm-up ended on an epoch boundary

    def steady_enough() -> bool:
        """Two windows clear of epoch boundaries, where the epochs leave room for them:
        five windows (a shorter dataset's epochs are measured whole, boundaries and all,
        and its windows' average is already the sustained rate)."""
        if settings.epoch_steps is not None or plan.dataset_steps < EPOCH_WINDOWS * plan.steps:
            return True
        return len(_steady(t.kept)) >= 2

    agree.max(0.0)  # a barrier: the ranks start the first window together
    while True:
        synchronize(device)
        g0 = perf_counter()
        if not t.kept and not t.disturbed:
            # Workers' private pages, before the first window and after the last only:
            # reading them takes milliseconds per worker, during which the workers
            # run on and fill their queues, so the window after such a pause would
            # read fast.
            probe.sample_memory()
        meter.start()
        faults0 = _minor_faults()
        w0, dw0, e0 = perf_counter(), trainer.data_wait_s, len(trainer.epoch_start_s)
        t.clock = t.clock or [w0]
        t.gap_s += w0 - g0
        steps = 0
        while steps < plan.steps:
            trainer.step()
            steps += 1
            if not plan.sized and steps % plan.cycle == 0 and perf_counter() - w0 > plan.cap_s:
                break
        synchronize(device)
        wall = perf_counter() - w0
        paused = sum(trainer.epoch_start_s[e0:])
        wait = trainer.data_wait_s - dw0 - paused
        faults = _minor_faults() - faults0
        load = meter.stop(wall)
        busy = load is not None and load.disturbed(settings.max_interference, meter.cpus, settings.max_steal)
        t.own_s, t.own_wait_s, t.own_steps = t.own_s + wall - paused, t.own_wait_s + wait, t.own_steps + steps
        # One all-reduce per window edge: the slowest rank's figures, on every rank.
        wall, paused, wait, busy, nonfinite = agree.max(wall, paused, wait, float(busy),
                                                        float(not trainer.loss_finite()))
        window = Window(steps * step_samples, wall, paused, len(trainer.epoch_start_s) - e0,
                        steps * trainer.accum, wait, before)
        before = window.boundaries
        redo = bool(busy) and len(t.disturbed) < settings.max_windows
        if not plan.sized and not redo:
            # Epochs shorter than a window put their boundaries in every window: then
            # window_s is the wall time, pauses included (sized on the steady time alone,
            # windows of 8-step epochs, a DataLoader worker started at each, ran 3-15x
            # window_s, and the trial as long). The first window holds one boundary
            # however long the epochs are: the timed phase starts on an epoch start.
            plan.resize(steps, wall if window.boundaries >= 2 else wall - paused, say)
        if redo:
            t.disturbed.append(_rate(window, t.fetch_s()))
            say(f"window disturbed ({load.other_cores:.2f} cores used outside the trial, "
                f"{load.steal_cores:.2f} stolen by the hypervisor): "
                f"measuring it again")
            continue
        t.kept.append(window)
        t.faults.append(faults)
        t.busy.append(bool(busy))
        t.loads.append(load)
        t.rates.append(_rate(window, t.fetch_s()))
        t.timed_s += wall - paused
        say(f"window {len(t.rates)}: {t.rates[-1]:.1f} samples/s")
        if nonfinite:
            t.nonfinite = True
            break
        capped = len(t.rates) >= settings.max_windows or t.timed_s >= settings.max_timed_s
        done = windows_verdict(t.rates, screen, min_windows=settings.min_windows, target_error=settings.target_error,
                               screen_windows=settings.screen_windows, capped=capped,
                               steady=steady_enough())
        if done == "screened":
            t.screened = True
            say(f"screened out: {max(t.rates[SCREEN_SKIP:]):.1f} samples/s cannot reach {screen['below']:.1f}")
        t.below_incumbent = done == "below_incumbent"
        if done:
            break
    t.clock.append(perf_counter())
    return t


def _leave_out_disturbed(t: Timed, settings: MeasureSettings) -> int:
    """A disturbance that outlasts the redos (capped) leaves disturbed windows among those
    kept (a CPU hog of 4 s read a figure 17% low that way). Where enough quiet windows
    remain, the figure comes from them alone (the number left out is returned);
    otherwise, with more than a third of its windows disturbed, the measurement is
    marked, and never picks a winner. (``busy`` is the flag the ranks agreed on, so
    every rank keeps the same windows.)"""
    quiet = [i for i, b in enumerate(t.busy) if not b]
    if len(quiet) == len(t.kept) or len(quiet) < max(2, settings.min_windows // 2 + 1):
        return 0
    left_out = len(t.kept) - len(quiet)
    t.kept = [t.kept[i] for i in quiet]
    t.busy = [False] * len(t.kept)
    t.loads = [t.loads[i] for i in quiet]
    t.faults = [t.faults[i] for i in quiet]
    return left_out


def _figures(trainer: Trainer, plan: RunPlan, t: Timed, warm: WarmUp, startup_s: float,
             settings: MeasureSettings) -> dict:
    """The rates of the windows kept, the steady rate, the cost of an epoch boundary, and
    what they add up to over the planned run."""
    step_samples = trainer.samples_per_step * trainer.world
    kept = t.kept
    micro_fetch_s = t.fetch_s()
    rates = [_rate(w, micro_fetch_s) for w in kept]
    elapsed = [w.samples / r for w, r in zip(kept, rates, strict=True)]
    wait_fraction = (sum(w.wait for w in kept) + micro_fetch_s * sum(w.boundaries for w in kept)) / sum(elapsed)
    starts = trainer.epoch_start_s[t.starts_before:]
    # Steady time per sample: all samples over all time (not a median of window rates:
    # a right-skewed step time would read fast) of the windows that neither hold an
    # epoch boundary, nor follow one, nor precede one. A boundary costs what all windows
    # took beyond that, per boundary: its pause (old workers shut down, new ones spawned,
    # the dataset reopened) less the catch-up of the batches the new workers then deliver
    # at once, and less the fast steps before it, on the batches the old workers queued.
    # That net can be below zero, and is kept so: clipped at zero, a noisy steady figure
    # (steps of unequal cost, as batches of one source each make them) counted only when
    # slow, and an epoch of the length measured read below the average of all its
    # windows (multisource by source: 0.88 of the user's loop beside it, every round).
    # Unclipped, an epoch as long as those measured reads exactly that average, and the
    # steady figure only weighs in the extrapolation to a longer one.
    steady_windows = _steady(kept)
    boundaries = sum(w.boundaries for w in kept)
    if boundaries and len(steady_windows) >= 2:
        per_sample = sum(w.wall for w in steady_windows) / sum(w.samples for w in steady_windows)
        samples = sum(w.samples for w in kept)
        extra = sum(w.wall for w in kept) - per_sample * samples
        # (no boundary makes an epoch twice as fast: a bound for a wild steady figure)
        epoch_overhead_s = max(extra / boundaries, -0.5 * per_sample * samples / boundaries)
        overhead_from = "windows"
    else:
        # Too few steady windows (epochs as long as the timed phase): each boundary's
        # pause beyond an ordinary batch fetch, and the rest of the time as steady.
        per_sample = sum(elapsed) / sum(w.samples for w in kept)
        epoch_overhead_s = max(0.0, statistics.median(starts) - micro_fetch_s) if starts else None
        overhead_from = "pauses"
    steady = 1 / per_sample
    step_s = step_samples / steady
    epoch_size = plan.epoch_size or _dataset_len(trainer) or trainer.workload.epoch_size
    if epoch_size is not None:
        steps_per_epoch = max(1, epoch_size // step_samples)
        epoch_s = steps_per_epoch * step_s + (epoch_overhead_s or 0.0)
        scale = steps_per_epoch * step_samples / epoch_s / steady
    else:
        epoch_s, scale = None, 1.0
    surplus = max(0.0, warm.seconds - settings.warmup_steps * step_s)  # warm-up beyond steady steps
    # The first batch's wait beyond an ordinary fetch is worker start-up, not compile.
    worker_start_s = min(surplus, warm.start_s + max(0.0, warm.first_wait - micro_fetch_s * trainer.accum))
    return {"rates": rates, "steady": steady, "scale": scale, "step_s": step_s, "wait_fraction": wait_fraction,
            "epoch_overhead_s": epoch_overhead_s, "overhead_from": overhead_from, "starts": len(starts),
            "epoch_size": epoch_size, "epoch_s": epoch_s, "one_time_s": startup_s + surplus,
            "worker_start_s": worker_start_s,
            "compile_s": max(0.0, surplus - worker_start_s) if trainer.config["compile"] != "off" else 0.0,
            "projected": plan.epochs * epoch_s + startup_s + surplus if epoch_s is not None else None}


def _record(trainer: Trainer, t: Timed, f: dict, probe: TreeProbe, windows: WindowPlan, warm: WarmUp,
            startup_s: float, screen: dict | None, left_out: int) -> dict:
    """The measurement's record (the fields ``bench --json`` and ``trials.jsonl`` carry)."""
    device = trainer.device
    rates, steady = f["rates"], f["steady"]
    flops = trainer.workload.flops_per_sample
    peak = peak_flops(device, trainer.config["precision"], trainer.config["tf32"])
    loads = [ld for ld in t.loads if ld is not None]  # the figure's windows, no others
    result = {
        "samples_per_sec": steady * f["scale"],
        "samples_per_sec_spread": _spread(rates),
        "samples_per_sec_error": median_error(rates),
        "samples_per_sec_windows": [r * f["scale"] for r in rates],
        "steady_samples_per_sec": steady,
        "step_time_ms": f["step_s"] * 1e3,
        "data_wait_fraction": min(1.0, max(0.0, f["wait_fraction"])),
        "windows": len(rates),
        "window_steps": windows.steps,
        "timed_s": t.timed_s,
        "warmup_s": warm.seconds,
        "startup_s": startup_s,
        "compile_s": f["compile_s"],
        "worker_start_s": f["worker_start_s"],
        "one_time_s": f["one_time_s"],
        "epoch_overhead_s": f["epoch_overhead_s"],
        "epoch_starts_measured": f["starts"],
        "epoch_overhead_from": f["overhead_from"],
        "between_windows_s": t.gap_s,
        # CLOCK_MONOTONIC (perf_counter on Linux), one clock for every process of the
        # machine: what ran beside the timed phase can be lined up with it
        "timed_clock_s": t.clock,
        "epoch_size": f["epoch_size"],
        "epoch_s": f["epoch_s"],
        "projected_run_s": f["projected"],
        "loss_finite": True,
        "mfu": flops * steady / peak if flops and peak else None,
        "achieved_tflops": flops * steady / 1e12 if flops else None,
        "peak_device_memory_mb": None,
        "peak_device_reserved_mb": None,
        "peak_host_memory_mb": probe.peak_host_bytes() / 2**20,
        # How the heap behaves: glibc's malloc trims and re-grows it, and each page it
        # takes back costs a fault (the same plain loop took 3,900 and 13,600 per step in
        # two fresh processes here). The trial's process only: workers not included.
        "page_faults_per_step": (sum(t.faults) * trainer.accum / sum(w.micro_batches for w in t.kept)
                                 if t.kept else None),
        "host_memory_measure": "peak RSS of the trial process + private pages of its DataLoader workers",
        # what ran beside the timed windows (medians over the windows kept)
        "interference_cores": statistics.median(ld.other_cores for ld in loads) if loads else None,
        "tuner_cpu_cores": statistics.median(ld.tuner_cores for ld in loads) if loads else None,
        "steal_cores": statistics.median(ld.steal_cores for ld in loads) if loads else None,
        # per window of the figure, in the order of samples_per_sec_windows
        "interference_cores_windows": [None if ld is None else ld.other_cores for ld in t.loads],
        "disturbed_windows_dropped": len(t.disturbed),
        "disturbed_windows_left_out": left_out,
        "disturbed": 3 * sum(t.busy) > len(t.kept),  # more than a third
        "screened": t.screened,
        "below_incumbent": t.below_incumbent,
        "screened_below": screen["below"] if t.screened and screen else None,
    }
    if device.type == "cuda":
        result["peak_device_memory_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        result["peak_device_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
    return result


def across_ranks(ranks: list[dict]) -> dict:
    """The record's figures over all ranks: each rank's own, the slowest named, device
    memory as the largest rank's, host memory per node (workers included) and the
    largest node's as the peak (what must fit on one machine)."""
    per_node: dict[str, float] = {}
    for r in ranks:
        node = str(r.get("node", "?"))
        per_node[node] = per_node.get(node, 0.0) + (r["peak_host_memory_mb"] or 0.0)
    device = [r["peak_device_memory_mb"] for r in ranks if r.get("peak_device_memory_mb") is not None]
    return {"ranks": sorted(ranks, key=lambda r: r["rank"]),
            "slowest_rank": max(ranks, key=lambda r: r["step_time_ms"])["rank"],
            "host_memory_per_node_mb": per_node,
            "peak_host_memory_mb": max(per_node.values()),
            "peak_device_memory_mb": max(device) if device else None}


class Agree:
    """Figures agreed across the data-parallel ranks of one trial.

    Every decision of the measurement (window length, redoing a disturbed window,
    stopping) is taken on figures reduced the same way on every rank, so that every
    rank runs the same number of steps (DDP would hang otherwise). The reduction is
    one all-reduce at a window edge, which is also the barrier that starts the ranks'
    next window together; never a per-step collective. With one rank, it is free.
    """

    def __init__(self, trainer: Trainer):
        self.world = trainer.world
        self.on = torch.device("cpu")
        if self.world > 1:
            import torch.distributed as dist

            if dist.get_backend() == "nccl":  # NCCL reduces device tensors only; gloo host ones
                self.on = trainer.device

    def max(self, *values: float) -> list[float]:
        if self.world == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.on)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        return bool(self.max(float(flag))[0])

    def gather(self, item: dict) -> list[dict]:
        if self.world == 1:
            return [item]
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, item)
        return out


class Window(NamedTuple):
    """One timed window, its figures agreed across ranks (``Agree``)."""

    samples: int  # all ranks'
    wall: float  # seconds, the slowest rank's
    paused: float  # seconds the clock stopped at epoch boundaries
    boundaries: int  # epoch boundaries inside the window
    micro_batches: int
    wait: float  # data wait outside the boundaries
    boundaries_before: int  # in the window before (its catch-up may spill into this one)


def _minor_faults() -> int:
    """Minor page faults of this process so far, every thread's (getrusage)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _steady(kept: list[Window]) -> list[Window]:
    """The kept windows clear of epoch boundaries: each neither holds one, nor follows
    one, nor precedes one. The window before a boundary runs fast: DataLoader workers
    stop at the epoch's last batch, and the training process runs on the batches they
    queued with every core to itself (conv, 2 workers on 2 cores: 402 samples/s against
    291 in the windows around it). Counted as steady, it read 1.05-1.20x the user's
    whole epochs. The last window's successor is not known yet: it is not counted. (A
    successor that follows a boundary held by a window dropped as disturbed marks this
    one too.)"""
    return [w for w, after in zip(kept, kept[1:], strict=False)
            if w.boundaries == 0 and w.boundaries_before == 0
            and after.boundaries == 0 and after.boundaries_before == 0]


def _dataset_len(trainer: Trainer) -> int | None:
    try:
        return len(trainer.dataset)
    except TypeError:
        return None


def _nonfinite(trainer: Trainer, warmup_s: float) -> dict:
    return {"loss_finite": False, "samples_per_sec": None, "warmup_s": warmup_s,
            "reason": "non-finite loss (NaN or inf)"}

