from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# The suite runs three tests at a time (`pytest -n 3`): most of its tests wait on Ray, on
# subprocesses or on sleeping trials, and two at a time left the 2 cores idle more than
# half the time. A test whose assertions need a quiet machine (a rate against a
# reference, a window's disturbance, ranks that load every core) is marked `alone`: it
# has the machine to itself while the other workers wait. The other tests' searches take
# their `measure:` from `tests.helpers.space_lines`, which counts no window as disturbed:
# the tests beside them are load they do not check.


@contextmanager
def _machine(lock_dir: Path, alone: bool) -> Iterator[None]:
    """A readers-writer lock between the workers: `alone` tests hold it exclusively, the
    others share it. The gate keeps a waiting `alone` test from being overtaken by the
    shared tests that keep arriving."""
    with open(lock_dir / "machine.gate", "a") as gate, open(lock_dir / "machine.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


_held: list = []  # the exclusive hold, kept across `alone` tests in a row


def _alone(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


def _lock_dir() -> Path:
    """One folder per run of the suite, which its workers share: xdist gives every worker
    of a run the same ``PYTEST_XDIST_TESTRUNUID``; the controller removes it at the end."""
    folder = Path(tempfile.gettempdir()) / f"tuner-tests-{os.environ['PYTEST_XDIST_TESTRUNUID']}"
    folder.mkdir(exist_ok=True)
    return folder


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER") and config.pluginmanager.hasplugin("xdist") \
            and config.getoption("testrunuid", None) is None:
        # chosen here rather than by xdist, so that the controller knows the folder to remove
        config.option.testrunuid = uuid.uuid4().hex


def pytest_sessionfinish(session: pytest.Session) -> None:
    run = session.config.getoption("testrunuid", None) if session.config.pluginmanager.hasplugin("xdist") else None
    if run and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller, its workers done
        shutil.rmtree(Path(tempfile.gettempdir()) / f"tuner-tests-{run}", ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield  # one test at a time: nothing to share
        return
    if not _held:
        hold = _machine(_lock_dir(), _alone(item))
        hold.__enter__()
        _held.append(hold)
    yield
    # `alone` tests in a row keep the machine between them; a shared test lets go after
    # each, so that an `alone` test can start
    if not (_alone(item) and _alone(nextitem)):
        _held.pop().__exit__(None, None, None)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # the `alone` tests are one group (`--dist loadgroup`, pyproject's addopts; a module
        # whose tests share a costly fixture marks them a group of its own): one worker runs
        # them in a row, keeping the machine between them, and the others wait once rather
        # than before each of them; the quick tests last, so that the workers end within
        # seconds of each other rather than one of them waiting out another's last scenario
        for item in filter(_alone, items):
            item.add_marker(pytest.mark.xdist_group("alone"))
        items.sort(key=lambda item: (not _alone(item), item.get_closest_marker("slow") is None))


@pytest.fixture
def restore_threads():
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def temp_dir() -> Iterator[Path]:
    """A process's temp dir (``TMPDIR``) for a test that checks what a run leaves there, at
    a short path: multiprocessing binds its sockets in it, and a socket's path has at most
    107 characters, which pytest's ``tmp_path`` under xdist comes close to (a worker there
    could not bind and hung)."""
    folder = Path(tempfile.mkdtemp(prefix="tuner-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
