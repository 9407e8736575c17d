"""A trial's data-parallel ranks agreeing on every decision of a measurement, and the
record's figures over all ranks."""

from __future__ import annotations

import torch

from tuner.loop import Trainer


class Agree:
    """Figures agreed across the data-parallel ranks of one trial.

    Every decision of the measurement (window length, redoing a disturbed window,
    stopping) is taken on figures reduced the same way on every rank, so that every
    rank runs the same number of steps (DDP would hang otherwise). The reduction is
    one all-reduce at a window edge, which is also the barrier that starts the ranks'
    next window together; never a per-step collective. With one rank, it is free.
    """

    def __init__(self, trainer: Trainer):
        self.world = trainer.world
        self.on = torch.device("cpu")
        if self.world > 1:
            import torch.distributed as dist

            if dist.get_backend() == "nccl":  # NCCL reduces device tensors only; gloo host ones
                self.on = trainer.device

    def max(self, *values: float) -> list[float]:
        if self.world == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.on)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        return bool(self.max(float(flag))[0])

    def gather(self, item: dict) -> list[dict]:
        if self.world == 1:
            return [item]
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, item)
        return out


def across_ranks(ranks: list[dict]) -> dict:
    """The record's figures over all ranks: each rank's own, the slowest named, device
    memory as the largest rank's, host memory per node (workers included) and the
    largest node's as the peak (what must fit on one machine)."""
    per_node: dict[str, float] = {}
    for r in ranks:
        node = str(r.get("node", "?"))
        per_node[node] = per_node.get(node, 0.0) + (r["peak_host_memory_mb"] or 0.0)
    device = [r["peak_device_memory_mb"] for r in ranks if r.get("peak_device_memory_mb") is not None]
    return {"ranks": sorted(ranks, key=lambda r: r["rank"]),
            "slowest_rank": max(ranks, key=lambda r: r["step_time_ms"])["rank"],
            "host_memory_per_node_mb": per_node,
            "peak_host_memory_mb": max(per_node.values()),
            "peak_device_memory_mb": max(device) if device else None}
