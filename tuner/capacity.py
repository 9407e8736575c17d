"""Whether the Ray cluster can still run a trial. A node lost between trials can take the
only room a trial fits in (its CPUs, its GPU): Ray then keeps the trial pending for ever.
The search waits as long as one trial may take (an autoscaler may bring a node back),
then stops with what it measured kept."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.errors import ClusterShrunk


def alive_nodes() -> list[dict]:
    """The total resources of each alive node."""
    import ray

    return [dict(n.get("Resources") or {}) for n in ray.nodes() if n.get("Alive")]


def cluster_shape() -> dict:
    """Nodes; CPUs and GPUs of the largest node and in all."""
    nodes = alive_nodes()
    cpus, gpus = [n.get("CPU", 0) for n in nodes], [n.get("GPU", 0) for n in nodes]
    return {"nodes": len(nodes), "max_node_cpus": int(max(cpus, default=1)), "gpus": int(sum(gpus)),
            "cpus": int(sum(cpus)), "max_node_gpus": int(max(gpus, default=0))}


def fits(bundle: dict, nodes: list[dict]) -> bool:
    """Whether one node of ``nodes`` can hold ``bundle`` (Ray places a trial's bundle on
    one node)."""
    wanted = {k: v for k, v in bundle.items() if k in ("CPU", "GPU") and v}
    return any(all(node.get(k, 0) >= v for k, v in wanted.items()) for node in nodes)


def _shown(resources: dict) -> str:
    return " ".join(f"{k} {v:g}" for k, v in sorted(resources.items()) if k in ("CPU", "GPU") and v) or "nothing"


@dataclass
class Watch:
    """Raises ``ClusterShrunk`` once no alive node has fitted a waiting trial for
    ``grace_s``. ``check`` is cheap to call often: it asks Ray at most every ``every_s``."""

    out: Path
    grace_s: float
    every_s: float = 2.0
    short_since: float | None = None
    asked: float = 0.0

    def check(self, waiting: Iterable[dict], measured: int) -> None:
        """``waiting``: the bundles of the trials or tasks that wait for a node."""
        now = time.time()
        if now - self.asked < self.every_s:
            return
        self.asked = now
        waiting = list(waiting)
        nodes = alive_nodes() if waiting else []
        homeless = next((b for b in waiting if not fits(b, nodes)), None)
        if homeless is None:
            self.short_since = None
            return
        self.short_since = self.short_since or now
        if now - self.short_since < self.grace_s:
            return
        largest = max(nodes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)), default={})
        raise ClusterShrunk(
            f"no node of the Ray cluster can run a trial any more (one needs {_shown(homeless)}; "
            f"{len(nodes)} node(s) alive, the largest with {_shown(largest)}), for {self.grace_s:.0f} s: a node "
            f"was lost; the {measured} measurements are kept in {self.out}; when the cluster is back, "
            f"`python -m tuner resume {self.out}` plans its trials for the nodes it finds")

    def get(self, refs: list[Any], bundles: list[dict], measured: int) -> list[Any]:
        """``ray.get(refs)``, watching that the tasks still have a node to run on."""
        import ray

        while True:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.every_s)
            if len(ready) == len(refs):
                return ray.get(refs)
            self.check(bundles, measured)
