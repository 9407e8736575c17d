"""A Workload from a Lightning ``LightningModule`` and its data, in a few lines: the
module's own ``training_step`` is the loss, its ``configure_optimizers`` the optimizer.

    # lit_workload.py, named in the space file as `lit_workload.py:make`
    from tuner.lightning import lightning_workload

    def make():
        return lightning_workload(MyLitModel, datamodule=MyDataModule())

The tuner's loop does what ``lightning.Trainer`` would (DataLoader, device, precision,
accumulation, the optimizer step), with the knobs under search. Only ``training_step``
and ``configure_optimizers`` are called, and the datamodule's ``prepare_data``,
``setup("fit")`` and ``train_dataloader`` (once, when the workload is made); other hooks, ``self.log`` and learning-rate
schedulers are not (a scheduler's step is a few scalar updates per step).

``training_step`` runs inside the module's ``forward`` of a small wrapper, so that
``torch.compile`` and DDP wrap it: called as ``compiled.training_step(...)`` it would
run the eager module, and under DDP it would skip DDP's forward (Lightning wraps its
module the same way for the same reason).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tuner.errors import UserError, WorkloadError
from tuner.workloads import Workload, copies_of


def lightning_workload(module: Any, *, datamodule: Any = None, dataset: Any = None,
                       collate: Callable[[list], Any] | None = None,
                       flops_per_sample: float | None = None, clip_grad_norm: float | None = None) -> Workload:
    """A Workload that trains a LightningModule with its own ``training_step``.

    Args:
        module: a ``LightningModule`` (each trial trains a fresh copy of it), its class,
            or a function that returns a new one.
        datamodule: a ``LightningDataModule`` (or a function returning one): the
            dataset and ``collate_fn`` of its ``train_dataloader()`` are used; the
            DataLoader's own settings (batch size, workers...) are what the tuner searches.
        dataset: instead of a datamodule, a map-style or iterable dataset (or a function
            returning one) whose batches ``training_step`` takes.
        collate, flops_per_sample: as in ``tuner.Workload``.
        clip_grad_norm: the ``Trainer(gradient_clip_val=...)`` the module trains with, as in
            ``tuner.Workload``.
    """
    if (datamodule is None) == (dataset is None):
        raise UserError("lightning_workload: give a datamodule or a dataset (one of the two)")
    if datamodule is not None:
        dataset, own_collate = _from_datamodule(datamodule)
        collate = collate or own_collate
    factory = copies_of(module)
    if factory is None:
        raise UserError(f"lightning_workload: module is a LightningModule, its class or a function that "
                        f"returns one; got {type(module).__name__}")
    steps = _Steps(factory)
    return Workload(model=steps.model, dataset=dataset, loss=step_loss, collate=collate,
                    optimizer=steps.optimizer, flops_per_sample=flops_per_sample, clip_grad_norm=clip_grad_norm)


class TrainingStep(torch.nn.Module):
    """``forward(batch)`` runs ``module.training_step(batch, 0)`` and returns its loss."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, batch: Any) -> torch.Tensor:
        out = self.module.training_step(batch, 0)
        if isinstance(out, Mapping):
            out = out.get("loss")
        if not isinstance(out, torch.Tensor):
            raise WorkloadError(f"lightning_workload: training_step returned {type(out).__name__}; the tuner "
                                f"needs the loss (a tensor, or a dict with 'loss') at every step")
        return out

    def to(self, *args: Any, **kwargs: Any) -> TrainingStep:
        # LightningModule.to also records the module's device (self.device in training_step);
        # a plain Module.to on the wrapper would move the weights and leave that stale.
        self.module.to(*args, **kwargs)
        return self


def step_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The Workload's loss: the (maybe compiled or DDP-wrapped) TrainingStep called on the batch."""
    return model(batch)


class _Steps:
    """Builds each trial's TrainingStep and, from the same module, its optimizer."""

    def __init__(self, factory: Callable[[], Any]):
        self.factory = factory
        self.last: Any = None

    def model(self) -> TrainingStep:
        module = self.factory()
        if not callable(getattr(module, "training_step", None)):
            raise UserError(f"lightning_workload: {type(module).__name__} has no training_step")
        if getattr(module, "automatic_optimization", True) is False:
            raise UserError(f"lightning_workload: {type(module).__name__} uses manual optimization "
                            f"(automatic_optimization=False): its training_step steps its own optimizers, "
                            f"which the tuner's loop must own")
        # self.log without a Trainer warns and does nothing, which is what the loop wants.
        warnings.filterwarnings("ignore", message=r".*self\.log\(\).*")
        self.last = module
        return TrainingStep(module)

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        params = list(params)
        module = self.last
        if module is None or not callable(getattr(module, "configure_optimizers", None)):
            return torch.optim.AdamW(params, lr=1e-3)
        opt = _first_optimizer(module.configure_optimizers(), type(module).__name__)
        if {id(p) for g in opt.param_groups for p in g["params"]} <= {id(p) for p in params}:
            return opt
        # configure_optimizers built it over other tensors than the loop trains: same class
        # and hyperparameters over the loop's parameters.
        return type(opt)(params, **opt.defaults)


def _first_optimizer(conf: Any, name: str) -> torch.optim.Optimizer:
    # The shapes configure_optimizers may return: an optimizer; a list or tuple of them;
    # (optimizers, schedulers); a dict with "optimizer"; a list of such dicts.
    found: list[torch.optim.Optimizer] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.optim.Optimizer):
            found.append(x)
        elif isinstance(x, Mapping):
            walk(x.get("optimizer"))
        elif isinstance(x, (list, tuple)):
            for item in x:
                walk(item)

    walk(conf)
    if not found:
        raise UserError(f"lightning_workload: {name}.configure_optimizers returned no optimizer")
    if len(found) > 1:
        raise UserError(f"lightning_workload: {name}.configure_optimizers returned {len(found)} optimizers; "
                        f"the tuner's loop steps one")
    return found[0]


def _from_datamodule(datamodule: Any) -> tuple[Any, Callable[[list], Any] | None]:
    """The dataset and collate_fn of a datamodule's train_dataloader() (None for PyTorch's own)."""
    dm = datamodule() if callable(datamodule) and not hasattr(datamodule, "train_dataloader") else datamodule
    if not callable(getattr(dm, "train_dataloader", None)):
        raise UserError(f"lightning_workload: datamodule {type(dm).__name__} has no train_dataloader")
    for hook, args in (("prepare_data", ()), ("setup", ("fit",))):
        if callable(getattr(dm, hook, None)):
            getattr(dm, hook)(*args)
    loader = dm.train_dataloader()
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise UserError(f"lightning_workload: {type(dm).__name__}.train_dataloader returned "
                        f"{type(loader).__name__}, not one DataLoader")
    collate = loader.collate_fn
    return loader.dataset, None if collate is torch.utils.data.default_collate else collate
