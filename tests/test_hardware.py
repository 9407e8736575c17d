"""What a result was measured on (tuner/hardware.py) and the peak FLOP/s table."""

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import memory_cgroup
from tuner.hardware import cpu_bf16, cpu_has_bf16, describe, nvml_status, pick_device, usable_cores
from tuner.hostload import machine_cpu


def test_describe_names_the_machine_and_versions():
    hw = describe()
    assert hw["cpu_count"] >= 1 and hw["torch"] == torch.__version__ and hw["ray"] and hw["optuna"]
    assert (hw["gpu"] is not None) == torch.cuda.is_available()
    assert pick_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    # plain Python values: a record that carries them unpickles without importing torch
    assert all(type(v).__module__ == "builtins" for v in hw.values()), hw


def test_probes_read_this_machine():
    # the real /proc/cpuinfo and the real NVML: no driver here means a reason, not a crash
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "")
    assert cpu_has_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)
    # which kind: AMX where the CPU has its tiles, else AVX512-BF16's dot products alone
    assert cpu_bf16() == ("amx" if "amx_bf16" in flags.split() else "avx512_bf16" if "avx512_bf16" in flags.split()
                          else None) == describe()["cpu_bf16"]
    ok, detail = nvml_status()
    assert detail and (ok or not torch.cuda.is_available() or "pynvml" in detail)


def test_gpu_peak_table_matches_whole_model_names():
    from tuner.hardware import gpu_model_key

    names = {"NVIDIA L40": None, "NVIDIA L4": "L4", "NVIDIA L40S": "L40S", "NVIDIA H100 80GB HBM3": "H100",
             "NVIDIA H200": "H200", "NVIDIA A100-SXM4-80GB": "A100", "Tesla V100-SXM2-32GB": "V100",
             "NVIDIA GeForce RTX 4090": "RTX 4090", "NVIDIA A10G": None, "Tesla T4": "T4"}
    assert {n: gpu_model_key(n) for n in names} == names


BOUND = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2,
                           reason="needs CPU affinity (Linux) and 2 cores")


@BOUND
@pytest.mark.slow
def test_a_process_bound_to_some_cores_plans_for_those_and_its_local_ray_counts_them():
    """A Slurm allocation or ``taskset`` leaves a process some of a node's cores; Ray counts
    the machine's (it reads a cgroup's quota, not the affinity), so a local search planned
    its trials' threads for every core. Bound to core 0 here: one core everywhere."""
    code = ("import ray; from tuner.hardware import describe, usable_cores; "
            "from tuner.localray import start_local_ray; from tuner.apply import context_for; import torch; "
            "start_local_ray(log_to_driver=False, state_api=False); "
            "print(usable_cores(), describe()['cpu_count'], describe()['machine_cpu_count'], "
            "int(ray.cluster_resources()['CPU']), context_for(torch.device('cpu')).cpu_count); ray.shutdown()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                         preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    assert out.returncode == 0, out.stderr[-2000:]
    usable, recorded, machine, ray_cpus, ctx = map(int, out.stdout.split()[-5:])
    assert usable == recorded == ray_cpus == ctx == 1 and machine == os.cpu_count()
    assert usable_cores() == len(os.sched_getaffinity(0))  # unbound: its own cores


def test_the_cpu_time_of_some_cores_is_theirs_alone():
    whole, every = machine_cpu(), machine_cpu(frozenset(range(os.cpu_count() or 1)))
    assert whole and every
    # the per-CPU lines add up to the machine's line (read a moment apart: within 1 s a core)
    assert all(abs(a - b) <= (os.cpu_count() or 1) for a, b in zip(whole, every, strict=True))
    if (os.cpu_count() or 1) > 1:
        one = machine_cpu(frozenset({0}))
        assert one[0] + one[1] < 0.75 * (whole[0] + whole[1])
    assert machine_cpu(frozenset({10**6})) is None  # no such CPU: nothing to read


def test_a_process_under_a_cgroup_memory_limit_counts_the_limit_as_its_memory():
    """A real cgroup (v1, as this machine mounts its memory controller) with a 1 GiB
    limit: a process in it reports 1 GiB of host memory, not the host's RAM, the dataset
    cache and init's probe plan within what the limit leaves, and doctor says so."""
    import json

    with memory_cgroup(2**30) as run:
        code = ("import json; from tuner.hardware import describe, available_memory, memory_limit; "
                "from tuner.apply import cache_room; "
                "print(json.dumps([describe()['host_memory_mb'], available_memory(), cache_room(), memory_limit()]))")
        out = run(sys.executable, "-c", code)
        assert out.returncode == 0, out.stderr
        host_mb, free, room, (limit, used) = json.loads(out.stdout.strip().splitlines()[-1])
        assert host_mb == 1024 and limit == 2**30 and 0 < used < 2**30
        assert free == 2**30 - used and room == int(free * 0.8)
        doctor = run(sys.executable, "-m", "tuner", "doctor")
        assert "1,024 MB: this process's cgroup limit" in doctor.stdout, doctor.stdout
    assert describe()["host_memory_mb"] > 1024  # this process, outside it, is not limited so


def test_a_cgroup_v2_limit_of_the_cgroup_or_a_parent_is_read_and_none_is_no_limit(tmp_path):
    """cgroup v2's files, written to a folder: this machine binds its memory controller
    to v1, so no v2 memory limit can exist here. The tightest of the cgroup and its
    parents counts; `max`, or a path that does not exist (a container's own cgroup is
    its root), is passed over; the inactive page cache is not counted as in use."""
    from tuner.hardware import memory_limit

    proc = tmp_path / "cgroup"
    proc.write_text("garbled\n0::/job/step\n")
    root = tmp_path / "fs"
    for rel, limit, current, inactive in (("", None, None, None), ("job", "8589934592", "4294967296", 2**30),
                                          ("job/step", "max", "1073741824", 0)):
        d = root / rel
        d.mkdir(parents=True, exist_ok=True)
        if limit is not None:
            (d / "memory.max").write_text(limit + "\n")
            (d / "memory.current").write_text(current + "\n")
            (d / "memory.stat").write_text(f"anon 5\ninactive_file {inactive}\nactive_file 7\n")
    assert memory_limit(str(proc), str(root)) == (8 * 2**30, 3 * 2**30)
    (root / "job" / "step" / "memory.max").write_text("2147483648\n")  # the step's own is tighter
    assert memory_limit(str(proc), str(root)) == (2 * 2**30, 2**30)
    proc.write_text("0::/elsewhere/deep\n")  # not under this root: only its root counts, which has none
    assert memory_limit(str(proc), str(root)) is None
    assert memory_limit(str(tmp_path / "missing"), str(root)) is None
