"""What a result was measured on (tuner/hardware.py) and the peak FLOP/s table."""

import torch

from tuner.hardware import cpu_bf16, cpu_has_bf16, describe, nvml_status, pick_device


def test_describe_names_the_machine_and_versions():
    hw = describe()
    assert hw["cpu_count"] >= 1 and hw["torch"] == torch.__version__ and hw["ray"] and hw["optuna"]
    assert (hw["gpu"] is not None) == torch.cuda.is_available()
    assert pick_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    # plain Python values: a record that carries them unpickles without importing torch
    assert all(type(v).__module__ == "builtins" for v in hw.values()), hw


def test_probes_read_this_machine():
    # the real /proc/cpuinfo and the real NVML: no driver here means a reason, not a crash
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
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
