"""The one table of throughput knobs.

The table (``KNOBS``) is read by validation (``resolve``), by the search space,
by the docs (``python -m tuner knobs``) and by the report. A new knob is one
entry here and, if it changes the run, one ``apply_*`` function in ``tuner.apply``
called by ``tuner.loop.Trainer`` (which owns the order in which they are applied).
This module imports no torch: reading a space or a results folder stays fast.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from tuner.errors import UserError, did_you_mean

PRECISIONS = ("fp32", "bf16", "fp16")
COMM_HOOKS = ("none", "bf16_compress", "fp16_compress")
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
GROUPINGS = ("mixed", "by_source")
AUGMENT_PLACES = ("host", "device")
GLIBC = platform.libc_ver()[0] == "glibc"
# malloc_retain: glibc's thresholds as environment variables (what a user's own run sets)
# and as mallopt parameters (what a running process sets: the variables are read once,
# when malloc first runs). Buffers up to 1 GiB come from the heap, and the heap is never
# trimmed (mallopt's int -1 is the variable's 2**64 - 1). A lower mmap threshold leaves a
# language model's logits (often over 100 MB, and their gradient) mapped anew every step,
# with the knob on or off.
MALLOC_RETAIN_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(2**64 - 1)}


@dataclass(frozen=True)
class Context:
    """What a knob's validity and recommended value depend on."""

    device: str  # "cpu" or "cuda"
    cpu_count: int
    has_groups: bool = False  # the workload has several sources (batch_grouping)
    has_augment: bool = False  # the workload has a per-batch augment (augment_on)
    has_lengths: bool = False  # the workload gives its items' lengths (group_by_length)
    bf16_ok: bool = True
    fp16_ok: bool = True
    # bf16 in hardware (a CPU with AVX512-BF16 or AMX): without it a CPU runs bf16 autocast
    # several times slower than fp32
    bf16_native: bool = True


@dataclass(frozen=True)
class Knob:
    """One knob: its domain, PyTorch's default, the guides' pick, when it applies."""

    name: str
    type: type
    doc: str
    default: Any  # what plain PyTorch does: the baseline
    recommended: Callable[[Context], Any]  # the guides' advice, the search's start
    choices: tuple | None = None  # for str knobs
    minimum: int | None = None  # for int knobs
    nullable: bool = False  # None means "leave PyTorch's setting alone"
    gpu_only: bool = False
    # (config, ctx) -> reason the knob does not apply, or None; its docstring says
    # when the knob applies (for the docs). When it does not apply, the knob is held
    # at its default (and a non-default value is an error for an explicit --set, a
    # note for a search).
    inactive: Callable[[dict, Context], str | None] | None = None
    cost: str = ""  # what the knob costs, for docs and report
    recompiles: bool = False  # changes what torch.compile traces: configs differing in it compile apart
    loader: bool = False  # shapes the input pipeline: what a trial waiting for its first batch depends on
    priority: int = 99  # the guided sampler moves knobs in this order (lower first): the biggest levers first


def _needs_workers(config: dict, ctx: Context) -> str | None:
    """with num_workers > 0"""
    return "needs num_workers > 0" if config.get("num_workers", 0) == 0 else None


def _needs_groups(config: dict, ctx: Context) -> str | None:
    """multi-source workloads (Workload.groups)"""
    return None if ctx.has_groups else "the workload has a single source"


def _needs_lengths(config: dict, ctx: Context) -> str | None:
    """workloads that give their items' lengths (Workload.lengths)"""
    return None if ctx.has_lengths else "the workload gives no lengths (Workload.lengths)"


def _needs_augment(config: dict, ctx: Context) -> str | None:
    """workloads with a per-batch augment (Workload.augment)"""
    return None if ctx.has_augment else "the workload has no augment"


def _needs_ranks(config: dict, ctx: Context) -> str | None:
    """with world_size > 1"""
    return "needs world_size > 1" if config.get("world_size", 1) <= 1 else None


def _static_graph_allowed(config: dict, ctx: Context) -> str | None:
    """with world_size > 1, but not with ddp_no_sync_accumulation under accumulation"""
    if config.get("world_size", 1) <= 1:
        return "needs world_size > 1"
    if config.get("ddp_no_sync_accumulation") and config.get("grad_accum_steps", 1) > 1:
        # DDP crashes on the first backward under no_sync with static_graph, and once past
        # that stops all-reducing (pytorch/pytorch#143580, the fix #187732 is not merged)
        return "cannot run with ddp_no_sync_accumulation and grad_accum_steps > 1 (a PyTorch bug, pytorch#143580)"
    return None


def _needs_glibc(config: dict, ctx: Context) -> str | None:
    """with glibc's malloc (Linux)"""
    return None if GLIBC else "needs glibc's malloc (Linux)"


def _recommended_precision(ctx: Context) -> str:
    if ctx.bf16_ok and (ctx.device != "cpu" or ctx.bf16_native):
        return "bf16"
    return "fp16" if ctx.device == "cuda" and ctx.fp16_ok else "fp32"


def _recommended_workers(ctx: Context) -> int:
    # Leave one core for the training process itself.
    return max(1, min(4, ctx.cpu_count - 1))


_TABLE = [
    Knob("precision", str, "autocast dtype of the forward pass; fp16 adds a GradScaler",
         "fp32", _recommended_precision, choices=PRECISIONS,
         cost="bf16/fp16 may change numerics; fp16 needs loss scaling", recompiles=True, priority=0),
    Knob("micro_batch_size", int, "samples per forward/backward pass",
         32, lambda ctx: 32, minimum=1, cost="memory grows with it", recompiles=True, loader=True, priority=2),
    Knob("grad_accum_steps", int, "micro-batches accumulated per optimizer step (loss / steps)",
         1, lambda ctx: 1, minimum=1, priority=14),
    Knob("num_workers", int, "DataLoader worker processes",
         0, _recommended_workers, minimum=0,
         cost="1 CPU and host memory per worker; the trial reserves 1 + num_workers CPUs", loader=True,
         priority=1),
    Knob("prefetch_factor", int, "batches loaded in advance per worker",
         None, lambda ctx: 2, minimum=1, nullable=True, inactive=_needs_workers,
         cost="host memory", loader=True, priority=9),
    Knob("persistent_workers", bool, "keep DataLoader workers alive across epochs",
         False, lambda ctx: True, inactive=_needs_workers,
         cost="workers hold their memory between epochs", loader=True, priority=6),
    Knob("pin_memory", bool, "page-locked host buffers for host-to-device copies",
         False, lambda ctx: True, gpu_only=True, cost="pinned host memory", loader=True, priority=10),
    Knob("non_blocking", bool, "asynchronous host-to-device copies",
         False, lambda ctx: True, gpu_only=True, priority=11),
    Knob("compile", str, "torch.compile mode",
         "off", lambda ctx: "default" if ctx.device == "cuda" else "off", choices=COMPILE_MODES,
         cost="one-time compile seconds, measured as compile_s", recompiles=True, priority=4),
    # The guides' advice for conv nets (oneDNN's and cuDNN's conv kernels are NHWC-native;
    # the recorded conv landscapes agree, docs/how-it-searches.md); a model with no 4-D
    # weights or inputs is left as it is, so the advice costs nothing there.
    Knob("channels_last", bool, "NHWC memory format for the model and 4-D inputs",
         False, lambda ctx: True, cost="helps conv nets, can slow others", recompiles=True, priority=7),
    Knob("cudnn_benchmark", bool, "cudnn autotuner for fixed input shapes",
         False, lambda ctx: True, gpu_only=True, cost="autotuning in the first steps", priority=12),
    Knob("tf32", bool, "TF32 matmuls and convolutions on Ampere and newer",
         False, lambda ctx: True, gpu_only=True, cost="lower matmul precision", priority=13),
    Knob("fused_optimizer", bool, "fused optimizer kernels (fused=True)",
         False, lambda ctx: True, priority=8),
    Knob("activation_checkpointing", bool, "recompute block activations in backward",
         False, lambda ctx: False, cost="about one extra forward pass of compute", recompiles=True, priority=15),
    Knob("torch_threads", int, "intra-op threads of the training process (null: PyTorch's default)",
         None, lambda ctx: None, minimum=1, nullable=True, priority=5),
    Knob("malloc_retain", bool,
         "host malloc keeps freed memory for the next step: glibc's mmap threshold 1 GiB and "
         "no trimming (fixed, where glibc moves them itself), so a step's buffers are "
         "reused, not returned to the kernel and faulted in again",
         False, lambda ctx: GLIBC, inactive=_needs_glibc,
         cost="freed buffers stay in the heap: peak host memory grows, most with large per-step buffers (logits)", priority=9),
    # Python's full garbage collections scan every object the collector tracks, and a
    # training process holds hundreds of thousands from before its loop (torch's own
    # modules, the model, the dataset); a batch collated from many small items promotes
    # enough objects to start one every few steps. gc.freeze() moves the objects alive
    # at the loop's start where no collection scans them (and, before the DataLoader
    # forks its workers, keeps the workers' collections off the pages they share).
    Knob("gc_freeze", bool, "the objects alive when the loop starts, and again after its first step, are moved "
         "out of the garbage collector's reach (gc.freeze()): its full collections scan only what the loop makes",
         False, lambda ctx: True, priority=9,
         cost="cycles among those objects that die later are never collected"),
    Knob("batch_grouping", str, "multi-source data: mixed batches, or each batch from one source",
         "mixed", lambda ctx: "by_source" if ctx.has_groups else "mixed", choices=GROUPINGS,
         inactive=_needs_groups, recompiles=True, loader=True, priority=3),
    # A collate pads a batch to its longest item: in a batch drawn at random from items of
    # lengths 20-300, about half of the step's work is padding. Batches of items of similar
    # length (drawn from a window of many batches, as the Hugging Face Trainer's
    # group_by_length does) pad little; the order of the batches stays random, in pairs
    # that cost about alike (tuner.loop.balanced).
    Knob("group_by_length", bool, "each batch from items of similar length (Workload.lengths): the items of "
         "50 batches drawn at random, sorted by length and cut into batches, which come in pairs of a long and a "
         "short one, the pairs in a random order",
         False, lambda ctx: ctx.has_lengths, inactive=_needs_lengths, recompiles=True, loader=True, priority=3,
         cost="batches are not drawn independently: each holds items of similar length"),
    # The input pipeline's own work (tuner/data.py): what an item costs to produce, paid
    # once rather than every epoch, where reading an item twice gives the same item.
    Knob("dataset_cache", bool, "items read once through __getitem__, then served from memory the DataLoader "
         "workers share (tuner.data.cached); refused where items differ between reads",
         False, lambda ctx: True, loader=True, priority=3,
         cost="host memory: one copy of the items; reading them all once, up front (cache_fill_s)"),
    Knob("augment_on", str, "where Workload.augment runs: host (the DataLoader's collate, in its workers) or "
         "device (after the batch is copied there)",
         "host", lambda ctx: "device" if ctx.device == "cuda" else "host", choices=AUGMENT_PLACES,
         inactive=_needs_augment, loader=True, priority=6,
         cost="device: the augmentation's kernels share the GPU with the step"),
    # Data parallel (DistributedDataParallel through Ray Train; see tuner/distributed.py).
    Knob("world_size", int, "data-parallel ranks per trial: one GPU each on GPUs, gloo processes on CPUs",
         1, lambda ctx: 1, minimum=1, recompiles=True,
         cost="a GPU (on GPUs) and 1 + num_workers CPUs per rank", priority=16),
    Knob("ddp_bucket_cap_mb", int, "DDP gradient bucket size in MB (PyTorch's default: 25)",
         25, lambda ctx: 25, minimum=1, inactive=_needs_ranks, recompiles=True, priority=17),
    Knob("ddp_gradient_as_bucket_view", bool, "gradients are views into DDP's buckets (no copy)",
         False, lambda ctx: True, inactive=_needs_ranks, priority=18),
    Knob("ddp_static_graph", bool, "DDP static_graph: the set of used parameters never changes",
         False, lambda ctx: False, inactive=_static_graph_allowed, recompiles=True, priority=19,
         cost="wrong if the model's used parameters change between steps"),
    Knob("ddp_comm_hook", str, "compress gradients for the all-reduce",
         "none", lambda ctx: "none", choices=COMM_HOOKS, inactive=_needs_ranks, priority=20,
         cost="lower gradient precision in the all-reduce"),
    Knob("ddp_no_sync_accumulation", bool,
         "all-reduce only on the last micro-batch of an accumulation step (DDP no_sync)",
         False, lambda ctx: True, inactive=_needs_ranks, priority=21),
]

KNOBS: dict[str, Knob] = {k.name: k for k in _TABLE}


def applies(knob: Knob) -> str:
    """When a knob applies, in words (docs and report)."""
    if knob.gpu_only:
        return "GPU only"
    return (knob.inactive.__doc__ or "conditionally").strip() if knob.inactive else "always"


def compile_group(config: dict) -> dict[str, Any]:
    """The knobs that decide what torch.compile traces: configs equal in these share a
    compile (and a warm inductor cache)."""
    return {k.name: config.get(k.name, k.default) for k in _TABLE if k.recompiles}


def defaults() -> dict[str, Any]:
    """PyTorch's defaults for every knob: the baseline config."""
    return {k.name: k.default for k in _TABLE}


def recommended(ctx: Context) -> dict[str, Any]:
    """The performance guides' recommended config on this hardware."""
    return {k.name: k.recommended(ctx) for k in _TABLE}


def unknown_knob(name: str) -> str:
    """The one-line message for a knob name that is not one: the close one, then all."""
    return f"unknown knob '{name}'{did_you_mean(name, KNOBS)}; known knobs: {', '.join(KNOBS)}"


def check_value(name: str, value: Any) -> Any:
    """Check one knob value against the table; return it coerced (``"true"`` -> True).

    Raises UserError naming the knob, the value and what is allowed.
    """
    knob = KNOBS.get(name)
    if knob is None:
        raise UserError(unknown_knob(name))
    if value is None or (isinstance(value, str) and value.lower() in ("null", "none")
                         and value not in (knob.choices or ())):  # ddp_comm_hook's "none" is a choice
        if knob.nullable:
            return None
        raise UserError(f"knob '{name}': null is not allowed")
    if knob.type is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "on", "off", "1", "0"):
            return value.lower() in ("true", "on", "1")
        raise UserError(f"knob '{name}': {value!r} is not a boolean (true/false)")
    if knob.type is int:
        if isinstance(value, bool):
            raise UserError(f"knob '{name}': {value!r} is not an integer")
        try:
            ivalue = int(value)
        except (TypeError, ValueError):
            raise UserError(f"knob '{name}': {value!r} is not an integer") from None
        if isinstance(value, float) and value != ivalue:
            raise UserError(f"knob '{name}': {value!r} is not an integer")
        if knob.minimum is not None and ivalue < knob.minimum:
            raise UserError(f"knob '{name}': {ivalue} is below the minimum {knob.minimum}")
        return ivalue
    if knob.type is str:
        if value is False and "off" in (knob.choices or ()):  # YAML reads `off` as False
            value = "off"
        if not isinstance(value, str) or value not in (knob.choices or ()):
            raise UserError(f"knob '{name}': {value!r} is not one of {', '.join(knob.choices or ())}")
        return value
    raise AssertionError(f"knob {name} has unsupported type {knob.type}")


def resolve(config: dict, ctx: Context, *, strict: bool | Collection[str]) -> tuple[dict, list[str]]:
    """Fill in defaults and hold inapplicable knobs at their default.

    ``strict`` (an explicit user setting, e.g. ``bench --set``: True for every knob, or
    the names the user set): a knob set to a non-default value where it cannot apply is an
    error. Otherwise (a search sampling a combination, or the advice around what the user
    set) it is normalized and a note says so, so that no config silently runs as
    something else.
    Returns the full config and the notes.
    """
    full = defaults()
    for name, value in config.items():
        full[name] = check_value(name, value)
    notes: list[str] = []
    for knob in _TABLE:
        value = full[knob.name]
        reason = None
        if knob.gpu_only and ctx.device != "cuda":
            reason = f"is a GPU knob and this run is on {ctx.device}"
        elif knob.inactive is not None:
            reason = knob.inactive(full, ctx)
        if reason is None or value == knob.default:
            continue
        if strict is True or (strict and knob.name in strict):
            raise UserError(f"knob '{knob.name}={value}' {reason}")
        notes.append(f"{knob.name}={value} ignored: {reason}")
        full[knob.name] = knob.default
    precision = full["precision"]
    if precision == "bf16" and not ctx.bf16_ok:
        raise UserError(f"knob 'precision=bf16' is not supported on this {ctx.device}")
    if precision == "fp16" and not ctx.fp16_ok:
        raise UserError(f"knob 'precision=fp16' is not supported on this {ctx.device}")
    if full["ddp_comm_hook"] == "bf16_compress" and ctx.device != "cuda":
        raise UserError("knob 'ddp_comm_hook=bf16_compress' needs NCCL on CUDA GPUs; "
                        "CPU ranks (gloo) take fp16_compress or none")
    return full, notes


def process_cpus(config: dict) -> int:
    """CPUs one training process reserves: itself and its DataLoader workers."""
    return 1 + int(config.get("num_workers", 0))


def loader_kwargs(config: dict, device_type: str) -> dict[str, Any]:
    """The DataLoader arguments that the knobs decide."""
    kwargs: dict[str, Any] = {"num_workers": config["num_workers"]}
    if config["num_workers"] > 0:
        kwargs["persistent_workers"] = config["persistent_workers"]
        if config["prefetch_factor"] is not None:
            kwargs["prefetch_factor"] = config["prefetch_factor"]
    if device_type == "cuda":
        kwargs["pin_memory"] = config["pin_memory"]
    return kwargs
