"""tuner: a Ray-distributed performance tuner for PyTorch training."""

from typing import Any

__all__ = ["Workload"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so that `python -m tuner --help` does not import torch.
    if name == "Workload":
        from tuner.workloads import Workload

        return Workload
    raise AttributeError(name)
