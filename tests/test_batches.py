"""Batches of any structure reach the device (tuner/batches.py).

The "meta" device stands in for a GPU: a tensor moved there reports device.type
"meta", so every leaf can be checked without an accelerator.
"""

from collections import OrderedDict, UserDict, namedtuple
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from tuner.batches import Mover

META = torch.device("meta")
Pair = namedtuple("Pair", "x y")


@dataclass
class Sample:
    x: torch.Tensor
    y: torch.Tensor
    name: str = "s"
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


class BatchEncoding(UserDict):
    """Like Hugging Face's BatchEncoding: a UserDict of tensors."""


class ReadOnly(Mapping):
    def __init__(self, d):
        self._d = dict(d)

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


class Tokens(Sequence):
    def __init__(self, items):
        self._items = list(items)

    def __getitem__(self, i):
        return self._items[i]

    def __len__(self):
        return len(self._items)


class Recorder:
    """A custom batch type with its own to(): records where it was sent."""

    def __init__(self):
        self.sent_to = None

    def to(self, device):
        self.sent_to = device
        return self


def t():
    return torch.zeros(2, 3)


def leaves(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from leaves(v)
    elif isinstance(obj, (list, tuple, Sequence)) and not isinstance(obj, str):
        for v in obj:
            yield from leaves(v)
    elif hasattr(obj, "__dataclass_fields__"):
        for k in obj.__dataclass_fields__:
            yield from leaves(getattr(obj, k))


def test_every_structure_reaches_the_device():
    move = Mover(META)
    batches = {
        "tensor": t(),
        "dict": {"a": t(), "b": [t(), (t(), "text")]},
        "ordered": OrderedDict(a=t(), b=t()),
        "userdict": BatchEncoding(input_ids=t(), attention_mask=t()),
        "readonly": ReadOnly({"a": t()}),
        "proxy": MappingProxyType({"a": t()}),
        "namedtuple": Pair(t(), {"z": t()}),
        "tuple": (t(), 3, None),
        "list": [t(), [t()]],
        "sequence": Tokens([t(), t()]),
        "dataclass": Sample(t(), t(), extra={"m": t()}),
        "frozen": Frozen(t()),
    }
    for name, batch in batches.items():
        moved = move(batch)
        found = list(leaves(moved))
        assert found, name
        assert all(x.device.type == "meta" for x in found), name
        assert type(moved) is type(batch) or name == "proxy", name


def test_structure_and_non_tensors_are_kept():
    move = Mover(META)
    p = move(Pair(t(), 5))
    assert isinstance(p, Pair) and p.y == 5 and p._fields == ("x", "y")
    d = {"a": t(), "n": "keep"}
    assert move(d) is d and d["n"] == "keep"  # mutable containers move in place
    s = Sample(t(), t(), name="abc")
    assert move(s) is s and s.name == "abc" and s.x.device.type == "meta"
    r = Recorder()
    assert move({"r": r})["r"] is r and r.sent_to == META


def test_channels_last_applies_to_4d_inputs_only():
    move = Mover(torch.device("cpu"), channels_last=True)
    img, seq = move((torch.zeros(2, 3, 4, 4), torch.zeros(2, 5)))
    assert img.is_contiguous(memory_format=torch.channels_last) and not img.is_contiguous()
    assert seq.is_contiguous()


def test_mover_is_built_once_per_type():
    move = Mover(META)
    move({"a": t()})
    built = dict(move._by_type)
    move({"b": t(), "c": t()})
    assert move._by_type == built  # no new function for a second dict
