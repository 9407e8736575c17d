"""What runs beside a trial on its host: the CPU time and memory of the trial's own process
tree, the load of the rest of the machine, and the driver's sleep while a trial is in its
timed windows. Read at window edges only, outside the timed windows."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

from tuner.hardware import affinity, usable_cores
from tuner.settings import HUSH_ENV

if TYPE_CHECKING:
    from tuner.nvml import NvmlSampler


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_cpu(cpus: frozenset[int] | None = None) -> tuple[float, float, float] | None:
    """(busy, idle, stolen) CPU-seconds since boot of the CPUs ``cpus`` (None: the whole
    machine), from /proc/stat. A process bound to some of a node's cores (a Slurm
    allocation, ``taskset``) passes its own (``hardware.affinity``): the jobs on the
    others do not share its cores, and on a full node they would leave it no idle core
    to tell their load from its own.

    Stolen: time a hypervisor gave to other VMs. It is recorded apart and does not make
    a window disturbed: on a loaded VM it grows with the trial's own load, and measuring
    again cannot escape it. None where /proc/stat does not exist.
    """
    try:
        with open("/proc/stat") as f:
            if cpus is None:
                rows = [f.readline().split()]
            else:
                rows = [r for r in (line.split() for line in f)
                        if r and r[0].startswith("cpu") and r[0][3:].isdigit() and int(r[0][3:]) in cpus]
        fields = [sum(col) for col in zip(*([int(x) for x in (r[1:] + ["0"] * 8)[:8]] for r in rows), strict=True)]
    except (OSError, ValueError):
        return None
    if not fields:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
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


def own_rss_bytes() -> int | None:
    """This process's resident set now (VmRSS): cheap to read (microseconds), so it is
    read at every window's edges, for memory that grows step after step."""
    kb = _status_kb("self", "VmRSS")
    return kb * 1024 if kb is not None else None


def heap_bytes(pids: Iterable[int]) -> int | None:
    """These processes' anonymous resident memory now, together (None where one is not
    started, 0, or cannot be read): what a DataLoader worker whose dataset keeps what it
    reads grows. Not their whole resident set: that also grows as a worker first runs
    through the libraries' code, and holds the batches it hands over in shared memory."""
    total = 0
    for pid in pids:
        kb = _status_kb(pid, "RssAnon") if pid else None
        if kb is None:
            return None
        total += kb * 1024
    return total


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
    ``cap_s``; returns the seconds slept. Ray Tune's driver loop wakes 10 times a second,
    on the trial's cores; asleep,
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

    def cpu_split_s(self) -> tuple[float, float, float]:
        """CPU seconds so far of this process, of its children (the DataLoader workers,
        reaped ones of past epochs included) and of its peers (the other ranks, their
        workers included)."""
        t = os.times()
        peers = 0.0
        for p in self.peers:
            try:  # a peer's reaped children (its workers of past epochs) too
                c = p.cpu_times()
                peers += c.user + c.system + c.children_user + c.children_system + sum(
                    _cpu_s(q) for q in p.children(recursive=True))
            except psutil.Error:
                pass
        children = t.children_user + t.children_system + sum(_cpu_s(c) for c in self.children())
        return t.user + t.system, children, peers

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
    # what the trial itself used, in cores: its whole tree, and its loading processes (the
    # DataLoader workers: a worker that waits on a disk or a network uses little of a
    # core, one that decodes uses all of it, and the cores they leave are the step's)
    trial_cores: float = 0.0
    loader_cores: float = 0.0

    def disturbed(self, max_interference: float, cpus: int, max_steal: float = 1.0) -> bool:
        cpu = self.other_cores > max_interference * cpus and self.idle_cores < 0.5
        return cpu or self.steal_cores > max_steal * cpus or self.gpu_others > 0


# /proc/stat counts each CPU's state at its clock ticks, while the tree's CPU time is what
# it ran: over a span of a few ticks the difference can read up to a tick per CPU of load
# that is not there (quiet windows of a few ticks read as disturbed), and a fixed allowance
# for it, as large as that error, also hides most of a real core of load. A span shorter
# than this is read together with the windows just before it, back to this long: a core
# of load lasts across them, and the ticks' error shrinks with the span.
POOL_S = 10 / _CLK_TCK


@dataclass
class _Span:
    """The CPU-seconds of ``brackets`` window brackets in a row: the machine's busy, idle
    and stolen; the tree's (its process, loaders, peers); the tuner's own; over ``span``
    seconds ending at ``end``."""

    busy: float
    idle: float
    steal: float
    split: tuple[float, ...]
    observers: float
    span: float
    end: float
    brackets: int = 1

    def __add__(self, other: _Span) -> _Span:
        return _Span(self.busy + other.busy, self.idle + other.idle, self.steal + other.steal,
                     tuple(a + b for a, b in zip(self.split, other.split, strict=True)),
                     self.observers + other.observers, self.span + other.span, max(self.end, other.end),
                     self.brackets + other.brackets)


def pooled(spans: list[_Span], pool_s: float = POOL_S) -> _Span:
    """The last span, with the ones just before it added until they cover ``pool_s``; a
    span that began more than ``pool_s`` after the one before it ends the run."""
    total = spans[-1]
    for earlier, later in zip(reversed(spans[:-1]), reversed(spans[1:]), strict=True):
        if total.span >= pool_s or later.end - later.span - earlier.end > pool_s:
            break
        total = earlier + total
    return total


class LoadMeter:
    """Brackets one window: ``start()`` before, ``stop(wall_s)`` after, both untimed.

    The machine's CPU time is read at the bracket's edges, which enclose the window and
    the reading of the tree's own CPU at the start: its rates are per second of that
    span, not of the window. Per second of the window, a machine busy on every core
    read above its cores (the span is longer), and a window of a process that sleeps
    beside a busy machine read as disturbed whatever ``max_interference`` allowed.
    A span shorter than ``POOL_S`` is read with the brackets just before it."""

    def __init__(self, probe: TreeProbe, nvml: NvmlSampler | None = None):
        self.probe, self.nvml = probe, nvml
        self.cpus, self.cpuset = usable_cores(), affinity()  # the cores this trial can have
        self._start: tuple | None = None
        self._spans: list[_Span] = []

    def start(self) -> None:
        self.probe.refresh_peers()
        machine, t0 = machine_cpu(self.cpuset), time.perf_counter()
        self._start = (machine, t0, self.probe.cpu_split_s(), self.probe.observers_cpu_s())

    def stop(self, wall_s: float) -> Load | None:
        if self._start is None or self._start[0] is None or wall_s <= 0:
            return None
        (busy0, idle0, steal0), t0, split0, obs0 = self._start
        now = machine_cpu(self.cpuset)
        if now is None:
            return None
        end = time.perf_counter()
        busy1, idle1, steal1 = now
        split = tuple(b - a for a, b in zip(split0, self.probe.cpu_split_s(), strict=True))
        covered = max(wall_s, end - t0)  # what the machine's figures cover
        self._spans.append(_Span(busy1 - busy0, idle1 - idle0, steal1 - steal0, split,
                                 self.probe.observers_cpu_s() - obs0, covered, end))
        p = pooled(self._spans)
        # the next window's pool reaches back no further than this one's
        del self._spans[:-p.brackets]
        tree, span = sum(p.split), p.span
        gpu_others = self.nvml.other_processes() if self.nvml is not None else 0
        # at most the cores the trial left: /proc/stat counts in ticks, which over a
        # short window can add up to more than the machine has
        others = min(p.busy - tree, self.cpus * span - tree)
        return Load(other_cores=max(0.0, others / span), tuner_cores=max(0.0, p.observers / span),
                    idle_cores=max(0.0, p.idle / span), gpu_others=gpu_others,
                    steal_cores=max(0.0, p.steal / span),
                    trial_cores=max(0.0, tree / span), loader_cores=max(0.0, p.split[1] / span))


class TreeActivity:
    """Whether a trial's process tree is doing anything: its CPU time, the bytes it reads
    and writes, its resident memory, its processes coming and going, and with ``gpus``
    (CUDA_VISIBLE_DEVICES) their utilization. A compile, a dataset being opened or read,
    workers starting: each moves one of these. A DataLoader worker blocked for good and a
    training process waiting on it move none. Read from outside the tree (the trial's
    parent), a few times a minute."""

    CPU_FLOOR = 0.02  # cores: the tree's idle chatter (a loader polling its queue) stays below
    IO_FLOOR = 64 * 1024  # bytes read or written between two looks
    RSS_FLOOR = 4 * 2**20

    def __init__(self, pid: int, gpus: str | None = None, cpu_floor: float = CPU_FLOOR):
        self.pid, self.gpus, self.cpu_floor = pid, gpus, cpu_floor
        self.state: tuple | None = None
        self.seen_at = self.active_at = time.perf_counter()

    def idle_for(self, now: float) -> float:
        """Seconds since the tree last did something, as of ``now``."""
        state = self._state()
        if state is None or self.state is None or self._moved(self.state, state, now - self.seen_at):
            self.active_at = now
        self.state, self.seen_at = state, now
        return now - self.active_at

    def _moved(self, a: tuple, b: tuple, dt: float) -> bool:
        (cpu0, io0, rss0, pids0), (cpu1, io1, rss1, pids1) = a, b
        return (cpu1 - cpu0 > self.cpu_floor * dt or io1 - io0 > self.IO_FLOOR
                or abs(rss1 - rss0) > self.RSS_FLOOR or pids0 != pids1 or self._gpu_busy())

    def _state(self) -> tuple | None:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return None
        cpu = io = rss = 0.0
        for p in procs:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    cpu += t.user + t.system + t.children_user + t.children_system
                    rss += p.memory_info().rss
                    c = p.io_counters()
                    io += getattr(c, "read_chars", c.read_bytes) + getattr(c, "write_chars", c.write_bytes)
            except (psutil.Error, AttributeError):
                continue
        return cpu, io, rss, frozenset(p.pid for p in procs)

    def _gpu_busy(self) -> bool:
        """Whether a kernel ran on the trial's GPUs lately; True where that cannot be told
        (no NVML): a GPU trial is then never taken for idle."""
        if not self.gpus:
            return False
        try:
            import pynvml

            pynvml.nvmlInit()
            ids = [int(g) for g in self.gpus.split(",") if g.strip().isdigit()]
            return any(pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(i)).gpu > 0
                       for i in ids) or not ids
        except Exception:  # no library, no driver
            return True
