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
import gc
import math
import os
import resource
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import NamedTuple

import torch

from tuner.data import CollectionClock, WorkerWatch
from tuner.hardware import peak_flops, usable_cores
from tuner.hostload import (
    Load,
    LoadMeter,
    TreeProbe,
    heap_bytes,
    hushed,
    own_rss_bytes,
    ray_workers_beside,
)
from tuner.hotpath import OwnAutocast
from tuner.loop import GroupedBatchSampler, Trainer, synchronize
from tuner.nvml import NvmlSampler
from tuner.ranks import Agree, across_ranks
from tuner.records import MEMORY_READ, Figures, stage_rates
from tuner.settings import PHASES, MeasureSettings, RunPlan
from tuner.windows import (
    EPOCH_WINDOWS,
    SCREEN_SKIP,
    Window,
    epoch_fit,
    length_fit,
    length_weights,
    median_error,
    spread,
    steady_windows,
    windows_verdict,
)

# Batches by length are timed in windows of whole epochs where an epoch lasts at most this
# many windows (WindowPlan.try_whole_epochs): a trial then times at most that many times
# its usual windows, and a longer epoch's windows of a few pairs each average more pairs.
WHOLE_EPOCHS_UP_TO = 6
# The first windows are capped at this many windows of window_s until sized (WindowPlan).
FIRST_WINDOWS_UP_TO = 3


def measure(trainer: Trainer, settings: MeasureSettings, plan: RunPlan, *,
            startup_s: float = 0.0, progress: Callable[[str], None] | None = None,
            probe: TreeProbe | None = None, screen: dict | None = None,
            rank_info: dict | None = None, phase: Callable[[str], None] | None = None) -> Figures:
    """Measure a built Trainer; returns its figures (``records.Figures``).

    ``startup_s`` is the one-time cost already spent building the trainer.
    A non-finite loss stops the measurement early with ``loss_finite: False``.
    ``screen``: ``{"below": samples/sec, "margin": fraction}`` from the search: after
    ``settings.screen_windows`` windows past the first, a config that cannot reach
    ``below`` even with ``margin`` of noise in its favour stops (``screened: True``,
    ``screen_stop``).
    ``phase``: told where the trial is before its first step is over (``PHASES``), for a
    trial that hangs there to say where.
    With several data-parallel ranks (``trainer.world``), every rank calls this; the
    figures are global (all ranks' samples over the slowest rank's time) and each
    rank's own are under ``ranks`` (``rank_info`` is added to this rank's entry).

    As nanoGPT's ``bench.py``: a burn-in (``_warm_up``), then timed windows sized to
    ``window_s`` (``WindowPlan``, ``_timed_windows``), then the figures: the disturbed
    windows left out (``_leave_out_disturbed``), epoch boundaries spread over the planned
    epoch (``_figures``), the record (``_record``).
    """
    say = progress or (lambda msg: None)
    agree = Agree(trainer)
    probe = _probe(probe, agree, rank_info)
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(trainer.device)
    # 1. burn-in: worker start, compile, autotune
    warm = _warm_up(trainer, settings, say, phase or (lambda name: None))
    if agree.any(not trainer.loss_finite()):
        return _nonfinite(trainer, warm.seconds)
    # 2. timed windows, synchronized at their edges only
    windows = WindowPlan.size(trainer, settings, agree, warm)
    nvml = NvmlSampler(trainer.device)
    collated = trainer.collate_clock.totals()
    with nvml, hushed() as driver_asleep, FullCollections(trainer.worker_watch) as collections:
        timed = _timed_windows(trainer, settings, windows, agree, LoadMeter(probe, nvml), probe, screen, say)
    collated = [after - before for after, before in zip(trainer.collate_clock.totals(), collated, strict=True)]
    if timed.nonfinite:
        return _nonfinite(trainer, warm.seconds)
    # 3. the figures
    probe.sample_memory()
    peak_host = probe.peak_host_bytes()  # before the figures: they may read the items' lengths
    left_out = _leave_out_disturbed(timed, settings)
    figures = _figures(trainer, plan, timed, warm, startup_s, settings)
    record = _record(trainer, timed, figures, peak_host, windows, warm, startup_s, screen, left_out)
    # driver_asleep: the driver slept through the windows
    record.update(nvml.summary(), driver_asleep=driver_asleep, gc_share=collections.share(),
                  workers_gc_share=collections.workers_share(),
                  collate_s_per_sample=collated[0] / collated[1] if collated[1] else None)
    return _energy(_across_ranks(record, trainer, agree, timed, rank_info))


class FullCollections:
    """The interpreter's full (oldest-generation) garbage collections in this process while
    inside: how long they took, over the wall time inside. A full collection scans every
    object the collector tracks and stops the loop while it runs; a batch collated from
    many small items can start one every few steps (``gc_freeze``). DataLoader workers
    collect in their own processes: ``workers``, where there are any, adds up theirs
    (``workers_share``)."""

    def __init__(self, workers: WorkerWatch | None = None) -> None:
        self.workers = workers
        self.workers_seconds = 0.0

    def __enter__(self) -> FullCollections:
        self.seconds, self.wall, self._t0 = 0.0, 0.0, perf_counter()
        self._workers_t0 = self.workers.total() if self.workers is not None else 0.0
        self._clock = CollectionClock(self._add)
        gc.callbacks.append(self._clock)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._clock)
        self.wall = perf_counter() - self._t0
        if self.workers is not None:
            self.workers_seconds = self.workers.total() - self._workers_t0

    def _add(self, seconds: float) -> None:
        self.seconds += seconds

    def share(self) -> float:
        return min(1.0, self.seconds / self.wall) if self.wall > 0 else 0.0

    def workers_share(self) -> float | None:
        """Of the workers' wall time (each worker's, over the timed phase) in their own full
        collections; None without workers."""
        if self.workers is None:
            return None
        return min(1.0, self.workers_seconds / (self.wall * self.workers.workers)) if self.wall > 0 else 0.0


def _frames_compiled() -> int:
    """Frames dynamo has compiled in this process so far: one more inside the timed windows
    is a recompile there (a shape or a Python value its guards check changed between
    steps), whose compile time is in the figure."""
    import sys

    dynamo = sys.modules.get("torch._dynamo.utils")
    return int(dynamo.counters["frames"]["total"]) if dynamo is not None else 0


def _stage_rates(trainer: Trainer, steady: float, wait_fraction: float) -> dict:
    """The pipeline's two stages apart (``records.stage_rates``), at the steady rate, on
    this machine's cores as the search's model reads them (``knobs.Context.cpu_count``):
    more workers than cores load at most ``cores`` at once."""
    compute, load = stage_rates(steady, wait_fraction, getattr(trainer.loader, "num_workers", 0) or 0,
                                usable_cores())
    return {"compute_samples_per_sec": compute, "load_samples_per_sec_per_process": load}


def _energy(record: Figures) -> Figures:
    """Joules per sample: the GPUs' mean board power during the timed windows (every rank's
    GPU draws about this one's) over the trial's rate. The GPU's draw only: the host's CPUs
    and memory are not in it, and on a CPU there is no figure."""
    power, rate = record.get("gpu_power_w"), record.get("samples_per_sec")
    joules = power * record.get("world_size", 1) / rate if power and rate else None
    record.update(joules_per_sample=joules, samples_per_joule=1 / joules if joules else None)
    return record


def _probe(probe: TreeProbe | None, agree: Agree, rank_info: dict | None) -> TreeProbe:
    """The trial's process tree, with its other ranks on this node as its own."""
    probe = probe or TreeProbe()
    if agree.world > 1:
        here = (rank_info or {}).get("node") or os.uname().nodename
        probe.add_peers([r["pid"] for r in agree.gather({"pid": os.getpid(), "node": here})
                         if r["node"] == here and r["pid"] != os.getpid()])
        # Ray Train's controller, the trial's driver and its result box run beside the
        # ranks as Ray workers: they are how a multi-rank trial runs, not load beside it.
        # Ray Train starts more of them once the ranks run (its dataset manager,
        # preemption watcher, and the workers Ray starts to host them), so they are
        # looked for again before every window.
        probe.find_peers = lambda: ray_workers_beside(probe)
        probe.refresh_peers()
    return probe


def _across_ranks(record: dict, trainer: Trainer, agree: Agree, timed: Timed, rank_info: dict | None) -> Figures:
    """The record with its world size, and with several ranks each rank's own figures."""
    record["world_size"] = agree.world
    record["samples_per_sec_per_rank"] = record["samples_per_sec"] / agree.world
    if agree.world > 1:
        own = {"rank": trainer.rank, **(rank_info or {}),
               "step_time_ms": timed.own_s / max(1, timed.own_steps) * 1e3,
               "data_wait_fraction": min(1.0, timed.own_wait_s / timed.own_s) if timed.own_s > 0 else None,
               "peak_host_memory_mb": record["peak_host_memory_mb"],
               "peak_device_memory_mb": record["peak_device_memory_mb"]}
        record.update(across_ranks(agree.gather(own)))
    return record


@dataclass
class WarmUp:
    steps: list[float]  # each warm-up step's seconds
    seconds: float  # the whole warm-up
    start_s: float  # DataLoader workers spawned
    first_wait: float  # the first batch's wait: workers started, dataset opened
    own_autocast: list[str] | None = None  # where the workload turns autocast on itself (eager only)


def _warm_up(trainer: Trainer, settings: MeasureSettings, say: Callable[[str], None],
             phase: Callable[[str], None]) -> WarmUp:
    """Worker start, compile, autotune; each step timed (syncs are fine here). The first
    epoch ends with the warm-up, so the timed phase starts on an epoch start."""
    t0 = perf_counter()
    trainer.set_epoch_limit(settings.warmup_steps * trainer.samples_per_step)
    s0 = perf_counter()
    phase(PHASES[1])
    trainer.start(on_first_batch=lambda: phase(PHASES[3]))
    phase(PHASES[2])
    start_s = perf_counter() - s0
    steps: list[float] = []
    first_wait = 0.0
    # The first eager step runs under a profiling hook that sees the workload turn autocast
    # on itself (the precision knob has no effect inside it). Not with compile: the hook
    # would slow the compile that this step times.
    own = OwnAutocast() if trainer.config["compile"] == "off" else None
    for i in range(settings.warmup_steps):
        say(f"warm-up step {i + 1}/{settings.warmup_steps}")
        s0 = perf_counter()
        with own if own is not None and i == 0 else contextlib.nullcontext():
            trainer.step()
        synchronize(trainer.device)
        steps.append(perf_counter() - s0)
        if i == 0:
            first_wait = trainer.data_wait_s
    return WarmUp(steps, perf_counter() - t0, start_s, first_wait, own.described() if own is not None else None)


@dataclass
class WindowPlan:
    """How long a timed window is (in steps) and how long an epoch.

    DataLoader workers take batches in turn and deliver them in order, and after an
    epoch starts they run in step: the waits repeat every round of num_workers
    micro-batches, counted from the epoch start. Windows and epochs are whole rounds
    (whole steps too: a cycle is the least multiple of both), so every window starts
    and ends at the same point of a round. A window of, say, 3.25 rounds that ends
    just after a round arrived reads up to a round fast, and the last window of an
    epoch always does, by up to a round's share of the window.
    """

    trainer: Trainer
    settings: MeasureSettings
    est: float  # seconds per step, from the warm-up
    cycle: int
    min_steps: int
    room: int  # steps a window may have for five to fit in an epoch (0: no limit)
    dataset_steps: int
    steps: int = 0  # per window
    cap_s: float = math.inf  # the windows are also capped in time until sized
    sized: bool = False  # sized by the first two undisturbed windows
    fastest: float = math.inf  # seconds per step, the least of those windows'
    epoch_window: int = 0  # steps of a whole epoch, while the first window is one (try_whole_epochs)
    whole_epochs: bool = False  # batches by length: every window is whole epochs

    @classmethod
    def size(cls, trainer: Trainer, settings: MeasureSettings, agree: Agree, warm: WarmUp) -> WindowPlan:
        # The warm-up can read fast: DataLoader workers fill their prefetch queues while
        # the first steps compile, and the last warm-up steps only drain them. So the first
        # window is also capped in time, and sizes the windows after it.
        est = agree.max(min(warm.steps[-2:]) if len(warm.steps) >= 2 else warm.steps[-1])[0]
        workers = getattr(trainer.loader, "num_workers", 0)
        # (and batches by length come in pairs of a long and a short one: whole pairs too)
        round_ = math.lcm(max(workers, 1), trainer.batch_round)
        cycle = math.lcm(round_, trainer.accum) // trainer.accum if round_ > 1 else 1
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
        plan.cap_s = FIRST_WINDOWS_UP_TO * settings.window_s if agree.world == 1 else math.inf
        plan.try_whole_epochs()
        return plan

    def try_whole_epochs(self) -> None:
        """Batches by length (``group_by_length``) cost several-fold apart: the longest
        pair of a short epoch can take a quarter of it. A window of a few pairs then reads
        whichever pairs it holds, and a search's trial of a few windows, less than an
        epoch, reads them too: one config's trials spread several times as far as its
        whole runs did. So the first window is one whole epoch, not cut short (the timed
        phase starts on an epoch start), capped at ``WHOLE_EPOCHS_UP_TO`` windows of
        ``window_s``; where it ends within that, every window is whole epochs, each batch
        in it once (``resize``). One rank only: the cap is off with several."""
        sampler = self.trainer.sampler
        if (not self.trainer.by_length or self.settings.epoch_steps is not None or self.cap_s == math.inf
                or not isinstance(sampler, GroupedBatchSampler)):
            return
        epoch = sampler.whole_epoch() // self.trainer.accum
        if epoch < 1:
            return
        # An epoch longer than the cap is measured in part, and its figure fitted on the
        # batches the windows ran (windows.length_fit): every epoch starting on its
        # longest pair puts the dearest batches among them.
        sampler.longest_first_always = True
        self.epoch_window, self.steps, self.cap_s = epoch, epoch, WHOLE_EPOCHS_UP_TO * self.settings.window_s
        self.trainer.set_epoch_limit(epoch * self.trainer.samples_per_step, align=self.trainer.samples_per_step)

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
        """The first undisturbed window sizes the windows (a disturbed one would size them
        to the disturbance); the second may still end the room limit (below)."""
        if self.epoch_window:
            epoch, self.epoch_window = self.epoch_window, 0
            if steps == epoch:  # the whole epoch within the cap: windows of whole epochs from now on
                self.steps = whole_epochs(epoch, epoch * self.settings.window_s / max(wall, 1e-9))
                self.room, self.sized, self.cap_s, self.whole_epochs = 0, True, math.inf, True
                say(f"batches by length: windows of {self.steps // epoch} whole epoch(s), {self.steps} steps")
                return
            self.cap_s = FIRST_WINDOWS_UP_TO * self.settings.window_s  # a longer epoch: windows sized as any other's
        first = self.fastest == math.inf
        self.fastest = min(self.fastest, wall / steps)
        self.sized = not first
        lifted = bool(self.room) and self.room * self.fastest < self.settings.window_s / 4
        if lifted:
            # Windows of a fifth of an epoch would be a small part of window_s: an epoch
            # of a few fast steps then runs whole inside each window, boundaries and all,
            # as a user's run of many such epochs does. Windows of a few steps each read
            # the interpreter's periodic costs (a full garbage collection every few dozen
            # steps) and the timing's own by chance: a dataset of small tensors read 0.45x
            # to 1.8x its own script that way, and 1.0x in windows of many epochs. The
            # faster of the first two windows decides: one window of a few steps may hold
            # that collection itself, and read an epoch's fifth several times as long.
            # Both may hold one: sized on them alone, a window could still end inside an
            # epoch. So each window is whole epochs, however slow those windows read.
            self.room = 0
        elif not first:
            return
        fit = self.whole_cycles(self.settings.window_s / max(self.fastest, 1e-9))
        if lifted:
            fit = whole_epochs(self.dataset_steps, fit)
        if not self.steps / 1.5 <= fit <= self.steps * 1.5:
            say(f"warm-up read {self.est * 1e3:.1f} ms per step, the first windows "
                f"{self.fastest * 1e3:.1f} ms: {fit} steps per window")
            self.steps = fit
            self.size_epochs(now=True)


def whole_epochs(epoch: int, steps: float) -> int:
    """The whole number of epochs of ``epoch`` steps nearest ``steps``, at least one."""
    return epoch * max(1, round(steps / epoch))


@dataclass
class Timed:
    """The timed phase so far: the windows kept and what ran beside them."""

    kept: list[Window] = field(default_factory=list)
    busy: list[bool] = field(default_factory=list)  # disturbed, but kept: the redos had run out
    loads: list[Load | None] = field(default_factory=list)
    faults: list[int] = field(default_factory=list)  # minor page faults of this process, per window
    rates: list[float] = field(default_factory=list)
    spans: list[tuple | None] = field(default_factory=list)  # per kept window (Measured.span)
    whole_epochs: bool = False  # WindowPlan.whole_epochs
    disturbed: list[float] = field(default_factory=list)  # rates of windows dropped as disturbed
    screened: bool = False
    below_incumbent: bool = False  # measured to min_windows only: clearly below the incumbent
    nonfinite: bool = False
    timed_s: float = 0.0
    gap_s: float = 0.0  # untimed, between windows
    clock: list[float] = field(default_factory=list)  # the first window's start, the last one's end
    starts_before: int = 0  # epoch starts before the timed phase
    recompiled: list[tuple[float, int]] = field(default_factory=list)  # (seconds, steps) of windows dropped
    traced: int = 0  # frames torch.compile traced inside the windows kept: recompiles the redos did not outlast
    own_s: float = 0.0  # this rank's own clock
    own_wait_s: float = 0.0
    own_steps: int = 0
    # (steps run so far in the timed phase, the process's resident bytes, the device's
    # allocated bytes, the DataLoader workers' heaps; None where not read) before the
    # first window and after each one, redone ones too
    memory: list[tuple[int, int | None, int | None, int | None]] = field(default_factory=list)

    def fetch_s(self) -> float:
        """An ordinary micro-batch fetch: data wait outside epoch boundaries, per micro-batch."""
        n = sum(w.micro_batches - w.boundaries for w in self.kept)
        return sum(w.wait for w in self.kept) / n if n > 0 else 0.0


def _rate(w: Window, fetch: float) -> float:
    # The clock stops for each epoch boundary (measured apart, as epoch_overhead_s,
    # beyond an ordinary fetch); the ordinary fetch of the boundary's first batch
    # belongs to the steady step and is put back.
    return w.samples / max(1e-9, w.wall - w.paused + w.boundaries * fetch)


class Measured(NamedTuple):
    """One window as measured, before it is kept or measured again."""

    window: Window
    steps: int
    load: Load | None
    busy: bool  # disturbed by other load, as the ranks agreed
    faults: int  # minor page faults of this process
    nonfinite: bool
    traced: int  # frames torch.compile traced in the window (on any rank, where one did)
    span: tuple | None  # the window's first and last Trainer.drawn_at (the batches it ran), if known


def _one_window(trainer: Trainer, plan: WindowPlan, agree: Agree, meter: LoadMeter, probe: TreeProbe, t: Timed,
                before: int) -> Measured:
    """Time one window of ``plan.steps`` steps (the first one also capped in time),
    synchronized at its edges only, with what ran beside it."""
    device = trainer.device
    synchronize(device)
    g0 = perf_counter()
    if not t.kept and not t.disturbed:
        # Workers' private pages, before the first window and after the last only:
        # reading them takes milliseconds per worker, during which the workers run on
        # and fill their queues, so the window after such a pause would read fast.
        probe.sample_memory()
    if not t.memory:
        t.memory.append((0, *_memory_now(trainer)))
    meter.start()
    faults0, frames0 = _minor_faults(), _frames_compiled()
    at0 = trainer.drawn_at()
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
    faults, traced = _minor_faults() - faults0, _frames_compiled() - frames0
    load = meter.stop(wall)
    busy = load is not None and load.disturbed(plan.settings.max_interference, meter.cpus, plan.settings.max_steal)
    t.own_s, t.own_wait_s, t.own_steps = t.own_s + wall - paused, t.own_wait_s + wait, t.own_steps + steps
    t.memory.append((t.own_steps, *_memory_now(trainer)))
    # One all-reduce per window edge: the slowest rank's figures, on every rank.
    wall, paused, wait, busy, nonfinite, traced = agree.max(wall, paused, wait, float(busy),
                                                            float(not trainer.loss_finite()), float(traced))
    window = Window(steps * trainer.samples_per_step * trainer.world, wall, paused,
                    len(trainer.epoch_start_s) - e0, steps * trainer.accum, wait, before)
    span = (at0, trainer.drawn_at()) if at0 is not None else None
    return Measured(window, steps, load, bool(busy), faults, bool(nonfinite), int(traced), span)


def _timed_windows(trainer: Trainer, settings: MeasureSettings, plan: WindowPlan, agree: Agree, meter: LoadMeter,
                   probe: TreeProbe, screen: dict | None, say: Callable[[str], None]) -> Timed:
    """Windows until the figure is precise enough, capped, screened out, or clearly below
    the incumbent; a window disturbed by other load is measured again (up to
    ``max_windows`` redos), as is one in which torch.compile traced a new graph (a shape or
    a Python value its guards check changed: a one-time cost like the warm-up's compile,
    counted with it; recompiles that outlast ``max_windows`` redos are the steady rate's)."""
    t = Timed(starts_before=len(trainer.epoch_start_s))
    before = 1  # the warm-up ended on an epoch boundary

    def steady_enough() -> bool:
        """Two windows clear of epoch boundaries, where the epochs leave room for them:
        five windows (a shorter dataset's epochs are measured whole, boundaries and all,
        and its windows' average is already the sustained rate)."""
        if settings.epoch_steps is not None or plan.dataset_steps < EPOCH_WINDOWS * plan.steps:
            return True
        return len(steady_windows(t.kept)) >= 2

    agree.max(0.0)  # a barrier: the ranks start the first window together
    while True:
        m = _one_window(trainer, plan, agree, meter, probe, t, before)
        window, before = m.window, m.window.boundaries
        redo = m.busy and len(t.disturbed) < settings.max_windows
        retrace = m.traced > 0 and len(t.recompiled) < settings.max_windows
        if retrace:
            t.recompiled.append((window.wall - window.paused, m.steps))
            say("window held a recompile (torch.compile traced a new graph): measuring it again")
            continue
        if not plan.sized and not redo:
            # Epochs shorter than a window put their boundaries in every window: then
            # window_s is the wall time, pauses included (sized on the steady time alone,
            # a short epoch's window holds a worker start each, and ran several times
            # window_s). The first window holds one boundary however long the epochs
            # are: the timed phase starts on an epoch start.
            plan.resize(m.steps, window.wall if window.boundaries >= 2 else window.wall - window.paused, say)
        if redo:
            t.disturbed.append(_rate(window, t.fetch_s()))
            say(f"window disturbed ({m.load.other_cores:.2f} cores used outside the trial, "
                f"{m.load.steal_cores:.2f} stolen by the hypervisor): measuring it again")
            continue
        t.kept.append(window)
        t.spans.append(m.span)
        t.traced += m.traced
        t.faults.append(m.faults)
        t.busy.append(m.busy)
        t.loads.append(m.load)
        t.rates.append(_rate(window, t.fetch_s()))
        t.timed_s += window.wall - window.paused
        say(f"window {len(t.rates)}: {t.rates[-1]:.1f} samples/s")
        if m.nonfinite:
            t.nonfinite = True
            break
        # However short its windows (an epoch of a few steps holds five of a few steps
        # each), the timed phase lasts at least half of min_windows windows of window_s:
        # a cost that comes every few dozen steps (a full collection of the interpreter's
        # heap, where each step makes thousands of objects) is then in the figure at its
        # rate, not in or out of a fraction of a second of windows by chance.
        short = t.timed_s < 0.5 * settings.min_windows * settings.window_s
        capped = (len(t.rates) >= settings.max_windows and not short) or t.timed_s >= settings.max_timed_s
        done = windows_verdict(t.rates, screen, min_windows=settings.min_windows, target_error=settings.target_error,
                               screen_windows=settings.screen_windows, capped=capped, steady=steady_enough())
        if done == "enough" and short and t.timed_s < settings.max_timed_s:
            done = None
        if done == "screened":
            t.screened = True
            say(f"screened out: {max(t.rates[SCREEN_SKIP:]):.1f} samples/s cannot reach {screen['below']:.1f}")
        t.below_incumbent = done == "below_incumbent"
        if done:
            break
    t.clock.append(perf_counter())
    t.whole_epochs = plan.whole_epochs
    return t


def _leave_out_disturbed(t: Timed, settings: MeasureSettings) -> int:
    """A disturbance that outlasts the redos (capped) leaves disturbed windows among those
    kept (a hog of a few seconds reads a figure low that way). Where enough quiet windows
    remain, the figure comes from them alone (the number left out is returned);
    otherwise, with more than a third of its windows disturbed, the measurement is
    marked, and never picks a winner. (``busy`` is the flag the ranks agreed on, so
    every rank keeps the same windows.)"""
    quiet = [i for i, b in enumerate(t.busy) if not b]
    if len(quiet) == len(t.kept) or len(quiet) < max(2, settings.min_windows // 2 + 1):
        return 0
    left_out = len(t.kept) - len(quiet)
    t.kept = [t.kept[i] for i in quiet]
    t.spans = [t.spans[i] for i in quiet]
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
    # Batches by length cost many-fold apart (attention over the longest few can cost as
    # much as dozens of short ones), so no window between boundaries is "steady": the
    # few such windows hold mostly cheap pairs, and their rate, carried over the rest of
    # a long epoch (a timed phase covers part of one), reads it high. The figure is then
    # every window's time over every pair the windows drew, as for a short epoch, where
    # the windows are whole epochs; where they cover part of one, even every window's
    # pairs are a few of the epoch's, and read whichever the stretch held (the sampler's
    # seed is the same in every trial, so the same stretch every time): their time is
    # fitted on their batches' lengths and carried over a whole epoch's (length_fit).
    # Batches in a random order that pad to their longest item read whichever the seed
    # put in the windows too, where the workload gives its items' lengths: each window's
    # samples then count at their batches' fitted cost over a whole epoch's (the steady
    # windows and the boundaries' cost kept apart, as for any other batches).
    lengths = (trainer.longest_between(t.spans, [w.micro_batches for w in kept])
               if trainer.world == 1 and not t.whole_epochs and t.spans and all(s is not None for s in t.spans)
               else None)
    weights = (length_weights(elapsed, lengths[0], [w.boundaries for w in kept], lengths[1])
               if lengths is not None and not trainer.by_length else None)
    fit = None if trainer.by_length else epoch_fit(kept, weights)
    if fit is not None:
        per_sample, epoch_overhead_s = fit
        overhead_from = "windows"
    else:
        # Too few steady windows (epochs as long as the timed phase), or batches by
        # length: each boundary's pause beyond an ordinary batch fetch, and the rest of
        # the time as steady.
        work = weights or [1.0] * len(kept)
        per_sample = sum(elapsed) / sum(w.samples * x for w, x in zip(kept, work, strict=True))
        epoch_overhead_s = max(0.0, statistics.median(starts) - micro_fetch_s) if starts else None
        overhead_from = "pauses"
    steady_from = "batch lengths" if weights else "steady windows" if fit is not None else "all windows"
    if trainer.by_length and lengths is not None:
        # an epoch measured in part: its windows' time fitted on their batches' lengths
        # and carried over a whole epoch's batches (windows.length_fit)
        per_batch = length_fit(elapsed, *lengths)
        if per_batch is not None:
            per_sample, steady_from = per_batch / trainer.config["micro_batch_size"], "batch lengths"
    steady = 1 / per_sample
    step_s = step_samples / steady
    epoch_size = plan.epoch_size or _dataset_len(trainer) or trainer.workload.epoch_size or _seen_epoch(trainer)
    if epoch_size is not None:
        steps_per_epoch = max(1, epoch_size // step_samples)
        epoch_s = steps_per_epoch * step_s + (epoch_overhead_s or 0.0)
        scale = steps_per_epoch * step_samples / epoch_s / steady
    else:
        epoch_s, scale = None, 1.0
    surplus = max(0.0, warm.seconds - settings.warmup_steps * step_s)  # warm-up beyond steady steps
    # a recompile inside a window was measured again: its time beyond the window's steady
    # steps is one-time compile, as the warm-up's is
    recompile_s = sum(max(0.0, wall - steps * step_s) for wall, steps in t.recompiled)
    # The first batch's wait beyond an ordinary fetch is worker start-up, not compile.
    worker_start_s = min(surplus, warm.start_s + max(0.0, warm.first_wait - micro_fetch_s * trainer.accum))
    return {"rates": rates, "steady": steady, "scale": scale, "step_s": step_s, "wait_fraction": wait_fraction,
            "epoch_overhead_s": epoch_overhead_s, "overhead_from": overhead_from, "starts": len(starts),
            "steady_from": steady_from,
            "epoch_size": epoch_size, "epoch_s": epoch_s, "one_time_s": startup_s + surplus + recompile_s,
            "worker_start_s": worker_start_s,
            "compile_s": max(0.0, surplus - worker_start_s) + recompile_s if trainer.config["compile"] != "off"
            else 0.0,
            "projected": plan.epochs * epoch_s + startup_s + surplus + recompile_s if epoch_s is not None else None}


def _record(trainer: Trainer, t: Timed, f: dict, peak_host: int, windows: WindowPlan, warm: WarmUp,
            startup_s: float, screen: dict | None, left_out: int) -> Figures:
    """The measurement's record (the fields ``bench --json`` and ``trials.jsonl`` carry)."""
    device = trainer.device
    rates, steady = f["rates"], f["steady"]
    flops = trainer.workload.flops_per_sample
    peak = peak_flops(device, trainer.config["precision"], trainer.config["tf32"])
    loads = [ld for ld in t.loads if ld is not None]  # the figure's windows, no others
    result = {
        "samples_per_sec": steady * f["scale"],
        "samples_per_sec_spread": spread(rates),
        "samples_per_sec_error": median_error(rates),
        "samples_per_sec_windows": [r * f["scale"] for r in rates],
        "steady_samples_per_sec": steady,
        "step_time_ms": f["step_s"] * 1e3,
        "data_wait_fraction": min(1.0, max(0.0, f["wait_fraction"])),
        **_stage_rates(trainer, steady, f["wait_fraction"]),
        "windows": len(rates),
        "window_steps": windows.steps,
        "timed_s": t.timed_s,
        "warmup_s": warm.seconds,
        "startup_s": startup_s,
        "compile_s": f["compile_s"],
        "recompiles_in_windows": t.traced,
        "recompile_windows_redone": len(t.recompiled),
        "worker_start_s": f["worker_start_s"],
        "one_time_s": f["one_time_s"],
        "epoch_overhead_s": f["epoch_overhead_s"],
        "epoch_starts_measured": f["starts"],
        "epoch_overhead_from": f["overhead_from"],
        "steady_from": f["steady_from"],
        "between_windows_s": t.gap_s,
        # CLOCK_MONOTONIC (perf_counter on Linux), one clock for every process of the
        # machine: what ran beside the timed phase can be lined up with it
        "timed_clock_s": t.clock,
        "epoch_size": f["epoch_size"],
        "epoch_s": f["epoch_s"],
        "projected_run_s": f["projected"],
        "loss_finite": True,
        "own_autocast": warm.own_autocast,
        "mfu": flops * steady / peak if flops and peak else None,
        "achieved_tflops": flops * steady / 1e12 if flops else None,
        "peak_device_memory_mb": None,
        "peak_device_reserved_mb": None,
        "peak_host_memory_mb": peak_host / 2**20,
        # How the heap behaves: glibc's malloc trims and re-grows it, and each page it
        # takes back costs a fault (where its thresholds settle is drawn per process, so
        # two fresh processes of one loop may differ several-fold). The trial's process
        # only: workers not included.
        "page_faults_per_step": (sum(t.faults) * trainer.accum / sum(w.micro_batches for w in t.kept)
                                 if t.kept else None),
        "host_memory_measure": "peak RSS of the trial process + private pages of its DataLoader workers",
        **memory_growth(t.memory),
        # what ran beside the timed windows (medians over the windows kept)
        "interference_cores": statistics.median(ld.other_cores for ld in loads) if loads else None,
        "tuner_cpu_cores": statistics.median(ld.tuner_cores for ld in loads) if loads else None,
        "steal_cores": statistics.median(ld.steal_cores for ld in loads) if loads else None,
        # what the trial used (the input pipeline's share apart): how the cores were split
        "trial_cpu_cores": statistics.median(ld.trial_cores for ld in loads) if loads else None,
        "loader_cpu_cores": statistics.median(ld.loader_cores for ld in loads) if loads else None,
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


def _memory_now(trainer: Trainer) -> tuple[int | None, int | None, int | None]:
    """The trial process's resident bytes, on a GPU the bytes its tensors hold there (read
    at a window's edge, after its synchronize), and the DataLoader workers' heaps (a
    file read per worker: microseconds)."""
    device, workers = trainer.device, trainer.worker_watch
    return (own_rss_bytes(), torch.cuda.memory_allocated(device) if device.type == "cuda" else None,
            heap_bytes(workers.pids) if workers is not None else None)


# Memory that grew through the timed windows: by this much in all, and by a MB or more in
# at least this many windows, none of them holding half the growth. The heap grows in
# steps (a freed buffer's room takes the next few allocations), so a leak skips a window
# now and then; a one-time growth (the heap settling, a cache built once) lands in one or
# two windows.
GROWTH_MB = 32.0
GROWTH_WINDOWS = 3


def memory_growth(samples: list[tuple[int, int | None, int | None, int | None]]) -> dict:
    """From ``Timed.memory``: how much the trial process's resident memory, the device
    memory its tensors hold and the DataLoader workers' heaps grew over the timed phase's
    steps, in MB (None where not read: a shrink is negative; over a few steps, the heap's
    own swings are tens of MB), and ``*_grew_steadily``: whether it grew through the
    windows (``GROWTH_MB``, ``GROWTH_WINDOWS``): a step that leaves something behind (a
    list of losses that hold their graphs, a cache filled on each read). ``diagnose``
    says so."""
    out: dict = {}
    for i, name in enumerate(MEMORY_READ, 1):
        seen = [(s[0], s[i]) for s in samples if s[i] is not None]
        if len(seen) < 2 or seen[-1][0] <= seen[0][0]:
            continue
        grown = (seen[-1][1] - seen[0][1]) / 2**20
        steps = [(b[1] - a[1]) / 2**20 for a, b in zip(seen, seen[1:], strict=False)]
        out[f"{name}_memory_growth_mb"] = grown
        out[f"{name}_memory_growth_steps"] = seen[-1][0] - seen[0][0]
        out[f"{name}_memory_grew_steadily"] = (grown >= GROWTH_MB and sum(d >= 1 for d in steps) >= GROWTH_WINDOWS
                                               and max(steps) < 0.5 * grown)
    return out


def _minor_faults() -> int:
    """Minor page faults of this process so far, every thread's (getrusage)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _dataset_len(trainer: Trainer) -> int | None:
    try:
        return len(trainer.dataset)
    except TypeError:
        return None


def _seen_epoch(trainer: Trainer) -> int | None:
    """An iterable dataset's epoch in samples, as its epochs ran out during the measurement
    (the median); None where none did. Without it the figure would leave out every epoch
    boundary of a dataset whose epochs end every few steps."""
    if trainer.sampler is not None or not trainer.epoch_micro_batches:
        return None
    return int(statistics.median(trainer.epoch_micro_batches)) * trainer.config["micro_batch_size"] * trainer.world


def _nonfinite(trainer: Trainer, warmup_s: float) -> dict:
    return {"loss_finite": False, "samples_per_sec": None, "warmup_s": warmup_s,
            "reason": "non-finite loss (NaN or inf)"}

