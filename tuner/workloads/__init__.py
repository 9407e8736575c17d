"""The Workload interface: the user's model, data and loss, and how to load one.

A workload is what a function returns::

    # my_workload.py
    from tuner import Workload

    def make(seq_len: int = 128) -> Workload:
        return Workload(
            model=lambda: MyModel(),                      # built fresh in each trial
            dataset=lambda: MyDataset(seq_len),           # map-style or iterable
            loss=lambda model, batch: model(batch).loss,  # batch already on the device
        )

and space.yaml names it as ``my_workload.py:make`` (a file, relative to the
space file) or ``my_pkg.workloads:make`` (an importable module). The loop owns
the DataLoader, device moves, autocast, accumulation and the optimizer step.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuner.errors import UserError, WorkloadError, did_you_mean

if TYPE_CHECKING:
    import torch


@dataclass
class Workload:
    """A model, its data and its loss.

    Attributes:
        model: builds the model (a fresh one each call), or a model, which each call
            copies; the loop moves it to the device.
        dataset: builds the dataset (a function or a dataset class), or the dataset itself:
            map-style (``__getitem__`` + ``__len__``) or iterable.
        loss: ``loss(model, batch) -> scalar tensor``; ``batch`` is already on the device.
            As training code often returns more: a tuple or list (``loss, stats``, as a Hugging
            Face model's output) gives its first item, a mapping its ``"loss"`` (``the_loss``).
        collate: optional ``collate_fn`` for the DataLoader.
        optimizer: optional ``optimizer(params) -> Optimizer``; default AdamW(lr=1e-3).
            ``params`` iterates over the model's parameters and also stands for the model:
            ``model.parameters()`` and ``model.named_parameters()`` (weight decay by name) work.
        flops_per_sample: optional training FLOPs per sample (forward + backward), for MFU.
        groups: optional ``groups(dataset) -> list[list[int]]``: the indices of each
            source of a multi-source dataset. It enables the ``batch_grouping`` knob
            (``by_source`` batches samples of one source together).
        lengths: optional ``lengths(dataset) -> list[int]``: each item's length (its tokens,
            frames, points: what a collate pads to the batch's longest). It enables the
            ``group_by_length`` knob (batches of items of similar length, as the Hugging Face
            Trainer's ``group_by_length``): less of each batch is padding. A config that
            batches in a random order reads them too, after its timed windows, to weigh
            the batches its windows ran against a whole epoch's.
        epoch_size: optional samples per epoch, for iterable datasets without ``len``.
        augment: optional ``augment(batch) -> batch``: the random, per-batch part of the data
            (flips, crops, noise), kept apart from what ``dataset_cache`` may keep; the
            ``augment_on`` knob runs it on the host (in the DataLoader's collate) or on the
            device (after the batch is copied there), so it must work on both.
        clip_grad_norm: optional max norm: each optimizer step clips the gradients to it
            (``torch.nn.utils.clip_grad_norm_``, unscaled first under fp16), as the user's
            training does; measured with the step, and carried by the exports.
        after_step: optional ``after_step(model, optimizer)``: the rest of the user's
            optimizer step (an EMA of the weights, a scheduler's step), run after each one
            and measured with it; ``model`` is the module as built (not its DDP or compiled
            wrapper).
    """

    model: Callable[[], torch.nn.Module]
    dataset: Callable[[], Any]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    collate: Callable[[list], Any] | None = None
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    flops_per_sample: float | None = None
    groups: Callable[[Any], list[list[int]]] | None = None
    lengths: Callable[[Any], Sequence[int]] | None = None
    epoch_size: int | None = None
    augment: Callable[[Any], Any] | None = None
    clip_grad_norm: float | None = None
    after_step: Callable[[Any, Any], None] | None = None

    def __post_init__(self) -> None:
        if self.clip_grad_norm is not None and not (isinstance(self.clip_grad_norm, int | float)
                                                    and not isinstance(self.clip_grad_norm, bool)
                                                    and self.clip_grad_norm > 0):
            raise UserError(f"Workload(clip_grad_norm={self.clip_grad_norm!r}): a max norm above 0, or None")
        # an instance where a builder is asked for (``model=MyModel()``, ``dataset=MyData()``,
        # as a training script holds them) is built by copying it, or stands for itself
        nn = getattr(sys.modules.get("torch"), "nn", None)  # a loss module is torch's: imported if given
        if nn is not None and isinstance(self.loss, nn.Module):
            name = type(self.loss).__name__
            raise UserError(f"Workload(loss={name}()): loss is called as loss(model, batch), where {name} takes the "
                            f"model's output and the targets; for (inputs, targets) batches: "
                            f"loss=lambda model, batch: {name}()(model(batch[0]), batch[1])")
        self.model = copies_of(self.model) or self.model
        self.dataset = dataset_factory(self.dataset)
        if not getattr(self.loss, "the_loss", False):
            self.loss = _scalar(self.loss)

    def make_optimizer(self, model: Any) -> torch.optim.Optimizer:
        """The workload's optimizer over ``model`` (a module, or its parameters)."""
        import torch

        params = ModelParameters(model) if isinstance(model, torch.nn.Module) else model
        if self.optimizer is None:
            return torch.optim.AdamW(params, lr=1e-3)
        return self.optimizer(params)


def workload_facts(workload: Workload | None) -> dict[str, bool]:
    """What the knobs that apply to some workloads only ask of one (``knobs.Context``'s
    ``has_*``): several sources, a per-batch augment, its items' lengths."""
    if workload is None:
        return {}
    return {"has_groups": workload.groups is not None, "has_augment": workload.augment is not None,
            "has_lengths": workload.lengths is not None}


def users_after_step(workload: Workload) -> Callable[[Any, Any], None] | None:
    """The user's own ``after_step``: a framework adapter's (``lightning_workload``'s) also
    calls the hooks its framework calls itself, which an export to that framework need not
    carry; it names the user's part ``users``."""
    return getattr(workload.after_step, "users", workload.after_step)


class ModelParameters:
    """What ``Workload.optimizer`` is called with: the model's parameters, iterated as
    ``AdamW(params)`` takes them, and the model itself to a factory written against it
    (``model.parameters()``, ``model.named_parameters()`` for weight decay by name, its
    modules)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model

    def __iter__(self) -> Any:
        return iter(self._model.parameters())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _scalar(loss: Callable[[Any, Any], Any]) -> Callable[[Any, Any], torch.Tensor]:
    """``loss`` returning the tensor to call ``backward()`` on (``the_loss``)."""
    def scalar_loss(model: Any, batch: Any) -> torch.Tensor:
        return the_loss(loss(model, batch))

    scalar_loss.the_loss = True  # type: ignore[attr-defined]
    scalar_loss.__wrapped__ = loss  # type: ignore[attr-defined]
    return scalar_loss


def the_loss(out: Any) -> torch.Tensor:
    """The loss in what a workload's ``loss`` returned: the tensor itself, a tuple's or a
    list's first item, a mapping's ``"loss"``; one value (a tensor of per-sample losses has
    no gradient to start from). Anything else is a ``WorkloadError`` that says what came
    back. Host metadata only: no device sync."""
    import torch

    got = out
    if isinstance(out, tuple | list) and out:
        got = out[0]
    elif isinstance(out, Mapping):  # a dict, a Hugging Face ModelOutput or BatchEncoding
        got = out["loss"] if "loss" in out else None
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        return got
    if isinstance(got, torch.Tensor):
        raise WorkloadError(f"workload loss returned a tensor of shape {tuple(got.shape)}: reduce it to one "
                            f"value (.mean() or .sum())")
    if got is None and out is not None and not isinstance(out, tuple | list):
        raise WorkloadError(f"workload loss returned a mapping without a 'loss' key (keys: "
                            f"{', '.join(map(str, list(out.keys())[:6]))}): return the loss tensor")
    what = f"a {type(got).__name__}"
    if isinstance(out, tuple | list) and out:
        what = f"a {type(out).__name__} whose first item is {what}"
    raise WorkloadError(f"workload loss returned {what}: return the loss tensor (or a tuple with it first, "
                        f"or a dict with it under 'loss')")


def copies_of(model: Any) -> Callable[[], Any] | None:
    """A function that returns a fresh copy of ``model`` (a ``torch.nn.Module``: each trial
    trains its own), the function itself when ``model`` is one, None otherwise."""
    torch = sys.modules.get("torch")  # a module instance means torch is imported; never import it here
    if torch is not None and isinstance(model, torch.nn.Module):
        import copy

        template = model
        return lambda: copy.deepcopy(template)
    return model if callable(model) else None


def dataset_factory(dataset: Any) -> Callable[[], Any]:
    """``dataset`` (map-style or iterable) or a function or class that returns one, as a
    function (a dataset class has ``__getitem__`` or ``__iter__`` too: it is the builder)."""
    if isinstance(dataset, type) or (callable(dataset) and not hasattr(dataset, "__getitem__")
                                     and not hasattr(dataset, "__iter__")):
        return dataset
    return lambda: dataset


BUILTIN = {
    "conv": "tuner.workloads.builtin:conv",
    "transformer": "tuner.workloads.builtin:transformer",
    "multisource": "tuner.workloads.builtin:multisource",
    "files": "tuner.workloads.builtin:files",
}


def _import_file(path: Path) -> Any:
    # A stable module name per file, registered in sys.modules so that pickling
    # (spawned DataLoader workers, Ray) can find classes defined in the file.
    name = "tuner_user_" + path.stem + "_" + hashlib.sha1(str(path).encode()).hexdigest()[:8]
    if name in sys.modules:
        return sys.modules[name]
    # The file imports its sibling modules as it would run as a script: its folder on the path.
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"workload: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise WorkloadError(f"workload file {path} raised on import: {type(exc).__name__}: {exc}"
                            f"{extra_hint(exc)}") from exc
    return module


# The packages an extra of tuner installs, for a workload that imports one of them.
EXTRAS = {"transformers": "hf", "accelerate": "hf", "lightning": "lightning", "pytorch_lightning": "lightning"}


def extra_hint(exc: BaseException) -> str:
    """``; install it with ...`` where a missing module is one an extra of tuner installs."""
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in EXTRAS:
            return f" (install it with: pip install -e \".[{EXTRAS[exc.name.split('.')[0]]}]\")"
        exc = exc.__cause__ or exc.__context__
    return ""


def field_hint(exc: BaseException) -> str:
    """`` (did you mean 'collate'? ...)`` where ``Workload`` was given a field it does not
    have: the DataLoader's and other libraries' names for them (``collate_fn``, ``loss_fn``,
    ``train_dataset``) are the likely slips."""
    import dataclasses
    import re

    found = re.search(r"Workload\.__init__\(\) got an unexpected keyword argument '(\w+)'", str(exc))
    if not isinstance(exc, TypeError) or found is None:
        return ""
    names = [f.name for f in dataclasses.fields(Workload)]
    return f"{did_you_mean(found[1], names)} (Workload's fields: {', '.join(names)})"


def resolve_factory(ref: str, base_dir: Path | None = None) -> Callable[..., Workload]:
    """Find the workload function named by ``ref``.

    ``ref`` is a built-in name (``conv``), ``path/to/file.py:function`` (relative
    to ``base_dir``) or ``package.module:function``.
    """
    ref = BUILTIN.get(ref, ref)
    if ":" not in ref:
        raise UserError(f"workload '{ref}': expected 'file.py:function', 'module:function' "
                        f"or a built-in ({', '.join(BUILTIN)})")
    target, func_name = ref.rsplit(":", 1)
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        path = path.resolve()
        if not path.is_file():
            raise UserError(f"workload '{ref}': file {path} not found")
        module = _import_file(path)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise UserError(f"workload '{ref}': module '{target}' not found ({exc})") from None
        except Exception as exc:
            raise WorkloadError(f"workload module '{target}' raised on import: "
                                f"{type(exc).__name__}: {exc}") from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise UserError(f"workload '{ref}': no function '{func_name}' in {target}")
    return func


def check_args(ref: str, func: Callable, args: dict) -> None:
    """Check ``workload_args`` against the function's signature, and against its type
    annotations where it has simple ones (int, float, str, bool, list, dict, X | None),
    before anything runs."""
    signature = inspect.signature(func)
    try:
        signature.bind(**args)
    except TypeError as exc:
        takes = [n for n, p in signature.parameters.items()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = next((a for a in args if a not in takes), None)
        hint = (f"{did_you_mean(unknown, takes)} (it takes: {', '.join(takes) or 'no arguments'})"
                if unknown is not None and not any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
                else "")
        raise UserError(f"workload_args for '{ref}': {exc}{hint}") from None
    try:
        import typing

        hints = typing.get_type_hints(func)
    except Exception:  # annotations that do not resolve: nothing to check against
        return
    for name, value in args.items():
        allowed = _simple_types(hints.get(name))
        if allowed is None:
            continue
        ok = any(_is_instance(value, t) for t in allowed)
        if not ok:
            names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise UserError(f"workload_args.{name}: {value!r} is not {names} (the signature of '{ref}')")


def _simple_types(hint: Any) -> tuple | None:
    """The plain types a hint allows, or None when it is not a simple one."""
    import types
    import typing

    simple = (int, float, str, bool, list, dict, type(None))
    if hint in simple:
        return (hint,)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [typing.get_origin(a) or a for a in typing.get_args(hint)]
        return tuple(parts) if all(p in simple for p in parts) else None
    if origin in (list, dict):
        return (origin,)
    return None


def _is_instance(value: Any, t: type) -> bool:
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, t)


def load_workload(ref: str, args: dict | None = None, base_dir: Path | None = None) -> Workload:
    """Call the workload function and check that it returned a Workload."""
    args = args or {}
    func = resolve_factory(ref, base_dir)
    check_args(ref, func, args)
    try:
        workload = func(**args)
    except UserError as exc:  # the Workload's own check: its message says what to write
        raise UserError(f"workload '{ref}': {exc}") from exc
    except Exception as exc:
        raise WorkloadError(f"workload '{ref}' raised: {type(exc).__name__}: {exc}{extra_hint(exc)}"
                            f"{field_hint(exc)}") from exc
    if not isinstance(workload, Workload):
        raise UserError(f"workload '{ref}' returned {type(workload).__name__}, not tuner.Workload: return "
                        "Workload(model=..., dataset=..., loss=...) (from tuner import Workload; the README's "
                        "'Your workload')")
    return workload
