"""A Workload from a Lightning ``LightningModule`` and its data, in a few lines: the
module's own ``training_step`` is the loss, its ``configure_optimizers`` the optimizer.

    # lit_workload.py, named in the space file as `lit_workload.py:make`
    from tuner.lightning import lightning_workload

    def make():
        return lightning_workload(MyLitModel, datamodule=MyDataModule())

The tuner's loop does what ``lightning.Trainer`` would (DataLoader, device, precision,
accumulation, the optimizer step), with the knobs under search. It calls
``training_step`` and ``configure_optimizers``, the datamodule's ``prepare_data``,
``setup("fit")`` and ``train_dataloader`` (once, when the workload is made), and the
module's batch hooks where the module overrides them (``BATCH_HOOKS``: an EMA of the
weights in ``on_train_batch_end`` is part of the step's time), where Lightning calls
them. The hooks between backward and the optimizer's step (``STEP_HOOKS``) are not
called: the loop owns that part of the step, and a record says which ones the module
overrides. ``self.log``, callbacks and learning-rate schedulers are not called either (a
scheduler's step is a few scalar updates per step).

``training_step`` runs inside the module's ``forward`` of a small wrapper, so that
``torch.compile`` and DDP wrap it: called as ``compiled.training_step(...)`` it would
run the eager module, and under DDP it would skip DDP's forward (Lightning wraps its
module the same way for the same reason).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tuner.errors import UserError, WorkloadError
from tuner.workloads import Workload, copies_of

# Lightning calls these on the module at every batch: where the module overrides one, the
# loop calls it at the same point, so that its work is measured: on_train_batch_start
# before training_step; on_train_batch_end with what training_step returned (its loss
# detached) once the batch's backward has run, after the optimizer's step on the last
# micro-batch of an accumulation; on_before_zero_grad once per optimizer step.
BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_zero_grad")
# These run between backward and the optimizer's step, which the tuner's loop does itself
# (with the knobs under search): an override is not called, and the record says so.
STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "optimizer_step",
              "optimizer_zero_grad", "configure_gradient_clipping")
_LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


def lightning_workload(module: Any, *, datamodule: Any = None, dataset: Any = None,
                       collate: Callable[[list], Any] | None = None,
                       flops_per_sample: float | None = None, clip_grad_norm: float | None = None,
                       after_step: Callable[[Any, Any], None] | None = None,
                       lengths: Callable[[Any], Sequence[int]] | None = None) -> Workload:
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
        after_step: the rest of each optimizer step that a Lightning callback does (an EMA
            callback), as in ``tuner.Workload``; ``model`` is the ``TrainingStep`` (its
            ``module`` the LightningModule). The module's own batch hooks need none.
        lengths: each item's length, as in ``tuner.Workload`` (``group_by_length``).
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
    return Workload(model=steps.model, dataset=dataset, loss=steps.loss, collate=collate,
                    optimizer=steps.optimizer, flops_per_sample=flops_per_sample, clip_grad_norm=clip_grad_norm,
                    after_step=_AfterStep(steps, after_step), lengths=lengths)


def overrides(module: Any, hook: str) -> bool:
    """Whether ``module``'s class defines ``hook`` itself (or a class of its own between it
    and Lightning's), not Lightning's default that does nothing."""
    for cls in type(module).__mro__:
        if hook in vars(cls):
            return cls.__module__.split(".")[0] not in _LIGHTNING
    return False


class TrainingStep(torch.nn.Module):
    """``forward(batch)`` runs ``module.training_step(batch, 0)`` and returns what it
    returned (the loss, or a dict holding it). ``tuner_notes``: what a trial's record says
    of the module (the loop reads them)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.tuner_notes: list[str] = []

    def forward(self, batch: Any) -> Any:
        return self.module.training_step(batch, 0)

    def to(self, *args: Any, **kwargs: Any) -> TrainingStep:
        # LightningModule.to also records the module's device (self.device in training_step);
        # a plain Module.to on the wrapper would move the weights and leave that stale.
        self.module.to(*args, **kwargs)
        return self


def _loss_of(out: Any) -> torch.Tensor:
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise WorkloadError(f"lightning_workload: training_step returned {type(out).__name__}; the tuner "
                            f"needs the loss (a tensor, or a dict with 'loss') at every step")
    return loss


class _Steps:
    """Builds each trial's TrainingStep and, from the same module, its optimizer; its loss
    and the rest of its step call the module's batch hooks where Lightning does."""

    def __init__(self, factory: Callable[[], Any]):
        self.factory = factory
        self.last: Any = None
        self.hooks: frozenset[str] = frozenset()
        self.ended: list[tuple] = []  # (outputs, batch, batch_idx) awaiting on_train_batch_end
        self.batch_idx = 0

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The Workload's loss: the (maybe compiled or DDP-wrapped) TrainingStep called on
        the batch, between the module's batch hooks."""
        self.end_batches()  # an accumulation's earlier micro-batch: its backward has run
        if "on_train_batch_start" in self.hooks:
            self.last.on_train_batch_start(batch, self.batch_idx)
        out = model(batch)
        loss = _loss_of(out)
        if "on_train_batch_end" in self.hooks:
            # what Lightning hands the hook: training_step's outputs as a dict, the loss detached
            outputs = {**out, "loss": loss.detach()} if isinstance(out, Mapping) else {"loss": loss.detach()}
            self.ended.append((outputs, batch, self.batch_idx))
        self.batch_idx += 1
        return loss

    def end_batches(self) -> None:
        """``on_train_batch_end`` of the batches whose step has run."""
        if not self.ended:  # every micro-batch asks, hooks or not
            return
        ended, self.ended = self.ended, []
        for outputs, batch, idx in ended:
            self.last.on_train_batch_end(outputs, batch, idx)

    def end_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After each optimizer step: the module's hooks of that step."""
        if "on_before_zero_grad" in self.hooks:
            self.last.on_before_zero_grad(optimizer)
        self.end_batches()

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
        self.last, self.ended, self.batch_idx = module, [], 0
        self.hooks = frozenset(h for h in BATCH_HOOKS if overrides(module, h))
        step = TrainingStep(module)
        if self.hooks:
            step.tuner_notes.append(f"the module's {', '.join(sorted(self.hooks))} ran at each batch, as Lightning "
                                    f"calls it, and its time is in the figure")
        if skipped := [h for h in STEP_HOOKS if overrides(module, h)]:
            step.tuner_notes.append(f"the module overrides {', '.join(skipped)}: the tuner's loop does that part of "
                                    f"the step itself, so its work is not in the figure")
        return step

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


class _AfterStep:
    """The Workload's ``after_step``: the module's hooks of each optimizer step, then the
    user's own ``after_step``. ``users`` is that one alone: what a framework's export must
    carry (Lightning calls the module's hooks itself)."""

    def __init__(self, steps: _Steps, users: Callable[[Any, Any], None] | None):
        self.steps, self.users = steps, users

    def __call__(self, model: Any, optimizer: torch.optim.Optimizer) -> None:
        self.steps.end_step(optimizer)
        if self.users is not None:
            self.users(model, optimizer)


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
