"""Shared test helpers."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).parent / "fixture_workloads.py"
# Short measurements: the tests check behaviour, not speed.
FAST_MEASURE = {"warmup_steps": 2, "window_s": 0.2, "min_windows": 3, "max_windows": 4, "max_timed_s": 5.0}


def ref(name: str) -> str:
    """A workload reference to one of the fixture workloads."""
    return f"{FIXTURES}:{name}"
