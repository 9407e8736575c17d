"""A Workload from a Hugging Face ``transformers`` model and a dataset of dicts, in a few
lines: the model's own loss, batches passed to the model as keyword arguments.

    # my_workload.py, named in the space file as `my_workload.py:make`
    from transformers import GPT2Config
    from tuner.hf import hf_workload

    def make():
        return hf_workload(GPT2Config(n_layer=4), dataset=my_token_dataset(),
                           labels_from="input_ids")

``transformers`` is imported only when a model is built from a config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tuner.errors import UserError, WorkloadError
from tuner.workloads import Workload, copies_of


def hf_workload(model: Any, dataset: Any, *, model_class: Any = None, labels_from: str | None = None,
                collate: Callable[[list], Any] | None = None,
                optimizer: Callable[[Any], Any] | None = None,
                flops_per_sample: float | None = None, clip_grad_norm: float | None = None,
                after_step: Callable[[Any, Any], None] | None = None,
                lengths: Callable[[Any], Sequence[int]] | str | None = None) -> Workload:
    """A Workload whose loss is the model's own (``model(**batch).loss``).

    Args:
        model: a ``transformers.PretrainedConfig`` (the model is built from it, no
            download: ``model_class.from_config``-style, by default the causal-LM head
            for the config's architecture), a ``torch.nn.Module`` (each trial trains a
            fresh copy of it), or a function that returns a new model.
        dataset: a map-style dataset of dicts of tensors (a list of dicts, a
            ``datasets.Dataset`` with ``set_format("torch")``, your own ``Dataset``), or a
            function that returns one.
        model_class: the class to build from a config (``GPT2LMHeadModel``,
            ``AutoModelForSequenceClassification``...): anything with ``from_config`` or a
            constructor taking the config.
        labels_from: the batch key passed as ``labels`` where the batch has none
            (``"input_ids"`` for a causal LM: the model shifts them itself).
        collate, optimizer, flops_per_sample, clip_grad_norm, after_step: as in
            ``tuner.Workload`` (a ``DataCollatorWithPadding`` for token lists of unequal
            length; ``clip_grad_norm=1.0`` measures the clipping the Trainer does by default).
        lengths: each item's length, as in ``tuner.Workload`` (``group_by_length``), or the
            name of the item's key to take it from (``"input_ids"``, as the Trainer's own
            length-grouped sampler: every item is read once for it).
    """
    return Workload(model=_model_factory(model, model_class), dataset=dataset,
                    loss=ModelLoss(labels_from), collate=collate, optimizer=optimizer,
                    flops_per_sample=flops_per_sample, clip_grad_norm=clip_grad_norm, after_step=after_step,
                    lengths=KeyLengths(lengths) if isinstance(lengths, str) else lengths)


class KeyLengths:
    """``lengths(dataset)``: the length of each item's ``key`` (a ``datasets.Dataset`` is
    read by column, where the Trainer's own sampler would read its ``length`` column)."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, dataset: Any) -> list[int]:
        names = getattr(dataset, "column_names", None)
        if names is not None and self.key in names:
            return [len(x) for x in dataset[self.key]]
        return [len(dataset[i][self.key]) for i in range(len(dataset))]


class ModelLoss:
    """``loss(model, batch)``: the model's output ``loss`` for a dict batch."""

    def __init__(self, labels_from: str | None = None):
        self.labels_from = labels_from

    def __call__(self, model: Any, batch: Any) -> Any:
        if not isinstance(batch, Mapping):
            raise WorkloadError(f"hf_workload: a batch is a dict of tensors (model(**batch)); got "
                                f"{type(batch).__name__}: the dataset's items should be dicts")
        kwargs = dict(batch)
        if self.labels_from is not None and "labels" not in kwargs:
            if self.labels_from not in kwargs:
                raise WorkloadError(f"hf_workload: labels_from={self.labels_from!r}, but the batch has only "
                                    f"{', '.join(map(str, kwargs))}")
            kwargs["labels"] = kwargs[self.labels_from]
        out = model(**kwargs)
        loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        if loss is None:
            raise WorkloadError("hf_workload: the model returned no loss: give the dataset's items a 'labels' "
                                "key, or set labels_from (\"input_ids\" for a causal LM)")
        return loss


def _model_factory(model: Any, model_class: Any) -> Callable[[], Any]:
    if _is_config(model):
        return lambda: _from_config(model, model_class)
    factory = copies_of(model)
    if factory is not None:
        return factory
    raise UserError(f"hf_workload: model is a transformers config, a torch.nn.Module or a function that "
                    f"returns one; got {type(model).__name__}")


def _is_config(obj: Any) -> bool:
    # PretrainedConfig, renamed PreTrainedConfig in transformers 5
    return any(c.__name__.lower() == "pretrainedconfig" for c in type(obj).__mro__)


def _from_config(config: Any, model_class: Any) -> Any:
    if model_class is None:
        from transformers import AutoModelForCausalLM

        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:
            raise UserError(f"hf_workload: {type(config).__name__} has no causal-LM head; pass model_class "
                            f"(for example AutoModelForSequenceClassification)") from None
    if hasattr(model_class, "from_config"):
        return model_class.from_config(config)
    return model_class(config)
