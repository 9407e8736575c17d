from __future__ import annotations

import fcntl
import os

import pytest


@pytest.fixture
def restore_threads():
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _share_the_machine(request, tmp_path_factory):
    """Under ``pytest -n`` (pytest-xdist), a test marked ``alone`` (it measures time or the
    machine's load) runs with no other test beside it; the others run side by side.

    One lock file for the run's workers: the others hold it shared, an ``alone`` test
    exclusively. A turnstile taken before it keeps a waiting ``alone`` test from being
    passed over by shared holders without end."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    shared_dir = tmp_path_factory.getbasetemp().parent  # one per run, above each worker's own
    alone = request.node.get_closest_marker("alone") is not None
    with open(shared_dir / "machine.lock", "a") as machine, open(shared_dir / "turnstile.lock", "a") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
