"""Moving a batch of any structure to the device.

The structures are the ones PyTorch's own ``default_collate`` and pin-memory code
handle: tensors, Mappings (dict, OrderedDict, Hugging Face ``BatchEncoding`` and
other ``UserDict``s), namedtuples, tuples, lists and other Sequences, and
dataclasses; anything else with a ``to(device)`` method is moved by it, and
anything else (strings, numbers, None) is left as it is.

``Mover`` builds one function per batch *type* the first time it meets it and
caches it, so the hot path is one dict lookup per container, not an
``isinstance`` chain. Mutable containers are updated in place (no new dict per
step); immutable ones are rebuilt as their own type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import torch

MoveFn = Callable[[Any], Any]


class Mover:
    """``mover(batch)`` returns the batch with every tensor on ``device``.

    >>> move = Mover(torch.device("cuda"), non_blocking=True, channels_last=False)
    >>> batch = move(batch)
    """

    def __init__(self, device: torch.device, non_blocking: bool = False, channels_last: bool = False):
        self.device, self.non_blocking, self.channels_last = device, non_blocking, channels_last
        self._by_type: dict[type, MoveFn] = {}

    def __call__(self, obj: Any) -> Any:
        fn = self._by_type.get(type(obj))
        if fn is None:
            fn = self._by_type[type(obj)] = self._build(type(obj), obj)
        return fn(obj)

    def _build(self, t: type, sample: Any) -> MoveFn:
        """The move function for objects of type ``t`` (``sample`` is one of them)."""
        if issubclass(t, torch.Tensor):
            return self._tensor
        if issubclass(t, (str, bytes, bytearray, int, float, complex, bool, type(None))):
            return _identity
        if issubclass(t, Mapping):
            return self._mapping_in_place if issubclass(t, MutableMapping) else self._mapping_rebuilt
        if issubclass(t, tuple):
            if hasattr(t, "_fields"):  # namedtuple
                return lambda obj: t(*(self(x) for x in obj))
            if t is tuple:
                return lambda obj: tuple(self(x) for x in obj)
            return lambda obj: t(self(x) for x in obj)
        if issubclass(t, MutableSequence):
            return self._sequence_in_place
        if issubclass(t, Sequence):
            return lambda obj: t([self(x) for x in obj])
        if dataclasses.is_dataclass(t):
            fields = [f.name for f in dataclasses.fields(t) if f.init]
            if t.__dataclass_params__.frozen:  # type: ignore[attr-defined]
                return lambda obj: dataclasses.replace(obj, **{f: self(getattr(obj, f)) for f in fields})

            def move_dataclass(obj: Any) -> Any:
                for f in fields:
                    setattr(obj, f, self(getattr(obj, f)))
                return obj

            return move_dataclass
        if callable(getattr(sample, "to", None)):
            return lambda obj: obj.to(self.device)
        return _identity

    def _tensor(self, obj: torch.Tensor) -> torch.Tensor:
        if self.channels_last and obj.dim() == 4:
            return obj.to(self.device, non_blocking=self.non_blocking, memory_format=torch.channels_last)
        return obj.to(self.device, non_blocking=self.non_blocking)

    def _mapping_in_place(self, obj: MutableMapping) -> MutableMapping:
        for k in obj:
            obj[k] = self(obj[k])
        return obj

    def _mapping_rebuilt(self, obj: Mapping) -> Any:
        moved = {k: self(v) for k, v in obj.items()}
        try:
            return type(obj)(moved)  # type: ignore[call-arg]
        except TypeError:  # a Mapping that cannot be built from a dict
            return moved

    def _sequence_in_place(self, obj: MutableSequence) -> MutableSequence:
        for i in range(len(obj)):
            obj[i] = self(obj[i])
        return obj


def _identity(obj: Any) -> Any:
    return obj
