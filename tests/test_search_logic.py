"""The search's plain parts: resources, aggregation, Pareto (no Ray)."""

import pytest

from tuner import spec
from tuner.search import aggregate, pareto_front, plan_resources, rank


def _space(tmp_path, text):
    p = tmp_path / "space.yaml"
    p.write_text(text)
    return spec.load(p)


def test_plan_resources_and_aggregation(tmp_path):
    space = _space(tmp_path, "name: t\nworkload: conv\nknobs:\n  num_workers: [0, 3]\n")
    device, cpus, gpus, concurrent = plan_resources(space, {"max_node_cpus": 8, "gpus": 4, "nodes": 1})
    assert (device, gpus, concurrent) == ("cuda", 1, 4)
    assert cpus({"num_workers": 0}) == 1 and cpus({"num_workers": 3}) == 4
    device, cpus, gpus, concurrent = plan_resources(space, {"max_node_cpus": 2, "gpus": 0, "nodes": 1})
    assert (device, gpus, concurrent) == ("cpu", 0, 1) and cpus({"num_workers": 0}) == 2
    recs = [
        {"phase": "search", "key": "a", "config": {"x": 1}, "status": "ok", "samples_per_sec": 100.0,
         "peak_host_memory_mb": 50.0},
        {"phase": "confirm", "key": "a", "config": {"x": 1}, "status": "ok", "samples_per_sec": 90.0,
         "peak_host_memory_mb": 52.0},
        {"phase": "search", "key": "b", "config": {"x": 2}, "status": "ok", "samples_per_sec": 95.0,
         "peak_host_memory_mb": 10.0},
        {"phase": "search", "key": "c", "config": {"x": 3}, "status": "infeasible", "reason": "oom"},
    ]
    rows = aggregate(recs, "samples_per_sec")
    ranked = rank(rows, "samples_per_sec")
    assert [r["key"] for r in ranked] == ["a", "b"] and ranked[0]["samples_per_sec"] == 95.0
    assert ranked[0]["spread"] == pytest.approx(10 / 95)
    front = pareto_front(rows, "samples_per_sec")
    assert [r["key"] for r in front] == ["b"]  # b: as fast as a's median? no: 95 vs 95, less memory
