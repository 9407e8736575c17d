"""The knobs applied to a training process: one small function per knob, called by
``tuner.loop.Trainer`` (which owns the order in which they are applied). Apart from
``tuner.knobs`` (the table) so that reading a space or a results folder never imports
torch."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

from tuner.errors import KnobRefused, UserError
from tuner.knobs import MALLOC_RETAIN_ENV, Context

# the same thresholds as mallopt parameters, for a process already running (-1: no trim)
_MALLOPT = ((-3, int(MALLOC_RETAIN_ENV["MALLOC_MMAP_THRESHOLD_"])), (-1, -1))  # <malloc.h>: M_MMAP_THRESHOLD, M_TRIM_THRESHOLD


def context_for(device: torch.device, workload: Any = None) -> Context:
    """The Context of this process's hardware, for ``workload`` (a ``Workload``: the knobs
    that apply to some workloads only)."""
    from tuner.hardware import cpu_has_bf16, usable_cores
    from tuner.workloads import workload_facts

    bf16_ok = True
    if device.type == "cuda":
        bf16_ok = torch.cuda.is_bf16_supported()
    return Context(device=device.type, cpu_count=usable_cores(), **workload_facts(workload), bf16_ok=bf16_ok,
                   fp16_ok=True,
                   bf16_native=device.type != "cpu" or cpu_has_bf16())


def apply_dataset_cache(dataset: Any, workers: int) -> Any:
    """``dataset_cache``: the items read once by ``workers`` processes (as an epoch reads
    them) into shared memory (``tuner.data.cached``); refused (``CacheRefused``, a bad
    config) where items differ between reads, the dataset is iterable, or the cache would
    not fit in the host memory free now."""
    from tuner.data import cached

    return cached(dataset, workers=workers, max_bytes=cache_room())


def cache_room() -> int:
    """The bytes a dataset cache may hold: most of the host memory free now (the step's
    own tensors and the workers need the rest), within its cgroup's limit."""
    from tuner.hardware import available_memory

    return int(available_memory() * 0.8)


def apply_threads(threads: int | None) -> None:
    """Intra-op threads of this process (None: leave PyTorch's default)."""
    if threads is not None:
        torch.set_num_threads(threads)


def apply_malloc_retain(enabled: bool) -> None:
    """glibc's fixed thresholds (``MALLOC_RETAIN_ENV``) in this process, and in the
    environment of the processes it starts (off: leave the allocator alone). For good:
    glibc has no way back to its moving thresholds, so only a process of its own (a
    trial's) should call this with True."""
    if not enabled:
        return
    libc = ctypes.CDLL(None)
    if not all(libc.mallopt(param, value) for param, value in _MALLOPT):
        raise KnobRefused("knob 'malloc_retain': glibc's mallopt refused the thresholds", "malloc_retain", values=[True])
    os.environ.update(MALLOC_RETAIN_ENV)


def apply_gc_freeze(enabled: bool) -> None:
    """Collect once, then freeze every object alive now out of the collector's reach (off:
    leave the collector alone). Called where the loop starts, before the DataLoader forks
    its workers (they inherit the frozen generation), and again after the first step,
    whose objects (torch.compile's graphs, the optimizer's state) would otherwise be
    scanned by every full collection after it."""
    if enabled:
        gc.collect()
        gc.freeze()


def release_gc_freeze() -> None:
    """Put the frozen objects back in the collector's reach, for a process that goes on
    after the trial: a data-parallel rank's (a Ray worker), or a caller's own. A trial's
    own process ends with it. With nothing frozen it does nothing."""
    gc.unfreeze()


def apply_backend_flags(device: torch.device, cudnn_benchmark: bool, tf32: bool) -> None:
    """cudnn autotuner and TF32; these are process-wide, so always set both ways."""
    if device.type != "cuda":
        return
    torch.backends.cudnn.benchmark = cudnn_benchmark
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def reassert_process_knobs(config: dict, device: torch.device) -> list[str]:
    """Set again the process-wide knobs that the workload's own building code changed (a
    ``torch.set_num_threads`` or a ``cudnn.benchmark`` left in from a script): the trial
    would otherwise measure the user's values under the knobs' names. One note per knob
    set again, for the record."""
    notes = []
    threads = config["torch_threads"]
    if threads is not None and (found := torch.get_num_threads()) != threads:
        apply_threads(threads)
        notes.append(f"the workload's own code set torch.set_num_threads({found}) while building its model, "
                     f"optimizer or dataset; the knob's {threads} were set again after it")
    if device.type == "cuda":
        flags = {"cudnn_benchmark": ("torch.backends.cudnn.benchmark", torch.backends.cudnn.benchmark),
                 "tf32": ("torch.backends.cuda.matmul.allow_tf32", torch.backends.cuda.matmul.allow_tf32)}
        changed = [(knob, name, found) for knob, (name, found) in flags.items() if found != config[knob]]
        apply_backend_flags(device, config["cudnn_benchmark"], config["tf32"])  # all of them, as at the start
        notes += [f"the workload's own code set {name} = {found} while building; the knob's {config[knob]} "
                  f"was set again after it" for knob, name, found in changed]
    return [f"{n} (remove that line to run the exported config as measured)" for n in notes]


def process_settings_notes(device: torch.device) -> list[str]:
    """Process-wide settings that no knob covers and that slow training, as a seeding
    helper or a script leaves them (deterministic kernels, a float64 default dtype): the
    trial keeps them, since the user's training runs with them, and its record says so."""
    notes = []
    if torch.are_deterministic_algorithms_enabled():
        notes.append("deterministic algorithms are on (torch.use_deterministic_algorithms(True)): ops without a "
                     "deterministic kernel raise, and on a GPU the deterministic ones can be slower; the figures "
                     "are those of a deterministic training")
    if device.type == "cuda" and torch.backends.cudnn.deterministic:
        notes.append("torch.backends.cudnn.deterministic is True: cudnn uses deterministic convolution kernels "
                     "only, often slower ones; the figures are those of that training")
    if torch.get_default_dtype() != torch.float32:
        notes.append(f"the default dtype is {str(torch.get_default_dtype()).removeprefix('torch.')} "
                     f"(torch.set_default_dtype): a model built without a dtype trains in it, and precision's "
                     f"autocast casts only the ops it covers")
    return notes


def half_parameters(model: torch.nn.Module) -> str | None:
    """``bfloat16`` or ``float16`` where every floating parameter of the model as built is
    16-bit (a model loaded with ``torch_dtype=torch.bfloat16``, or ``.half()``): the
    precision knob's autocast then runs the same 16-bit ops; else None."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) == 1 and (d := next(iter(dtypes))) in (torch.bfloat16, torch.float16):
        return str(d).removeprefix("torch.")
    return None


def apply_channels_last(model: torch.nn.Module, enabled: bool) -> torch.nn.Module:
    """NHWC weights; the loop converts 4-D inputs to match."""
    return model.to(memory_format=torch.channels_last) if enabled else model


class _Checkpointed(torch.nn.Module):
    """Runs the wrapped block under activation checkpointing."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # use_reentrant=False: works with kwargs, compile and inputs that need no grad.
        return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: torch.nn.Module, enabled: bool) -> int:
    """Wrap the model's repeated blocks (entries of every ModuleList; else the
    children of a top-level Sequential) in activation checkpointing.

    Returns how many blocks were wrapped; 0 means the model has no blocks to wrap.
    """
    if not enabled:
        return 0
    wrapped = 0
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for i, block in enumerate(module):
                if not isinstance(block, _Checkpointed):
                    module[i] = _Checkpointed(block)
                    wrapped += 1
    if wrapped == 0 and isinstance(model, torch.nn.Sequential):
        for i, block in enumerate(model):
            if any(True for _ in block.parameters()):
                model[i] = _Checkpointed(block)
                wrapped += 1
    return wrapped


def fused_optimizer_of(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None) -> str | None:
    """Why ``fused_optimizer`` cannot apply to ``optimizer`` on its parameters' device
    (``init`` leaves the knob out then), or None: it can. The fused step is built as the
    knob builds it, so a class or device without a fused kernel, or a ``model`` with sparse
    gradients, says so here, not in a trial."""
    try:
        apply_fused_optimizer(optimizer, True, model)
    except (UserError, RuntimeError, ValueError, TypeError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return text.removeprefix("knob 'fused_optimizer': ")
    return None


def sparse_gradient_modules(model: torch.nn.Module) -> list[str]:
    """The model's embeddings that give sparse gradients (``sparse=True``): no fused
    optimizer step takes them."""
    return [name or type(m).__name__ for name, m in model.named_modules()
            if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag) and m.sparse]


def apply_fused_optimizer(optimizer: torch.optim.Optimizer, fused: bool,
                          model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
    """Rebuild the user's optimizer with ``fused=True``, same class and hyperparameters.
    ``model``: where it has sparse gradients, refused before a step fails on them."""
    if not fused:
        return optimizer
    cls = type(optimizer)
    if "fused" not in optimizer.defaults:
        raise KnobRefused(f"knob 'fused_optimizer': {cls.__name__} has no fused implementation", "fused_optimizer",
                          values=[True])
    sparse = sparse_gradient_modules(model) if model is not None else []
    if sparse:
        raise KnobRefused(f"knob 'fused_optimizer': the model's {', '.join(sparse[:3])}{', ...' if len(sparse) > 3 else ''} "
                          f"give sparse gradients (Embedding(sparse=True)), which no fused optimizer step takes",
                          "fused_optimizer", values=[True])
    groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")}
              for g in optimizer.param_groups]
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items()
              if k in accepted and k not in ("fused", "foreach", "params")}
    return cls(groups, **kwargs, fused=True)


def compile_disabled() -> bool:
    """Whether torch.compile hands back the eager model in this process (its two switches,
    read as torch.compile reads them)."""
    import torch._dynamo

    return bool(torch._dynamo.config.disable) or os.environ.get("TORCHDYNAMO_DISABLE", "") == "1"


def uncompiled(model: torch.nn.Module) -> tuple[torch.nn.Module, str | None]:
    """The workload's model as built, without the ``torch.compile`` its factory may have
    applied (``torch.compile(model)``, a compiled submodule, ``model.compile()``), and a
    note saying so: the ``compile`` knob decides, and compiling twice would trace the
    compiled wrapper again."""
    import sys

    if "torch._dynamo" not in sys.modules:  # nothing was compiled in this process
        return model, None
    from torch._dynamo.eval_frame import OptimizedModule

    found = []
    if isinstance(model, OptimizedModule):
        model, found = model._orig_mod, ["the model"]
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, OptimizedModule):
                setattr(module, child_name, child._orig_mod)
                found.append(f"{name}.{child_name}" if name else child_name)
        if getattr(module, "_compiled_call_impl", None) is not None:  # nn.Module.compile()
            module._compiled_call_impl = None
            found.append(name or "the model")
    if not found:
        return model, None
    what = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
    return model, (f"the workload's building code applies torch.compile to {what}: the trial runs the module "
                   f"uncompiled, and the compile knob decides whether it is compiled")


def apply_compile(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """torch.compile; applied last, after checkpointing and memory format."""
    if mode == "off":
        return model
    if compile_disabled():  # torch.compile would hand back the eager model, measured under compile's name
        raise KnobRefused(f"knob 'compile={mode}': torch.compile is disabled in this process "
                          f"(TORCHDYNAMO_DISABLE=1 or TORCH_COMPILE_DISABLE=1 in the environment, or "
                          f"torch._dynamo.config.disable)", "compile", values=[mode])
    return torch.compile(model, mode=None if mode == "default" else mode)


def autocast_context(device: torch.device, precision: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the forward pass's autocast context."""
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling; bf16 and fp32 do not."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def apply_ddp(model: torch.nn.Module, config: dict, device: torch.device,
              find_unused_parameters: bool) -> torch.nn.Module:
    """Wrap the model in DistributedDataParallel with the ddp_* knobs (the process
    group is already up: Ray Train starts it). Compile wraps the DDP module after this,
    as PyTorch's docs ask, so that the compiled graphs split at bucket boundaries."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" and device.index is not None else None,
              bucket_cap_mb=config["ddp_bucket_cap_mb"],
              gradient_as_bucket_view=config["ddp_gradient_as_bucket_view"],
              static_graph=config["ddp_static_graph"],
              find_unused_parameters=find_unused_parameters)
    hook = config["ddp_comm_hook"]
    if hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, getattr(default_hooks, f"{hook}_hook"))
    return ddp


def has_conv2d(model: torch.nn.Module) -> bool:
    """Whether the model has Conv2d layers: where channels_last can matter."""
    return any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
