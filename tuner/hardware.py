"""What a result was measured on: hardware and versions, saved beside every result."""

from __future__ import annotations

import os
import platform
import socket
from functools import lru_cache
from importlib import metadata
from typing import Any


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# A cgroup limit at or above this is no limit (cgroup v1 writes 2**63 rounded to a page).
_NO_LIMIT = 2**60


def memory_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> tuple[int, int] | None:
    """(limit, in use) in bytes of the tightest memory limit over this process's cgroup and
    its parents (a container's, a Kubernetes pod's, a Slurm job's), or None where none is
    set. The host's RAM is not what a process in one may use: the kernel ends it at the
    limit. In use leaves out the inactive page cache, which the kernel reclaims first."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    tightest: tuple[int, int] | None = None
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: memory.max; hybrid hosts mount it at unified/
            bases, limit_f, usage_f, inactive = [root, f"{root}/unified"], "memory.max", "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):
            bases, limit_f, usage_f, inactive = [f"{root}/memory"], "memory.limit_in_bytes", "memory.usage_in_bytes", \
                "total_inactive_file"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for base in bases:
            # the cgroup and each parent up to the root; inside a container its own is the
            # root (a path that does not exist there is passed over)
            for depth in range(len(parts), -1, -1):
                folder = os.path.join(base, *parts[:depth])
                try:
                    with open(os.path.join(folder, limit_f)) as f:
                        text = f.read().strip()
                    with open(os.path.join(folder, usage_f)) as f:
                        used = int(f.read().strip())
                except (OSError, ValueError):
                    continue
                if not text.isdigit() or int(text) >= _NO_LIMIT:
                    continue
                used -= _stat(os.path.join(folder, "memory.stat"), inactive)
                if tightest is None or int(text) - used < tightest[0] - tightest[1]:
                    tightest = (int(text), max(0, used))
    return tightest


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has ended since boot, at any cgroup's
    limit or at the host's memory (``/proc/vmstat``), or None where it keeps no count."""
    try:
        with open("/proc/vmstat") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), None)
    except (OSError, ValueError, IndexError):
        return None


def _stat(path: str, key: str) -> int:
    try:
        with open(path) as f:
            return next((int(line.split()[1]) for line in f if line.startswith(key + " ")), 0)
    except (OSError, ValueError, IndexError):
        return 0


def host_memory_mb() -> float | None:
    """The host's RAM, or its cgroup's memory limit where that is lower."""
    try:
        import psutil

        total = psutil.virtual_memory().total
    except Exception:
        return None
    limit = memory_limit()
    return min(total, limit[0] if limit else total) / 2**20


def available_memory() -> int:
    """Bytes this process may still take: the host's available memory, or what its
    cgroup's limit leaves where that is less."""
    import psutil

    free = psutil.virtual_memory().available
    limit = memory_limit()
    return min(free, limit[0] - limit[1]) if limit else free


@lru_cache(maxsize=1)
def cpu_bf16() -> str | None:
    """This CPU's native bf16: ``amx`` (matrix tiles), ``avx512_bf16`` (vector dot
    products only), or None. Recorded with every measurement: the same model's bf16
    rate differs between the two (a VM may move between such hosts), and without
    either, bf16 autocast is slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return None
    return "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else None


def cpu_has_bf16() -> bool:
    """Native bf16 on this CPU (AVX512-BF16 or AMX): without it, bf16 autocast is slow."""
    return cpu_bf16() is not None


def shm_mb() -> float | None:
    """The size of /dev/shm in MB, where DataLoader workers hand their batches over (None
    where there is none): a container's default is 64 MB, unless it was started with
    ``--shm-size`` or ``--ipc=host``."""
    import shutil

    try:
        return shutil.disk_usage("/dev/shm").total / 2**20
    except OSError:
        return None


# /dev/shm below this is flagged: a container's default (64 MB) holds a few batches of small
# images, where one batch of 256 ImageNet-sized images in fp32 is 150 MB, and each worker
# keeps prefetch_factor of them in flight; NCCL's ranks on one node keep their buffers there.
SHM_ENOUGH_MB = 1024

# What puts a search's processes in /dev/shm, and so what a small one stops.
SHM_USERS = {"workers": "DataLoader workers hand batches over", "nccl": "NCCL's ranks on one node exchange data"}


def shm_advice(user: str = "workers") -> str:
    """What a trial out of shared memory is told: who needed it (``SHM_USERS``), how much
    there is, and what helps."""
    size = shm_mb()
    held = f", which holds {size:,.0f} MB here" if size is not None else ""
    less = ("fewer workers or a smaller batch or prefetch_factor need less" if user == "workers"
            else "NCCL_SHM_DISABLE=1 avoids it, at a cost in speed")
    return f"{SHM_USERS[user]} in /dev/shm{held}; a container needs --shm-size=8g or --ipc=host, and {less}"


def shm_short(users: list[str], size: float | None = None) -> str | None:
    """What to tell a search whose processes need /dev/shm (``users``, keys of
    ``SHM_USERS``) where it holds less than ``SHM_ENOUGH_MB``: this machine's, or ``size``
    MB (a cluster node's, as it said); None where it is enough, absent (not Linux) or
    needed by none."""
    size = shm_mb() if size is None else size
    if not users or size is None or size >= SHM_ENOUGH_MB:
        return None
    who = " and ".join(SHM_USERS[u] for u in users)
    return (f"/dev/shm holds {size:,.0f} MB here, where {who}: configs that need more fail as out of shared "
            f"memory; a container needs --shm-size=8g or --ipc=host")


# Debugging switches that slow every step (or undo a knob) when left in a training run's
# environment: what each does, and whether it touches only GPU runs.
DEBUG_ENV = {
    "CUDA_LAUNCH_BLOCKING": ("every CUDA kernel launch waits for the kernel to finish", True),
    "PYTORCH_NO_CUDA_MEMORY_CACHING": ("the CUDA caching allocator is off: each allocation is a cudaMalloc", True),
    "TORCHDYNAMO_DISABLE": ("torch.compile returns the eager model (a trial refuses compile's configs)", False),
    "TORCH_COMPILE_DISABLE": ("torch.compile returns the eager model (a trial refuses compile's configs)", False),
    "TORCH_COMPILE_DEBUG": ("torch.compile writes its debug dumps at every compile", False),
}


def debug_env(gpu: bool = True) -> list[str]:
    """``NAME=value: what it does`` for each of ``DEBUG_ENV`` set (not to 0 or empty) in
    this process's environment; the GPU-only ones where ``gpu``."""
    out = []
    for name, (what, gpu_only) in DEBUG_ENV.items():
        value = os.environ.get(name, "").strip()
        if value not in ("", "0") and (gpu or not gpu_only):
            out.append(f"{name}={value}: {what}")
    return out


def nvml_status() -> tuple[bool, str]:
    """Whether NVML (GPU utilization, power, clocks) answers here, and what it said."""
    try:
        import pynvml
    except ImportError:
        return False, "pynvml not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        driver = pynvml.nvmlSystemGetDriverVersion()
        pynvml.nvmlShutdown()
        return True, f"driver {driver}, {n} device(s)"
    except Exception as exc:
        return False, f"no NVIDIA driver ({type(exc).__name__})"


def usable_cores() -> int:
    """The cores this process can run on: the machine's, narrowed by its CPU affinity
    (``taskset``, a Slurm allocation, a cpuset) and by its cgroup's CPU quota (``docker
    --cpus``, a Kubernetes limit), as joblib counts them (``LOKY_MAX_CPU_COUNT`` narrows
    it too). A process on 8 of a node's 64 cores that planned threads and workers for 64
    would oversubscribe its 8. (A cluster's nodes may lack joblib, which the tuner's own
    install brings: there, the affinity alone.)"""
    try:
        import joblib
    except ImportError:
        return len(affinity() or ()) or max(1, os.cpu_count() or 1)
    return max(1, joblib.cpu_count())


def affinity() -> frozenset[int] | None:
    """The CPUs this process may run on, where that is fewer than the machine's (None: all
    of them, or a platform that does not say)."""
    try:
        cpus = frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    return cpus if cpus and len(cpus) < (os.cpu_count() or 0) else None


@lru_cache(maxsize=1)
def describe() -> dict:
    """Hardware and software of this process: host, CPU, GPU, versions."""
    import torch

    info = {
        "hostname": socket.gethostname(),
        "cpu": _cpu_model(),
        "cpu_count": usable_cores(),  # what the trials plan threads and workers for
        "machine_cpu_count": os.cpu_count(),
        "host_memory_mb": host_memory_mb(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16": cpu_bf16(),
        "python": platform.python_version(),
        # (a str, not torch's TorchVersion: unpickling a record must not import torch
        # in the driver or a Tune actor, seconds the first time, on every trial's clock)
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "ray": _version("ray"),
        "optuna": _version("optuna"),
        "gpu": None,
        "gpu_count": 0,
        "gpu_memory_mb": None,
    }
    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        info.update(gpu=props.name, gpu_count=torch.cuda.device_count(),
                    gpu_memory_mb=props.total_memory / 2**20,
                    cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    return info


def pick_device(requested: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        from tuner.errors import UserError

        raise UserError("device: 'cuda' was asked for but no CUDA GPU is visible here")
    return requested


# ---- peak FLOP/s, for MFU --------------------------------------------------------------

# Dense peak TFLOP/s per GPU model (bf16/fp16 tensor cores; tf32; fp32 without tensor cores).
_GPU_PEAK_TFLOPS = {
    "H200": (989.0, 494.0, 67.0), "H100": (989.0, 494.0, 67.0), "A100": (312.0, 156.0, 19.5),
    "L40S": (362.0, 183.0, 91.6), "A10": (125.0, 62.5, 31.2), "L4": (121.0, 60.0, 30.3),
    "V100": (125.0, 15.7, 15.7), "T4": (65.0, 8.1, 8.1), "RTX 4090": (165.0, 82.6, 82.6),
}


def peak_flops(device: Any, precision: str, tf32: bool) -> float | None:
    """The device's dense peak FLOP/s for this precision, or None where unknown (CPUs)."""
    if device.type != "cuda":
        return None
    import torch

    key = gpu_model_key(torch.cuda.get_device_name(device))
    if key is None:
        return None
    half, tf, fp32 = _GPU_PEAK_TFLOPS[key]
    return (half if precision in ("bf16", "fp16") else (tf if tf32 else fp32)) * 1e12


def gpu_model_key(name: str) -> str | None:
    """The peak table's entry for a CUDA device name, matching whole model names
    ("NVIDIA L40" is not an "L4"; "NVIDIA A100-SXM4-80GB" is an "A100"), or None."""
    import re

    tokens = [t for t in re.split(r"[\s\-_/]+", name.upper()) if t]
    for key in sorted(_GPU_PEAK_TFLOPS, key=len, reverse=True):
        k = key.upper().split()
        if any(tokens[i:i + len(k)] == k for i in range(len(tokens) - len(k) + 1)):
            return key
    return None
