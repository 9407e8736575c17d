"""Shared test helpers."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixture_workloads.py"
# Short measurements: the tests check behaviour, not speed.
FAST_MEASURE = {"warmup_steps": 2, "window_s": 0.2, "min_windows": 3, "max_windows": 4, "max_timed_s": 5.0}


# No window counted as disturbed: neither by the processes beside it nor by time the
# hypervisor stole (under the parallel suite, bursts of steal on this VM's host).
UNDISTURBED = {"max_interference": 1.0, "max_steal": 1.0}


def space_lines(hot_path: bool = False, **settings: float) -> str:
    """The suite's lines of a space.yaml for a test's search or bench: ``measure:`` with
    FAST_MEASURE and ``settings``, and no window counted as disturbed by the load beside
    it, which under ``pytest -n 3`` is other tests' (tests/conftest.py), not what these
    tests check; no hot-path check after a search unless ``hot_path`` (a fresh process
    and a few steps of the baseline and the pick: test_search's end-to-end test checks it)."""
    return ("measure: " + json.dumps({**FAST_MEASURE, **UNDISTURBED, **settings}) + "\n"
            + f"hot_path: {str(hot_path).lower()}\n")


def ref(name: str) -> str:
    """A workload reference to one of the fixture workloads."""
    return f"{FIXTURES}:{name}"


def spin(seconds: float) -> None:
    """Keep one core busy for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@contextmanager
def hog_from_first_window(seconds: float, processes: int | None = None) -> Iterator[Callable[[str], None]]:
    """A CPU hog: one spinning process per core (by default), started when the
    measurement whose progress callback this yields reports its first window, for
    ``seconds``. The hogs are ended on exit. They are spawned from this module, which
    imports nothing heavy, so that they start spinning at once."""
    from tuner.trial import kill_tree

    hogs: list = []

    def progress(message: str) -> None:
        if message.startswith("window 1:") and not hogs:
            ctx = mp.get_context("spawn")
            for _ in range(processes or os.cpu_count() or 1):
                p = ctx.Process(target=spin, args=(seconds,))
                p.start()
                hogs.append(p)

    try:
        yield progress
    finally:
        for p in hogs:
            kill_tree(p.pid)


def pipeline_rate(config: dict, cores: int, per_process: float) -> tuple[float, float]:
    """A synthetic input pipeline on ``cores`` cores: (samples/s, data wait) of ``config``.
    The step's rate grows with the intra-op threads (unset: every core) and the micro-batch,
    and falls where threads and workers overrun the cores; each loading process delivers
    ``per_process`` samples/s. Without workers the training process loads between its
    steps (the times add); with workers the slower stage sets the rate."""
    threads, workers = config.get("torch_threads") or cores, config.get("num_workers") or 0
    step = 150 * threads ** 0.7 * {32: 0.8, 64: 1.0, 128: 1.1}[config["micro_batch_size"]]
    step *= min(1.0, cores / (threads + workers))
    if workers == 0:
        rate = 1 / (1 / step + 1 / per_process)
        return rate, rate / per_process
    rate = min(step, per_process * workers)
    return rate, 1 - rate / step


def torch_default_threads() -> int:
    """The intra-op threads PyTorch chooses in a fresh process of this machine with no
    OMP_NUM_THREADS or MKL_NUM_THREADS set: what a user's own run gets."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         capture_output=True, text=True, check=True, env=env)
    return int(out.stdout)


def running(process: Any) -> bool:
    """Whether a process (a ``psutil.Process`` or a pid) still runs, a zombie counted as
    ended: one that ends between two questions about it has ended, not raised."""
    import psutil

    try:
        p = psutil.Process(process) if isinstance(process, int) else process
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def own_memory_cgroup() -> str | None:
    """This process's cgroup v1 memory folder (as this machine mounts its memory
    controller), where this user may make a child in it; None elsewhere."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.split(":", 2)[2].strip() for line in f if ":memory:" in line), None)
    except OSError:
        return None
    folder = f"/sys/fs/cgroup/memory{path}" if path is not None else None
    return folder if folder and os.access(folder, os.W_OK) else None


@contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[Callable[..., subprocess.CompletedProcess]]:
    """A real child cgroup of this process's memory cgroup held to ``limit_bytes``; yields
    ``run(*argv)``, which runs a command inside it (skips the test where a process cannot
    join one). Removed once its processes are gone."""
    import pytest

    parent = own_memory_cgroup()
    if parent is None:
        pytest.skip("no cgroup v1 memory folder this user may write")
    folder = os.path.join(parent, f"tuner-test-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.mkdir(folder)
    except OSError as exc:  # a folder this user may write, but no child cgroup (a nested container)
        pytest.skip(f"no child cgroup here: {exc}")

    def run(*argv: str, timeout: float = 120, cwd: str | None = None) -> subprocess.CompletedProcess:
        out = subprocess.run(["sh", "-c", f'echo $$ > {folder}/cgroup.procs || exit 77; exec "$@"', "sh", *argv],
                             capture_output=True, text=True, timeout=timeout, cwd=cwd)
        if out.returncode == 77:
            pytest.skip(f"a process cannot join a child cgroup here: {out.stderr.strip()}")
        return out

    try:
        with open(os.path.join(folder, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit_bytes))
        yield run
    finally:
        _remove_cgroup(folder)


def _remove_cgroup(folder: str, grace_s: float = 15.0) -> None:
    """Remove a test's cgroup once the processes in it are gone. A command's own
    processes outlive it by a moment (multiprocessing's resource tracker exits once its
    last client has); any still there after ``grace_s`` are this test's, ended by id."""
    import signal

    deadline = time.monotonic() + grace_s
    while True:
        with open(os.path.join(folder, "cgroup.procs")) as f:
            left = [int(pid) for pid in f.read().split()]
        if not left:
            try:
                os.rmdir(folder)
                return
            except OSError:  # its last process is still being torn down
                pass
        elif time.monotonic() > deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline + grace_s:
            os.rmdir(folder)  # raises, naming the folder left behind
            return
        time.sleep(0.1)
