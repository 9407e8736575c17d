"""``tuner init``: a space.yaml fitted to the machine it runs on.

The micro-batch values come from a probe on the real device: batch sizes grow from 1
(4x while a size's step and peak, scaled, stay far under the limits, else 2x) until one
fails to fit (an OOM, a peak above the memory cap, or a step slower than ``max_step_s``;
a size too small for the model is passed over up to ``SMALLEST``), then bisect between
the last that fit and the first that did not.
Each probe is a fresh process (``run_isolated``), so an OOM cannot poison the next.
The knobs are those worth searching on this hardware, each line with its reason.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tuner.errors import UserError
from tuner.windows import EPOCH_WINDOWS

# A probe: a short warm-up and one short window. Enough to allocate what a step
# allocates (the peaks) and to time a step; no epoch boundaries, no screening.
PROBE_MEASURE = {"warmup_steps": 2, "window_s": 0.05, "min_windows": 1, "max_windows": 1,
                 "max_timed_s": 5.0, "screen_windows": 0, "max_interference": 1.0,
                 "max_steal": 1.0}


# Where a tiny batch raises (BatchNorm's "expected more than 1 value per channel" at 1), the
# doubling goes on up to this size for one that runs; an OOM or a hang stops it at once.
SMALLEST = 8

# A micro-batch leaves at least this many steps per epoch: two per timed window of an
# epoch (``EPOCH_WINDOWS``); a batch of the whole dataset is one step per epoch, which is
# no training anyone runs.
STEPS_PER_EPOCH = 2 * EPOCH_WINDOWS

# ``dataset_cache`` is written into the space where reading a micro-batch's items (in one
# process, as with no DataLoader workers) takes this share of the probe's step at the
# largest batch more than reading them from the cache. Below it, the saving is within
# what tells a search's top configs apart, and a knob searched for it would take configs
# from the others. (The probe's own data wait cannot tell: its epochs are a few steps
# long, and each epoch's first batch is counted with the epoch's start.)
CACHE_WAIT = 0.1


# On a CPU without native bf16 instructions (AVX512-BF16, AMX), bf16 autocast runs its
# matmuls and convolutions emulated: on such hosts a bf16 step has taken several times
# fp32's (benchmarks/landscapes/: textcls), so no bf16 config could win, and every one a
# search tried was a trial spent. One probe step at fp32's micro-batch decides: bf16 stays
# in the space where its step took under this many times fp32's (the search then
# measures whether it pays), and is left out, saying so, where it took longer. Noise in
# one probe window is tens of percent, well inside the factor.
BF16_SLOWER = 2.0
# The bf16 probe's micro-batch: the largest whose fp32 step took under this, so that a
# step several times slower still ends well within the probe's limits (a smaller batch
# only understates the slowdown: more of its step is the per-step overhead both share).
BF16_PROBE_MS = 250.0


@dataclass
class Probe:
    """One probed micro-batch size and why it fit or not."""

    batch: int
    fits: bool
    why: str
    peak_mb: float | None = None
    step_ms: float | None = None
    kind: str | None = None  # a failed trial's error kind ("oom", "workload", "timeout", ...)


@dataclass
class Fit:
    """The result of the batch probe."""

    largest: int | None
    probes: list[Probe] = field(default_factory=list)
    epoch_size: int | None = None  # the samples an epoch holds, where a probe reported them
    bound: int | None = None  # the largest batch that leaves STEPS_PER_EPOCH steps per epoch
    map_style: bool | None = None  # whether the loader sampled the dataset by index, where a probe ran
    own_autocast: list[str] | None = None  # where the workload turns autocast on itself, where a probe saw it
    half_params: str | None = None  # bfloat16 or float16: the model as built holds only 16-bit parameters

    @property
    def smallest(self) -> int | None:
        """The smallest size that ran: below it, the workload raised (``SMALLEST``)."""
        return min((p.batch for p in self.probes if p.fits), default=None)

    @property
    def at_largest(self) -> Probe | None:
        """The probe of the largest size that fits."""
        return next((p for p in reversed(self.probes) if p.fits and p.batch == self.largest), None)

    @property
    def first_too_big(self) -> Probe | None:
        bigger = [p for p in self.probes if not p.fits and self.largest is not None and p.batch > self.largest]
        return min(bigger, key=lambda p: p.batch) if bigger else None


def probe_batch(measure_one: Callable[[int], dict], *, device: str, max_memory_mb: float | None,
                max_step_s: float, upper: int = 4096,
                say: Callable[[str], None] = lambda msg: None) -> Fit:
    """Growth (``_growth``) then bisection over micro-batch sizes, up to ``upper`` and to
    the largest that leaves ``STEPS_PER_EPOCH`` steps per epoch; ``measure_one(b)`` is a
    trial result."""
    fit = Fit(largest=None)

    def fits(b: int) -> bool:
        nonlocal upper
        r = measure_one(b)
        twice = ""
        if _slow_by_chance(r, b, fit.probes, max_step_s):
            other = measure_one(b)  # one window holds one large step, and that one may be an outlier
            if other.get("status") == "ok" and (other.get("step_time_ms") or 0) < r["step_time_ms"]:
                r, other = other, r  # the faster reading kept; ``other`` the one set aside
            twice = ("; probed twice, the other step " + (f"{other['step_time_ms']:.0f} ms" if other.get("status") == "ok"
                                                           else f"did not run: {other.get('reason')}"))
        if r.get("status") == "ok" and r.get("epoch_size") and fit.epoch_size is None:
            fit.epoch_size = int(r["epoch_size"])
            bound = max(1, fit.epoch_size // STEPS_PER_EPOCH)
            fit.bound = bound - bound % 8 if bound >= 8 else bound  # a multiple of 8: the shapes kernels favour
            upper = min(upper, fit.bound)
        if r.get("status") == "ok" and fit.map_style is None and "map_style" in r:
            fit.map_style = bool(r["map_style"])
        if r.get("own_autocast") and fit.own_autocast is None:
            fit.own_autocast = r["own_autocast"]
        fit.half_params = fit.half_params or r.get("half_params")
        peak = r.get("peak_device_memory_mb") if device == "cuda" else r.get("peak_host_memory_mb")
        step_ms = r.get("step_time_ms")
        if r.get("status") != "ok":
            p = Probe(b, False, r.get("reason") or r.get("status") or "failed", kind=r.get("error_kind"))
        elif max_memory_mb is not None and peak is not None and peak > max_memory_mb:
            p = Probe(b, False, f"peak {peak:.0f} MB > cap {max_memory_mb:.0f} MB", peak, step_ms)
        elif step_ms is not None and step_ms / 1e3 > max_step_s:
            p = Probe(b, False, f"step {step_ms / 1e3:.2g} s > {max_step_s:g} s", peak, step_ms)
        else:
            p = Probe(b, True, "fits", peak, step_ms)
        fit.probes.append(p)
        say(f"micro_batch_size={b}: {p.why}" + (f" (peak {peak:.0f} MB, step {step_ms:.0f} ms{twice})"
                                                 if p.fits and peak is not None and step_ms is not None else
                                                 f" ({twice[2:]})" if twice else ""))
        return p.fits

    room = max_memory_mb
    if room is None and device == "cpu":
        from tuner.hardware import available_memory

        room = available_memory() / 2**20
    lo, hi = 0, None  # lo fits (0: none yet), hi does not
    b = 1
    while True:
        if b > upper:
            if lo >= upper:
                break
            b = upper  # the bound itself, between the last power of two and the next
        if fits(b):
            lo, b = b, b * _growth(fit.probes[-1], max_step_s, room)
            if lo >= upper:
                break
        elif lo == 0 and b < SMALLEST and fit.probes[-1].kind in ("workload", "error"):
            b *= 2  # a size this small may be what raised: a larger one may run
        else:
            hi = b
            break
    if lo == 0:
        return fit
    if hi is not None:
        # bisect to a granularity of an eighth of the size that fits
        while hi - lo > max(1, lo // 8):
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
    fit.largest = lo
    return fit


def _growth(p: Probe, max_step_s: float, room_mb: float | None) -> int:
    """How far the next probed size is from one that fit: 4x where four times its whole
    step and its whole peak (an overestimate: each holds what a step of any size pays)
    stay under half of each limit, else 2x. The small sizes every model fits cost a
    process each (seconds, on a GPU more) and decide nothing."""
    far = (p.step_ms is not None and 4 * p.step_ms <= max_step_s * 1e3 / 2
           and p.peak_mb is not None and room_mb is not None and 4 * p.peak_mb <= room_mb / 2)
    return 4 if far else 2


def _slow_by_chance(r: dict, b: int, probes: list[Probe], max_step_s: float) -> bool:
    """Whether a probe ran but read a step over ``max_step_s`` that the largest smaller
    size that fit, its step scaled to ``b`` samples, puts under it: its one window holds
    a step or two, and one step of a large batch has read twice its neighbours' (a
    collection, the host's neighbours), which would cut the searched sizes short."""
    step = r.get("step_time_ms")
    if r.get("status") != "ok" or not step or step / 1e3 <= max_step_s:
        return False
    below = [p for p in probes if p.fits and p.step_ms and p.batch < b]
    if not below:
        return False
    near = max(below, key=lambda p: p.batch)
    return near.step_ms * b / near.batch / 1e3 <= max_step_s


def bf16_probe_size(fit: Fit) -> Probe | None:
    """The fp32 probe the bf16 probe is set beside (``BF16_PROBE_MS``), or None where no
    probe that fit timed its step."""
    timed = [p for p in fit.probes if p.fits and p.step_ms]
    quick = [p for p in timed if p.step_ms <= BF16_PROBE_MS]
    if quick:
        return max(quick, key=lambda p: p.batch)
    return min(timed, key=lambda p: p.batch) if timed else None


def bf16_verdict(fp32: Probe, result: dict) -> tuple[bool, str]:
    """(keep bf16 in the space, why) from a bf16 probe (a trial's result) at ``fp32``'s
    micro-batch, on a CPU without native bf16 (``BF16_SLOWER``)."""
    at = f"at micro_batch_size={fp32.batch}"
    if result.get("status") != "ok" or not result.get("step_time_ms"):
        return False, f"a bf16 probe {at} did not run: {result.get('reason') or result.get('status')}"
    ratio = result["step_time_ms"] / fp32.step_ms
    said = (f"no native bf16 instructions here: a bf16 step took {ratio:.1f}x fp32's {at} "
            f"({_ms(result['step_time_ms'])} against {_ms(fp32.step_ms)}, one probe each)")
    return ratio < BF16_SLOWER, said


def _ms(ms: float) -> str:
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.2g} ms"


def batch_values(largest: int, smallest: int = 1) -> list[int]:
    """Up to four sizes: the largest that fits, and the powers of two below it down to
    an eighth of it, none below ``smallest`` (the smallest that ran)."""
    values = {largest}
    p = 1 << (largest.bit_length() - 1)  # the highest power of two <= largest
    if p == largest:
        p //= 2
    while p >= max(smallest, largest // 8) and len(values) < 4:
        values.add(p)
        p //= 2
    return sorted(values)


def _cores(n: int) -> str:
    return "1 core" if n == 1 else f"{n} cores"


def knob_lines(device: str, cores: int, bf16: bool, conv: bool, compiler: bool,
               fused: bool = True, gpus: int = 1, workers_repeat: bool = False,
               items_on: str | None = None) -> list[tuple[str, object, str]]:
    """(knob, values, why) for this hardware, micro_batch_size excluded. GPU knobs only on
    a GPU; bf16 on a GPU only where it is supported; the fused optimizer where the
    workload's optimizer has a fused step (``fused``). With several GPUs the DataLoader
    workers go up to a GPU's share of the cores: a search runs a trial per GPU at once,
    and a data-parallel run gives each rank that share. ``workers_repeat``: the dataset
    is an iterable one that every worker reads whole (``tuner.data.workers_repeat``), so
    at most one worker. ``items_on``: the dataset's items are already on that device, so
    no DataLoader workers and nothing to pin or copy."""
    lines: list[tuple[str, object, str]] = []
    if device == "cuda":
        precisions = ["fp32"] + (["bf16"] if bf16 else []) + ["fp16"]
        why = "bf16 on this GPU" if bf16 else "no bf16 on this GPU"
    else:  # bf16 autocast runs on any CPU; without native instructions it may be slower: measured
        precisions = ["fp32", "bf16"]
        why = "native bf16 here" if bf16 else "no native bf16 instructions here: the search measures whether it pays"
    lines.append(("precision", precisions, why + ("; fp16 with a GradScaler" if device == "cuda" else "")))
    share = max(1, cores // gpus) if device == "cuda" and gpus > 1 else cores
    # Up to the cores, not one fewer: workers that wait on a file or a queue share a core
    # with the step, and on several recorded 2-core landscapes (benchmarks/landscapes/)
    # as many workers as cores was the fastest split.
    workers = [0] + [w for w in (1, 2, 4, 8, 16) if w <= share]
    if items_on:
        pass  # a worker cannot use the device from its own process, and the items need no loading
    elif workers_repeat:
        lines.append(("num_workers", [0, 1], "every worker yields the whole iterable dataset (it does not split "
                      "its stream by get_worker_info()): more workers would train each item once more apiece"))
    else:
        lines.append(("num_workers", workers, f"up to the {_cores(cores)} a trial can have" if share == cores else
                      f"up to a GPU's share of the cores ({cores} over {gpus} GPUs: a trial per GPU at once, as a "
                      f"data-parallel run's ranks)"))
    if not items_on:
        lines.append(("persistent_workers", [False, True], "only with num_workers > 0: no respawn per epoch"))
    if device == "cuda":
        if not items_on:
            lines += [("pin_memory", [False, True], "a GPU: page-locked buffers for the copies"),
                      ("non_blocking", [False, True], "a GPU: copies overlap the step")]
        lines += [("cudnn_benchmark", [False, True], "a GPU: cudnn picks kernels for fixed shapes"),
                  ("tf32", [False, True], "a GPU: TF32 matmuls on Ampere and newer")]
        if fused:
            lines.append(("fused_optimizer", [False, True], "a GPU: one fused optimizer kernel"))
    else:
        if fused:  # PyTorch's CPU default steps the parameters one by one in Python (no foreach)
            lines.append(("fused_optimizer", [False, True], "the optimizer has a fused CPU step; "
                                                             "PyTorch's default steps each parameter in turn"))
        lines.append(("torch_threads", sorted({1, max(1, cores // 2), cores}),
                      f"intra-op threads share the {_cores(cores)} with the DataLoader workers"))
    from tuner.knobs import GLIBC

    if GLIBC:
        lines.append(("malloc_retain", [False, True], "glibc's malloc: a step's freed buffers kept for the next"))
    lines.append(("gc_freeze", [False, True], "full garbage collections skip what was built before the loop "
                                              "(torch's own objects among it)"))
    if conv:
        lines.append(("channels_last", [False, True], "the model has Conv2d layers"))
    if compiler:
        lines.append(("compile", ["off", "default"], "a C compiler is here; compile pays off on long runs"))
    return lines


def pipeline_lines(dataset: Callable[[], Any], fit: Fit, device: str, has_augment: bool,
                   say: Callable[[str], None] = print, *, has_groups: bool = False,
                   has_lengths: bool = False, collate: Callable[[list], Any] | None = None
                   ) -> list[tuple[str, object, str]]:
    """(knob, values, why) for the input pipeline's own knobs. ``batch_grouping`` where the
    workload has sources, ``group_by_length`` where it gives a map-style dataset's lengths.
    ``dataset_cache`` where
    reading a micro-batch's items takes ``CACHE_WAIT`` of the probe's step at the largest
    batch more than reading them from the cache (timed here on a sample of the items of
    ``dataset()``, a map-style one), and the items are the same on two reads and fit in
    the memory free now (otherwise ``say`` says why it is left out, and the fix where
    there is one); ``augment_on`` on a GPU where the workload has a per-batch augment.
    ``collate``: the workload's, which tells whether items whose lengths vary are padded."""
    lines: list[tuple[str, object, str]] = []
    if has_groups and fit.map_style:
        lines.append(("batch_grouping", ["mixed", "by_source"], "the workload has sources (Workload.groups): "
                                                               "batches of one source each"))
    if has_lengths and fit.map_style:
        lines.append(("group_by_length", [False, True], "the workload gives its items' lengths (Workload.lengths): "
                                                       "batches of items of similar length pad less"))
    probe = fit.at_largest
    if probe is not None and probe.step_ms and fit.map_style:
        from tuner.data import CacheRefused

        items = None
        try:
            items = dataset()
            lines += _cache_line(items, probe, say)
        except CacheRefused as exc:  # found while caching the sample: what a sample's check cannot see
            say(f"dataset_cache left out: {str(exc).removeprefix('dataset_cache: ')}")
        except Exception as exc:  # the probes' processes read it: the space is written all the same
            say(f"dataset_cache left out: the dataset raised here: {type(exc).__name__}: {exc}")
        if items is not None:
            if not has_lengths and (varied := _varied_lengths(items, collate)):
                say(f"group_by_length left out: the workload gives no lengths, and its items' {varied}; "
                    f"Workload(lengths=lambda dataset: [...]) (each item's length, from what the dataset holds) "
                    f"lets the search batch items of similar length, which pads less")
    if has_augment and device == "cuda":
        lines.append(("augment_on", ["host", "device"], "a GPU: Workload.augment after the copy, on the GPU, leaves "
                                                        "the DataLoader's workers the rest"))
    return lines


def _cache_line(items: Any, probe: Probe, say: Callable[[str], None]) -> list[tuple[str, object, str]]:
    """The ``dataset_cache`` line, where reading a micro-batch's items costs more than
    reading them from the cache by ``CACHE_WAIT`` of the probe's step (reading a cached
    item costs about as much as indexing a tensor: the saving is the difference, timed
    on a sample of items cached here)."""
    import torch

    from tuner.apply import cache_room
    from tuner.data import CacheRefused, cached, check_cacheable, estimate_bytes, spread

    sample = spread(len(items))
    read_ms = _read_ms(items, sample) * probe.batch
    if read_ms / probe.step_ms < CACHE_WAIT:  # the cache cannot save more than the whole read
        return []
    read = f"a micro-batch's {probe.batch} items take {read_ms:,.0f} ms to read here"
    try:
        check_cacheable(items)
        size, room = estimate_bytes(items), cache_room()
        if size > room:
            raise CacheRefused(f"dataset_cache: the items would take about {size / 2**20:,.0f} MB, over the "
                               f"{room / 2**20:,.0f} MB the cache may hold of the memory free now")
    except CacheRefused as exc:
        share = min(read_ms / probe.step_ms, 1.0)
        say(f"dataset_cache left out ({read}, {share:.0%} of a step's time at micro_batch_size={probe.batch}): "
            f"{str(exc).removeprefix('dataset_cache: ')}")
        return []
    part = cached(torch.utils.data.Subset(items, sample), check=1)  # the sample was checked above
    saved = read_ms - _read_ms(part, list(range(len(part)))) * probe.batch
    if saved / probe.step_ms < CACHE_WAIT:
        return []
    return [("dataset_cache", [False, True], f"{read}, {read_ms - saved:,.1f} ms from the cache: "
                                             f"{min(saved / probe.step_ms, 1.0):.0%} of a step's time saved at "
                                             f"micro_batch_size={probe.batch} (the cache: about "
                                             f"{size / 2**20:,.0f} MB, filled once, up front)")]


# A batch of items whose sizes vary, collated, with this share of its largest tensor more
# than its items hold: padding worth batching by length (below it, the collate
# concatenates or packs them: a graph batch, packed sequences)
PADDING_WORTH = 0.10


def _varied_lengths(items: Any, collate: Callable[[list], Any] | None = None, sample: int = 32) -> str | None:
    """Where the items' largest part (the tensor or list of numbers with the most elements
    on average: token lists, audio frames, an image) varies in size by at least 1.5x over
    ``sample`` items spread over the dataset, and those items collated as one batch (by
    ``collate``, PyTorch's default where None) are padded: what the part spans and the
    batch's padding, said; else None (and None for items it cannot read). The largest
    part, since that is what padding costs: a short list beside it (a few ids per field,
    packed by an EmbeddingBag) is not padded; and measured padding, since a collate that
    concatenates (a graph batch) or packs has none to save."""
    import math

    import torch

    from tuner.data import flatten, spread

    def part_shapes(item: Any) -> list[tuple]:  # per part (a number's is ())
        return [(len(x),) if isinstance(x, list) else tuple(getattr(x, "shape", ())) for x in flatten(item)[0]]

    try:
        read = [items[i] for i in spread(len(items), sample)]
        rows = [part_shapes(item) for item in read]
    except Exception:  # the probes read the items: a dataset that raises here is said elsewhere
        return None
    if len(rows) < 2 or len({len(r) for r in rows}) != 1 or not rows[0]:
        return None
    part = max(range(len(rows[0])), key=lambda j: sum(math.prod(r[j]) for r in rows))
    shapes = [r[part] for r in rows]
    counts = [math.prod(shape) for shape in shapes]
    if min(counts) == 0 or max(counts) < 1.5 * min(counts):
        return None
    if len({shape[1:] for shape in shapes}) == 1:  # only the leading dimension varies: a length
        lengths, rest = [shape[0] for shape in shapes], "".join(f" x {d}" for d in shapes[0][1:])
        spans = f"lengths vary ({min(lengths)}-{max(lengths)}{rest} in a sample of {len(rows)})"
    else:
        spans = f"sizes vary ({min(counts)}-{max(counts)} elements in a sample of {len(rows)})"
    try:
        batch = (collate or torch.utils.data.default_collate)(read)
        largest = max((x.numel() for x in flatten(batch)[0] if isinstance(x, torch.Tensor)), default=0)
    except Exception:  # the probes collated their batches: not said here
        return None
    padding = 1 - sum(counts) / largest if largest > sum(counts) else 0.0
    if padding < PADDING_WORTH:
        return None
    return f"{spans}: collated as one batch, they are {padding:.0%} padding"


def _read_ms(items: Any, indices: list[int]) -> float:
    """The milliseconds one item of ``indices`` takes to read, as the DataLoader reads
    them: all at once where the dataset has ``__getitems__`` (the median of a few such
    reads), else one by one (the median, which a first read from a cold disk does not
    move)."""
    import time

    if getattr(items, "__getitems__", None):
        calls = []
        for _ in range(5):  # the first call pays one-time costs
            t0 = time.perf_counter()
            items.__getitems__(list(indices))
            calls.append(time.perf_counter() - t0)
        return sorted(calls)[2] / len(indices) * 1e3
    took = []
    for i in indices:
        t0 = time.perf_counter()
        items[i]
        took.append(time.perf_counter() - t0)
    return sorted(took)[len(took) // 2] * 1e3


def write_space(path: Path, *, name: str, workload: str, workload_args: dict, device: str,
                fit: Fit, lines: list[tuple[str, object, str]], trials: int, cap_note: str) -> str:
    """The space file, each line with its reason; validated before it is written."""
    from tuner import spec

    assert fit.largest is not None
    too_big = fit.first_too_big
    if too_big:
        stop = f"; {too_big.batch} did not ({too_big.why})"
    elif fit.bound is not None and fit.largest >= fit.bound:
        stop = f"; a larger one leaves fewer than {STEPS_PER_EPOCH} steps in an epoch of {fit.epoch_size} samples"
    elif fit.epoch_size is None:  # an iterable dataset without len(): nothing bounded the batch by its epoch
        stop = (f"; the probe stopped at its upper bound (the dataset's length is unknown: Workload(epoch_size=...) "
                f"keeps {STEPS_PER_EPOCH} steps in an epoch)")
    else:
        stop = "; the probe stopped at its upper bound"
    smallest = fit.smallest or 1
    below = f"; below {smallest} the workload raised (see init's output)" if smallest > 1 else ""
    mb_why = f"largest that fits: {fit.largest}{stop}{cap_note}{below}"
    rows = [("micro_batch_size", batch_values(fit.largest, smallest), mb_why), *lines]
    width = max(len(f"  {k}: {_flow(v)}") for k, v, _ in rows) + 2
    text = [f"# Written by `tuner init` for this machine ({device}). Edit freely.",
            f"name: {name}",
            f"workload: {workload}",
            f"workload_args: {_flow(workload_args)}",
            f"device: {device}",
            "knobs:"]
    text += [f"{'  ' + k + ': ' + _flow(v):<{width}}# {why}" for k, v, why in rows]
    text += [f"budget: {{trials: {trials}}}"]
    body = "\n".join(text) + "\n"
    spec.parse(yaml.safe_load(body))  # a file we write must load
    path.write_text(body)
    return body


def _flow(value: object) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...")


def seen_from(workload: str, out: Path) -> str:
    """A workload file reference, given from this folder, as the space file ``out`` must
    name it: a space's relative workload file is found from the space file's own folder."""
    path, sep, func = workload.rpartition(":")
    if not sep or not path.endswith(".py") or Path(path).is_absolute():
        return workload
    return f"{os.path.relpath(Path.cwd() / path, out.resolve().parent)}:{func}"


def init_space(workload: str, workload_args: dict, out: Path, *, device: str = "auto",
               max_memory_mb: float | None = None, max_step_s: float = 2.0, upper: int = 4096,
               trials: int = 12, name: str | None = None, timeout_s: float = 120.0,
               say: Callable[[str], None] = print) -> str:
    """Probe the workload here and write ``out``; returns the file's text."""
    import shutil

    import torch

    from tuner import apply
    from tuner.hardware import cpu_has_bf16, describe, pick_device, usable_cores
    from tuner.trial import make_request, resolve_config, run_isolated

    device = pick_device(device)
    wl = resolve_config(make_request(workload=workload, workload_args=workload_args,
                                     base_dir=str(Path.cwd()), device="cpu")).workload
    cores = usable_cores()
    bf16 = torch.cuda.is_bf16_supported() if device == "cuda" else cpu_has_bf16()
    cap_note = ""
    if device == "cuda" and max_memory_mb is None:
        gpu_mb = describe().get("gpu_memory_mb")
        max_memory_mb = 0.9 * gpu_mb if gpu_mb else None
        cap_note = f" (cap: 90% of the GPU's {gpu_mb:.0f} MB)" if gpu_mb else ""
    elif max_memory_mb is not None:
        cap_note = f" (cap: --max-memory-mb {max_memory_mb:g})"
    precision = "bf16" if bf16 else "fp32"  # memory at the precision that will likely win
    # The probe's one short window holds a full garbage collection or not by chance, and
    # one can take a large batch's step several times over; frozen, they are short.
    settings = {"precision": precision, "gc_freeze": True}

    stem = name or Path(workload.split(":")[0]).stem.replace(".", "-") or "space"
    # The workload's own output (prints, warnings, progress bars) once per probe would bury
    # the probe lines: it goes to one file, named once
    log = Path(tempfile.gettempdir()) / f"tuner-init-{stem}-{os.getpid()}.log"
    log.unlink(missing_ok=True)

    def measure_one(b: int, **other: Any) -> dict:
        req = make_request(workload=workload, workload_args=workload_args, base_dir=str(Path.cwd()),
                           config={"micro_batch_size": b, **settings, **other}, device=device,
                           measure=PROBE_MEASURE)
        return run_isolated(req, timeout_s=timeout_s, retries=0, output=str(log))

    say(f"probing micro-batch sizes on {device} ({precision}), each in a fresh process "
        f"(the workload's own output: {log}, kept if it writes any)")
    try:
        fit = probe_batch(measure_one, device=device, max_memory_mb=max_memory_mb, max_step_s=max_step_s,
                          upper=upper, say=say)
        bf16_probed = None  # (keep, why): on a CPU without native bf16, whether bf16 stays (BF16_SLOWER)
        if device == "cpu" and not bf16 and not (fit.own_autocast or fit.half_params) \
                and (beside := bf16_probe_size(fit)) is not None:
            say(f"probing bf16 at micro_batch_size={beside.batch}: no native bf16 instructions here")
            bf16_probed = bf16_verdict(beside, measure_one(beside.batch, precision="bf16"))
    finally:
        wrote = log.exists() and log.stat().st_size > 0
        if not wrote:  # an empty file in the temp dir per init tells the user nothing
            log.unlink(missing_ok=True)
    if fit.largest is None:
        last = fit.probes[-1] if fit.probes else None
        sizes = "micro_batch_size=1" if not last or last.batch == 1 else f"no micro_batch_size from 1 to {last.batch}"
        raise UserError(f"workload: {sizes} does not fit here: {last.why if last else 'no probe'}"
                        + (f" (the workload's own output: {log})" if wrote else ""))
    bad = fit.first_too_big
    if fit.largest == 1 and bad is not None and bad.kind == "workload":  # a space of batches of one trains nothing
        raise UserError(f"workload: micro_batch_size={bad.batch} raised, and only micro_batch_size=1 ran: {bad.why}"
                        + (f" (the workload's own output: {log})" if wrote else ""))
    model = wl.model()
    unfused = apply.fused_optimizer_of(wl.make_optimizer(model.to(device)), model)
    if unfused:
        say(f"fused_optimizer left out: {unfused}")
    from tuner.data import workers_refused, workers_repeat

    refused = workers_refused()  # the space lists workers all the same: the fix is the environment's
    if refused:
        say(f"note: {refused}; `tuner run` refuses num_workers above 0 until then")
    repeat = False
    if fit.map_style is False and not refused:  # only an iterable dataset can repeat in every worker
        repeat = workers_repeat(wl.dataset())
        if repeat:
            say("num_workers held to [0, 1]: every DataLoader worker yields the whole iterable dataset; split "
                "its stream by torch.utils.data.get_worker_info() to search more workers")
    from tuner.data import items_device

    # a dataset kept on the GPU (built once more here, only on a GPU, where it can be)
    items_on = items_device(wl.dataset()) if fit.map_style and device == "cuda" else None
    if items_on is not None:
        say(f"num_workers, persistent_workers, pin_memory and non_blocking left out: the dataset's items are "
            f"already on {items_on} (a DataLoader worker cannot use the device from its own process, and there "
            f"is nothing to copy)")
    compiler = shutil.which("cc") is not None or shutil.which("gcc") is not None
    if compiler and apply.compile_disabled():
        compiler = False
        say("compile left out: torch.compile is disabled in this process (TORCHDYNAMO_DISABLE=1 or "
            "TORCH_COMPILE_DISABLE=1 in the environment)")
    lines = knob_lines(device, cores, bf16, apply.has_conv2d(model), compiler, fused=unfused is None,
                       gpus=torch.cuda.device_count() if device == "cuda" else 1, workers_repeat=repeat,
                       items_on=str(items_on) if items_on is not None else None)
    if fit.own_autocast or fit.half_params:
        lines = [line for line in lines if line[0] != "precision"]
        say("precision left out: " + (
            f"the workload turns on torch.autocast itself at {'; '.join(fit.own_autocast)}, and inside it the "
            f"precision knob has no effect; take it out of the workload to search precision" if fit.own_autocast else
            f"the model's parameters are {fit.half_params} as the workload builds them, so autocast runs the same "
            f"ops; build it in float32 to search precision"))
    elif bf16_probed is not None:
        keep, why = bf16_probed
        if keep:
            lines = [(k, v, why + ": the search measures whether it pays" if k == "precision" else w)
                     for k, v, w in lines]
        else:
            lines = [line for line in lines if line[0] != "precision"]
            say(f"precision left out: {why}; add `precision: [fp32, bf16]` to search it all the same")
    lines += pipeline_lines(wl.dataset, fit, device, wl.augment is not None, say=say,
                            has_groups=wl.groups is not None, has_lengths=wl.lengths is not None, collate=wl.collate)
    return write_space(out, name=stem, workload=seen_from(workload, out), workload_args=workload_args, device=device,
                       fit=fit, lines=lines, trials=trials, cap_note=cap_note)
