"""Why a config is slow: a bottleneck verdict from cheap signals measured in every
trial, and recommendations mapped to knobs and to the guides' recipes.

Signals (all in a trial's record): ``data_wait_fraction`` (time blocked on the
DataLoader), ``gpu_util_pct`` (NVML, GPU runs only), memory against the device's
capacity or ``max_memory_mb``, ``compile_s`` against the planned run, the page
faults per step (a churning host heap), the share of full garbage collections
(``gc_share``), the window spread, and memory that grew step after step. Each
recommendation quotes the figure that triggered it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tuner import knobs
from tuner.records import MEMORY_READ, OBJECTIVE_METRICS
from tuner.settings import MeasureSettings

# Where the recipes come from (../shared/guides), cited in recommendations.
GUIDES = {
    "loader": "guide 000/002: DataLoader workers, persistent_workers, prefetch_factor",
    "sync": "guide 000: no .item()/host syncs in the hot path",
    "memory": "guide 003: activation checkpointing, gradient accumulation",
    "compute": "guide 003/004: mixed precision, torch.compile, fused optimizers, channels_last, cudnn.benchmark",
    "group": "guide 000: group_collate for multi-dataset batches",
}

INPUT_BOUND = 0.25  # data wait above this share of the step
# On a CPU, DataLoader workers that hide the data wait take their cores from the step's
# threads: where they take this share of the trial's cores, the input side costs as
# much as a data wait of INPUT_BOUND would
LOADER_HEAVY = 0.25
GPU_IDLE = 60.0  # % utilization below this with little data wait: the host holds the GPU back
MEMORY_NEAR = 0.90  # peak above this share of capacity (or of max_memory_mb)
COMPILE_HEAVY = 0.25  # compile above this share of the projected run
NOISY = 0.20  # windows spread above this
# Page faults per step above this, with glibc moving its thresholds by itself: the heap
# churns, and where those thresholds settle is drawn per process (tens with malloc_retain).
CHURN_FAULTS = 1000
# An item that a loading process reads (its time per item, the collate's share taken out)
# in less time than this leaves a dataset cache nothing to save: reading a batch from
# the cache costs a few µs an item itself (`cache_read` on the results page), and the
# collate stays.
CACHE_FLOOR_S = 10e-6
# The collate above this share of a loading process's time per item: the batch's own
# assembly, not the items, is the input pipeline's cost, and no knob of the items saves it
COLLATE_HEAVY = 0.5
# The interpreter's full garbage collections above this share of the timed windows: as
# much as tells a search's top configs apart, and gc_freeze takes it back.
GC_HEAVY = 0.05


def per_item(seconds: float) -> str:
    """A time per item, in the unit that reads it (µs below a tenth of a millisecond)."""
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.1f} µs"


@dataclass
class Diagnosis:
    verdict: str  # input-bound | compute-bound | host-sync-bound | memory-bound | unknown
    evidence: str
    recommendations: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    measured: list[str] = field(default_factory=list)  # recommendations the search already measured
    moves: dict[str, dict] = field(default_factory=dict)  # a recommendation -> the knob values it sets

    def as_dict(self) -> dict:
        return {"verdict": self.verdict, "evidence": self.evidence,
                "recommendations": self.recommendations, "flags": self.flags, "measured": self.measured}

    def against(self, best: dict, rows: list[dict], metric: str) -> Diagnosis:
        """This diagnosis of a search's best config, with each recommendation the search
        already measured turned into what it read: its values tried in the best's own config
        (the other knobs alike), else in the best config that had them. A "try" for values
        the search measured slower sends the user to measure them again."""
        recs, measured = [], []
        for rec in self.recommendations:
            move = self.moves.get(rec)
            having = [r for r in rows if move and r.get("feasible") and r.get(metric)
                      and all(r["config"].get(k) == v for k, v in move.items())]
            if not having or not best.get(metric):
                recs.append(rec)
                continue
            others = [[k for k, v in r["config"].items() if k not in move and v != best["config"].get(k)]
                      for r in having]
            twin = next((r for r, apart in zip(having, others, strict=True) if not apart), None)
            sign = -1 if OBJECTIVE_METRICS.get(metric) == "min" else 1
            # each figure over the baseline's beside it (``records.with_speedups``) where rows
            # carry it: figures taken as the machine drifted compare as they were measured
            paired = bool(best.get("speedup")) and all(r.get("speedup") for r in having)
            standing = [r["speedup"] if paired else sign * r[metric] for r in having]
            seen = twin or having[standing.index(max(standing))]
            apart = len(others[having.index(seen)])
            where = ("with the best config's other knobs" if twin is not None else
                     f"at most, in a config {apart} other knob{'s' if apart > 1 else ''} from the best")
            traced = f"; it recompiled {seen['recompiles_in_windows']:g}x in its windows" \
                if seen.get("recompiles_in_windows") else ""
            traced += "; measured only beside other load" if seen.get("disturbed") else \
                "; screened after its first windows" if seen.get("screened") else ""
            values = ", ".join(f"{k}={_word(v)}" for k, v in move.items())
            ratio = ((seen["speedup"] / best["speedup"]) ** sign if paired else seen[metric] / best[metric])
            measured.append(f"{values}: {_fmt(seen[metric])} {metric} "
                            f"({ratio:.2f}x the best) {where}{traced}")
        return Diagnosis(self.verdict, self.evidence, recs, self.flags, measured, self.moves)


def _word(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _fmt(v: float) -> str:
    return f"{v:,.1f}" if abs(v) >= 1 else f"{v:.3g}"


def diagnose(record: dict, max_memory_mb: float | None = None) -> Diagnosis:
    """The bottleneck of one measured config, and what to change, from its record."""
    if record.get("samples_per_sec") is None and record.get("status") != "ok":
        return Diagnosis("unknown", f"no measurement ({record.get('reason')})")
    c = {**knobs.defaults(), **(record.get("config") or {})}
    hw = record.get("hardware") or {}
    cpus = hw.get("cpu_count") or 1
    on_gpu = record.get("peak_device_memory_mb") is not None
    wait = record.get("data_wait_fraction") or 0.0
    util = record.get("gpu_util_pct")
    recs: list[str] = []
    flags: list[str] = []
    moves: dict[str, dict] = {}

    def advise(text: str, **move: Any) -> None:
        recs.append(text)
        moves[text] = move

    # the workload's own autocast, or a model of 16-bit parameters: the precision knob has
    # no effect inside the one, little on the other
    own_autocast = record.get("own_autocast") or record.get("half_params")
    # a CPU without native bf16 instructions emulates it: a step can take several times
    # fp32's (init leaves precision out there unless a probe's bf16 step kept near fp32's)
    emulated = not on_gpu and "cpu_bf16" in hw and not hw["cpu_bf16"]
    mem, cap = _memory(record, max_memory_mb)
    if mem is not None and cap and mem / cap >= MEMORY_NEAR:
        verdict, evidence = "memory-bound", f"peak memory {mem:,.0f} MB is {mem / cap:.0%} of {cap:,.0f} MB"
        if not c["activation_checkpointing"]:
            advise(f"activation_checkpointing=true ({evidence}; {GUIDES['memory']})", activation_checkpointing=True)
        if c["micro_batch_size"] > 1:
            half, accum = max(1, c["micro_batch_size"] // 2), c["grad_accum_steps"] * 2
            advise(f"micro_batch_size={half} with grad_accum_steps={accum} (same effective batch; {evidence})",
                   micro_batch_size=half, grad_accum_steps=accum)
        if c["precision"] == "fp32" and not own_autocast:
            cost = "; emulated on this CPU, its steps can take several times fp32's" if emulated else ""
            advise(f"precision=bf16 halves activation memory ({evidence}{cost})", precision="bf16")
    elif wait >= INPUT_BOUND:
        verdict, evidence = "input-bound", f"data wait is {wait:.0%} of the step"
        if c["num_workers"] < max(1, cpus - 1):
            more = min(max(1, cpus - 1), max(c["num_workers"] * 2, c["num_workers"] + 1))
            advise(f"num_workers={more} (now {c['num_workers']}; {evidence}; {GUIDES['loader']})", num_workers=more)
        if c["num_workers"] > 0 and not c["persistent_workers"]:
            advise(f"persistent_workers=true (workers are respawned every epoch; {evidence})", persistent_workers=True)
        if c["num_workers"] > 0 and (c["prefetch_factor"] or 2) < 4:
            advise(f"prefetch_factor=4 ({evidence})", prefetch_factor=4)
        if on_gpu and not c["pin_memory"]:
            advise(f"pin_memory=true and non_blocking=true ({evidence})", pin_memory=True, non_blocking=True)
        if c["batch_grouping"] == "mixed" and record.get("has_groups"):
            advise(f"batch_grouping=by_source ({GUIDES['group']})", batch_grouping="by_source")
        rate = record.get("load_samples_per_sec_per_process")
        collate = record.get("collate_s_per_sample") if rate else None
        # what a cache could save a loading process: its time per item less the collate's share
        # (reading the item, and the loader's own per-item work and hand-over)
        read = max(0.0, 1 / rate - collate) if rate and collate is not None else 1 / rate if rate else None
        if not c.get("dataset_cache") and record.get("map_style") and not (read is not None and read < CACHE_FLOOR_S):
            cost = (f"an item costs {per_item(1 / rate)} to produce in a loading process"
                    f"{f' ({per_item(collate)} of it in the collate, which the cache does not save)' if collate else ''}; "
                    if rate else "")
            advise(f"dataset_cache=true ({cost}read once, it is paid once, not every epoch; {evidence}; "
                   f"refused where items differ between reads)", dataset_cache=True)
        if rate and collate is not None and collate * rate >= COLLATE_HEAVY:
            recs.append(f"the collate takes {per_item(collate)} of the {per_item(1 / rate)} an item costs its "
                        f"loading process ({evidence}): build the batch's tensors at once (torch.stack, "
                        f"pad_sequence, one torch.tensor of the batch) rather than item by item in Python; "
                        f"more workers share it, no knob of the items saves it")
        if record.get("has_augment") and on_gpu and c.get("augment_on") != "device":
            advise(f"augment_on=device (the per-batch augmentation runs in the loader's workers; {evidence})",
                   augment_on="device")
        if c["num_workers"] >= max(1, cpus - 1):
            workers = f"{c['num_workers']} worker{'s' if c['num_workers'] != 1 else ''}"
            move = ("move augmentation to the GPU" if on_gpu else
                    "batch the per-item random work in Workload.augment, which runs once per batch")
            recs.append(f"the loader already has {workers} on {cpus} CPUs: make the dataset's per-sample work "
                        f"cheaper (precompute invariant work, {move}; guide 002)")
        if not on_gpu and c["torch_threads"] is None and c["num_workers"] > 0:
            threads = max(1, cpus - c["num_workers"])
            advise(f"torch_threads={threads} (training threads compete with {c['num_workers']} worker(s) for "
                   f"{cpus} CPUs)", torch_threads=threads)
    elif on_gpu and util is not None and util < GPU_IDLE:
        verdict, evidence = "host-sync-bound", f"GPU busy {util:.0f}% of the time while data wait is only {wait:.0%}"
        recs.append(f"remove per-step host syncs from the loss (.item(), .cpu(), printing tensors; {evidence}; "
                    f"{GUIDES['sync']})")
        if c["compile"] in ("off", "default"):
            advise(f"compile=reduce-overhead (CUDA graphs cut launch overhead; {evidence})", compile="reduce-overhead")
        recs.append(f"a larger micro_batch_size gives the GPU more work per launch ({evidence})")
    else:
        verdict = "compute-bound"
        # "only" where the wait is small; a wait just under the input-bound mark is said as such
        evidence = ("data wait under 1%" if wait < 0.01 else f"data wait only {wait:.0%}" if wait < INPUT_BOUND / 2 else
                    f"data wait {wait:.0%}, under the {INPUT_BOUND:.0%} that makes it input-bound") \
            + (f", GPU busy {util:.0f}%" if util is not None else "")
        if c["precision"] == "fp32" and not own_autocast and not emulated:
            advise(f"precision=bf16 ({evidence}; {GUIDES['compute']})", precision="bf16")
        if c["compile"] == "off":
            advise(f"compile=default (measure: on small CPU models it can be slower; {evidence})", compile="default")
        if not c.get("group_by_length") and record.get("has_lengths"):
            advise(f"group_by_length=true (items of similar length batched together: less of the step's work is "
                   f"padding; {evidence})", group_by_length=True)
        if not c["fused_optimizer"] and record.get("fused_step") is not False:  # unknown in older records
            advise("fused_optimizer=true", fused_optimizer=True)
        if not c["channels_last"] and record.get("has_conv2d") is not False:  # unknown in older records
            advise("channels_last=true for conv nets", channels_last=True)
        loader, trial = record.get("loader_cpu_cores") or 0.0, record.get("trial_cpu_cores")
        if not on_gpu and not c.get("dataset_cache") and record.get("map_style") and trial \
                and loader / trial >= LOADER_HEAVY:
            advise(f"dataset_cache=true (the DataLoader's workers take {loader:.1f} of the trial's {trial:.1f} "
                   f"cores to produce items: read once, the step has those cores; refused where items differ "
                   f"between reads)", dataset_cache=True)
        if on_gpu and not c["cudnn_benchmark"]:
            advise("cudnn_benchmark=true (fixed input shapes)", cudnn_benchmark=True)

    collections, workers = record.get("gc_share") or 0.0, record.get("workers_gc_share") or 0.0
    if not c["gc_freeze"] and max(collections, workers) >= GC_HEAVY:
        # first: the share is the loop's own time, whatever the verdict (a collection that
        # starts while a batch is collated is data wait too); the workers' slows their loading
        whose = (f"{collections:.0%} of the timed windows" if collections >= workers
                 else f"{workers:.0%} of the DataLoader workers' time")
        text = (f"gc_freeze=true (the interpreter's full garbage collections took {whose}, each a scan of every "
                f"object made before the loop)")
        recs.insert(0, text)
        moves[text] = {"gc_freeze": True}

    flags += _flags(record, c, on_gpu)
    return Diagnosis(verdict, evidence, recs, flags, moves=moves)


def _flags(record: dict, c: dict, on_gpu: bool) -> list[str]:
    """What else the record says of the config's figure: a heavy compile, the heap's
    draw, windows that disagree."""
    flags: list[str] = []
    compile_s, run_s = record.get("compile_s") or 0.0, record.get("projected_run_s")
    if run_s and compile_s / run_s >= COMPILE_HEAVY:
        flags.append(f"compile takes {compile_s:.0f} s, {compile_s / run_s:.0%} of the planned run: "
                     f"compile=off or a longer run")
    if (traced := record.get("recompiles_in_windows")) and c["compile"] != "off":
        flags.append(f"torch.compile traced {traced:g} new graph(s) inside the timed windows: a shape or a Python "
                     "value its guards check changed between steps, and each recompile is in the figure; pad to "
                     "a few fixed sizes (`tuner profile --set compile=...` names the guard)")
    faults = record.get("page_faults_per_step")
    if not on_gpu and knobs.GLIBC and not c["malloc_retain"] and faults and faults >= CHURN_FAULTS:
        # Workers started anew: a process's first epoch draws more faults than its later
        # ones, which this figure holds.
        first = (" (with DataLoader workers started anew each epoch, its first epoch also runs a few "
                 "percent slower than the later ones this figure holds)"
                 if c["num_workers"] > 0 and not c["persistent_workers"] else "")
        flags.append(f"{faults:,.0f} page faults per step: glibc returns each step's buffers to the kernel, "
                     "and where its thresholds settle is drawn per process, so another run of this config "
                     f"may read several percent faster or slower{first}; malloc_retain=true fixes them")
    spread = record.get("samples_per_sec_spread")
    if spread is not None and spread >= NOISY:
        flags.append(f"timing windows spread {spread:.0%}: {_why_spread(record)}")
    return flags + _growth_flags(record)


# What grew, for each memory read (``records.MEMORY_READ``), and what usually grows it.
GROWN = {"host": ("the trial process's resident memory", "outputs or losses kept without .detach(), a cache "
                  "filled on every read"),
         "device": ("the GPU memory its tensors hold", "outputs or losses kept without .detach(), tensors kept on "
                    "the GPU step after step"),
         "workers": ("the DataLoader workers' heaps", "a dataset that keeps what it reads, a list it appends to in "
                     "__getitem__")}


def _growth_flags(record: dict) -> list[str]:
    """Where memory grew through the timed windows: what each step leaves behind grows for
    as long as the run, and ends a long one."""
    flags = []
    for name in MEMORY_READ:
        what, usual = GROWN[name]
        grown, steps = record.get(f"{name}_memory_growth_mb"), record.get(f"{name}_memory_growth_steps")
        if record.get(f"{name}_memory_grew_steadily") and grown and steps:
            flags.append(f"{what} grew through the timed windows, {grown:,.0f} MB over {steps:,} steps "
                         f"({grown / steps * 1000:,.0f} MB per 1,000): something each step leaves behind ({usual}) "
                         f"grows for as long as the run, or, a cache of the dataset's items, until it holds them all")
    return flags


def _why_spread(record: dict) -> str:
    """What the load beside the windows says of their spread: a window that other load
    kept from its cores is measured again, so where the load meter saw little beside the
    kept ones the spread is the workload's own (an epoch start in a window, data waits,
    a GPU's clocks), and blaming another process sends the user to look for none."""
    if record.get("steady_from") == "batch lengths":
        # the windows' spread is the batches' own, by design: the figure is not their average
        ran = ("batches by length that cost many-fold apart (each measured epoch starts on its longest pair)"
               if (record.get("config") or {}).get("group_by_length") else
               "batches padded to their longest item, which cost many-fold apart")
        return (f"its windows ran {ran}, and the figure is fitted on those batches' lengths over a whole "
                f"epoch's, not read from the windows' average")
    other, cpus = record.get("interference_cores"), (record.get("hardware") or {}).get("cpu_count")
    if other is None or not cpus:
        return "another process may share this machine"
    # the share of the cores beside a window above which the windows read as disturbed
    if other >= MeasureSettings.model_fields["max_interference"].default * cpus:
        return f"other processes used {other:.1f} of {cpus} cores beside its windows (`tuner doctor` names them)"
    return (f"other load beside its windows was {other:.1f} of {cpus} cores, so the spread is the workload's "
            "own pace (an epoch start, data waits, the device's clocks); more windows (measure.min_windows) "
            "steady its figure")


def _memory(record: dict, max_memory_mb: float | None) -> tuple[float | None, float | None]:
    hw = record.get("hardware") or {}
    if record.get("peak_device_memory_mb") is not None:
        mem, cap = record["peak_device_memory_mb"], hw.get("gpu_memory_mb")
    else:
        mem, cap = record.get("peak_host_memory_mb"), hw.get("host_memory_mb")
    if max_memory_mb:
        cap = min(cap, max_memory_mb) if cap else max_memory_mb
    return mem, cap
