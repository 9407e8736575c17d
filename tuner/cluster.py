"""Ray Jobs submission of a search to a running cluster, and ``tuner doctor``.

``submit`` ships the space file, the user's workload file (with the modules it
imports from its own folder) and this ``tuner`` package in the job's runtime environment and runs ``python -m tuner run`` on
the cluster against it (``--address auto``). Results land on the cluster, in
``--results-dir`` (a shared filesystem path is the easy way to read them back).
Token authentication (``RAY_AUTH_MODE=token`` with ``RAY_AUTH_TOKEN`` or
``~/.ray/auth_token``) is picked up by Ray's client as it is.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tuner import spec
from tuner.errors import UserError

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def stage(space: spec.Space, staging: Path) -> str:
    """Copy what the job needs into ``staging``: the space, the workload file and the modules
    it imported from its own folder (and below), at the same relative paths.

    Returns the space file's name inside the staging folder. The workload has been loaded in
    this process (``spec.check_workload``), so ``sys.modules`` names what it imported. A
    workload given as a module path must be importable on the cluster (installed there, or
    put it in a file).
    """
    m = space.model
    ref = m.workload
    if ":" in ref:
        target, func = ref.rsplit(":", 1)
        if target.endswith(".py"):
            src = Path(target)
            src = (src if src.is_absolute() else space.base_dir / src).resolve()
            shutil.copy2(src, staging / src.name)
            for sibling in imported_from(src.parent):
                dest = staging / sibling.relative_to(src.parent)
                dest.parent.mkdir(parents=True, exist_ok=True)
                if not dest.exists():
                    shutil.copy2(sibling, dest)
            m = m.model_copy(update={"workload": f"{src.name}:{func}"})
    import yaml

    (staging / "space.yaml").write_text(yaml.safe_dump(m.model_dump(mode="json"), sort_keys=False))
    return "space.yaml"


def imported_from(folder: Path) -> list[Path]:
    """The Python files under ``folder`` that this process has imported, installed packages and
    this tuner package left out (a virtual environment inside the user's folder included)."""
    import site
    import sysconfig

    import tuner

    skip = [Path(p).resolve() for p in (*site.getsitepackages(), site.getusersitepackages(),
                                        sysconfig.get_paths()["purelib"], Path(tuner.__file__).parent)]
    found = set()
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not file or not file.endswith(".py"):
            continue
        path = Path(file).resolve()
        # is_file: a namespace module's __file__ may be a bare name that is no file (torch.classes
        # says "_classes.py"), which resolves into the folder the search is submitted from
        if path.is_relative_to(folder) and path.is_file() and not any(path.is_relative_to(s) for s in skip):
            found.add(path)
    return sorted(found)


# What Ray's job API answers while a head is still starting (its job agent not up yet):
# worth waiting for. Anything else (a refused connection included) fails at once.
TRANSIENT = ("try again later", "no available agent", "status code 502", "status code 503",
             "status code 504")


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in TRANSIENT)


def retrying(call: Any, address: str, out: Any, wait_s: float = 60.0, sleep: Any = time.sleep) -> Any:
    """``call()``, retried with backoff (1, 2, 4, 8, 8... s) while Ray's job API answers that
    it is still starting, for at most ``wait_s``; one progress line while it waits."""
    delay, t0, said = 1.0, time.monotonic(), False
    while True:
        try:
            return call()
        except Exception as exc:
            if not _transient(exc) or time.monotonic() - t0 + delay > wait_s:
                raise
            if not said:
                print(f"{address}: the cluster is still starting ({_first_line(exc)[:100]}); "
                      f"retrying for up to {wait_s:.0f} s", file=out)
                said = True
            sleep(delay)
            delay = min(2 * delay, 8.0)


def _client(address: str, out: Any = None) -> Any:
    from ray.job_submission import JobSubmissionClient

    try:
        return retrying(lambda: JobSubmissionClient(address), address, out or sys.stderr)
    except Exception as exc:
        raise UserError(f"--address {address}: cannot reach the Ray dashboard ({_first_line(exc)})") from None


def submit(space: spec.Space, address: str, results_dir: str, *, follow: bool = False, wait: bool = False,
           out: Any = None) -> int:
    """Submit the search as a Ray Job; returns the exit status for the CLI."""
    out = sys.stdout if out is None else out  # at call time: a replaced sys.stdout is honoured
    import tuner
    from tuner.remote import SUBMITTED_ENV

    client = _client(address, out)
    staging = Path(tempfile.mkdtemp(prefix="tuner-job-"))
    try:
        name = stage(space, staging)
        entry = (f"python -m tuner run {name} --address auto --results-dir {results_dir} "
                 f"--name {space.model.name} --quiet")
        runtime_env = {"working_dir": str(staging), "py_modules": [str(Path(tuner.__file__).parent)],
                       "env_vars": {"PYTHONUNBUFFERED": "1", SUBMITTED_ENV: "1"}}
        try:
            job_id = retrying(lambda: client.submit_job(entrypoint=entry, runtime_env=runtime_env,
                                                        metadata={"tuner_search": space.model.name}),
                              address, out)
        except (RuntimeError, ConnectionError) as exc:
            raise UserError(f"--address {address}: the Ray job API refused the search ({_first_line(exc)})") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    where = results_dir if results_dir.startswith("/") or "://" in results_dir else \
        f"{results_dir} (relative to the job's working directory on the head node)"
    print(f"submitted job {job_id} to {address}", file=out)
    print(f"results: {where}/{space.model.name}/ on the cluster; follow with `ray job logs {job_id} "
          f"--address {address} --follow`", file=out)
    if not (follow or wait):
        return 0
    if follow:
        import asyncio

        async def tail() -> None:
            async for chunk in client.tail_job_logs(job_id):
                out.write(chunk)
                out.flush()

        asyncio.run(tail())
    status = _wait(client, job_id)
    if not follow:
        out.write(client.get_job_logs(job_id)[-4000:])
    print(f"job {job_id}: {status}", file=out)
    return 0 if status == "SUCCEEDED" else 1


def _wait(client: Any, job_id: str, poll_s: float = 2.0) -> str:
    while True:
        status = str(client.get_job_status(job_id)).split(".")[-1]
        if status in TERMINAL:
            return status
        time.sleep(poll_s)


# ---- doctor ----------------------------------------------------------------------------


def other_load(seconds: float = 1.0) -> tuple[float, str]:
    """The cores the machine's other processes kept busy over ``seconds``, and the busiest
    of them by name: what would disturb a search's timed windows now."""
    import os
    import time

    import psutil

    from tuner.hardware import affinity
    from tuner.hostload import machine_cpu

    me = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
    procs = [p for p in psutil.process_iter(["name"]) if p.pid not in me]
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    cores = affinity()  # a process bound to some cores is disturbed by the load on those alone
    before = machine_cpu(cores)
    time.sleep(seconds)
    after = machine_cpu(cores)
    busy = (after[0] - before[0]) / seconds if before and after else 0.0
    use = []
    for p in procs:
        try:
            use.append((p.cpu_percent(None), p.info["name"], p.pid))
        except psutil.Error:
            pass
    top = [f"{name} (pid {pid}): {pct / 100:.2f}" for pct, name, pid in sorted(use, reverse=True)[:3] if pct >= 5]
    return max(0.0, busy), ", ".join(top)


def node_facts() -> dict:
    """What this node offers a search's trials, as ``doctor`` checks it here: run on each
    node of a cluster (``node_checks``), in a Ray worker's environment, as a trial is."""
    import torch

    from tuner.data import workers_refused
    from tuner.hardware import shm_mb, usable_cores

    # The node's GPUs as its driver counts them: Ray hides them from a task that asked for
    # none (CUDA_VISIBLE_DEVICES), and this one asks for none so as to run beside trials.
    try:
        import pynvml

        pynvml.nvmlInit()
        gpus = pynvml.nvmlDeviceGetCount()
        gpu = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)) if gpus else None
        pynvml.nvmlShutdown()
    except Exception:  # no pynvml, no driver
        gpus, gpu = 0, None
    return {"cores": usable_cores(), "gpus": gpus, "gpu": gpu.decode() if isinstance(gpu, bytes) else gpu,
            "cuda_build": torch.version.cuda, "shm_mb": shm_mb(), "workers": workers_refused(),
            "torch": torch.__version__}


# How long ``doctor --address`` waits for a node's answer (a node's first task imports torch).
NODE_ANSWER_S = 120.0


def node_checks() -> list[tuple[str, bool, str, str]]:
    """(name, ok, detail, fix) for each live node of the connected Ray cluster, from
    ``node_facts`` run there: its cores, GPUs and torch, and what its DataLoader workers
    and NCCL need of it (/dev/shm, the temp folder's sockets); then whether the nodes run
    one torch. A trial runs on any node it fits, so each is checked where it is."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from tuner.hardware import SHM_USERS, shm_short

    ask = ray.remote(num_cpus=0)(node_facts)
    nodes = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeManagerAddress"])
    asked = [(n, ask.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote())
             for n in nodes]
    ray.wait([ref for _, ref in asked], num_returns=len(asked), timeout=NODE_ANSWER_S)
    ips = [n["NodeManagerAddress"] for n in nodes]
    out, versions = [], set()
    for node, ref in asked:
        ip = node["NodeManagerAddress"]
        name = f"node {ip}" + (f" {node['NodeID'][:6]}" if ips.count(ip) > 1 else "")
        try:
            f = ray.get(ref, timeout=0)
        except ray.exceptions.GetTimeoutError:
            out.append((name, False, f"no answer within {NODE_ANSWER_S:.0f} s", "check the node: `ray status`"))
            continue
        except Exception as exc:
            said = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else type(exc).__name__
            out.append((name, False, f"its check failed: {said}", "check the node's Python and torch"))
            continue
        versions.add(f["torch"])
        fix = []
        if f["shm_mb"] is not None and (short := shm_short(list(SHM_USERS), f["shm_mb"])):
            fix.append(short)
        if f["workers"]:
            fix.append(f["workers"])
        offered = node.get("Resources", {})
        cpus, ray_gpus = offered.get("CPU", 0), offered.get("GPU", 0)
        if ray_gpus and not f["gpus"]:
            fix.append(f"Ray offers {ray_gpus:g} GPU(s) here and no NVIDIA driver answers: check the driver "
                       f"(nvidia-smi), or start the node's Ray with --num-gpus=0")
        elif ray_gpus and not f["cuda_build"]:
            fix.append("its torch is a CPU build: install a CUDA build of torch on the node")
        gpus = f"{f['gpus']} GPU(s)" + (f" ({f['gpu']})" if f["gpu"] else "")
        shm = f"/dev/shm {f['shm_mb']:,.0f} MB" if f["shm_mb"] is not None else "no /dev/shm"
        out.append((name, not fix, f"{f['cores']} cores (Ray: {cpus:g} CPU{'s' * (cpus != 1)}), {gpus}, {shm}, "
                    f"torch {f['torch']}", "; ".join(fix)))
    if len(versions) > 1:
        out.append(("nodes' torch", False, f"the nodes run torch {', '.join(sorted(versions))}",
                    "install one torch on every node: trials on different builds are not comparable"))
    return out


def doctor(address: str | None = None, out: Any = None) -> int:
    """Check the environment; one line per check, OK or what to fix. Returns 0."""
    out = sys.stdout if out is None else out  # at call time: a replaced sys.stdout is honoured
    import os

    import torch

    from tuner.hardware import SHM_ENOUGH_MB, SHM_USERS, cpu_bf16, nvml_status, shm_mb, usable_cores

    lines: list[tuple[str, str, str]] = []

    def check(name: str, ok: bool | None, detail: str, fix: str = "") -> None:
        """ok None: not applicable here (said plainly, nothing to fix for a CPU run)."""
        status = {True: "OK  ", False: "FIX ", None: "--  "}[ok]
        lines.append((status, name, f"{detail} -> {fix}" if ok is False and fix else detail))

    check("torch", True, f"{torch.__version__}")
    cuda = torch.cuda.is_available()
    check("cuda", True if cuda else None,
          f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" if cuda
          else "there is no GPU here: trials run on the CPU",
          "install a CUDA build of torch and an NVIDIA driver to tune on GPUs" if torch.version.cuda is None else
          "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")
    if cuda:
        check("cudnn", torch.backends.cudnn.is_available(), f"cuDNN {torch.backends.cudnn.version()}")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            check(f"gpu {i}", True, f"{p.name}, {p.total_memory / 2**30:.1f} GiB, compute {p.major}.{p.minor}")
        check("bf16", torch.cuda.is_bf16_supported(), "bf16 supported" if torch.cuda.is_bf16_supported()
              else "no bf16 on this GPU", "use fp16 (with loss scaling) instead")
        check("fp16", True, "fp16 autocast + GradScaler")
    else:
        cap = torch.backends.cpu.get_cpu_capability()
        # AVX512-BF16 alone (no AMX tiles) can leave bf16 behind fp32
        kind = {"amx": "native AMX: fast",
                "avx512_bf16": "AVX512-BF16 without AMX: not always faster than fp32, the search measures it"
                }.get(cpu_bf16(), "no native bf16 instructions: may be slower than fp32")
        check("bf16 (CPU)", True, f"autocast works; {kind} ({cap})")
    nvml = nvml_status()
    check("nvml", True if nvml[0] else (False if cuda else None), nvml[1],
          "install nvidia-ml-py; GPU utilization/power sampling is off without it")
    cc = shutil.which(os.environ.get("CC", "")) or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    check("compile", cc is not None, f"C compiler {cc}" if cc else "no C compiler: torch.compile cannot build kernels",
          "install gcc (apt-get install gcc) or leave compile: off")
    cores = usable_cores()
    check("cpus", True, f"{cores} CPUs" if cores == os.cpu_count() else
          f"{cores} of the machine's {os.cpu_count()} CPUs are this process's (its CPU affinity or cgroup quota): "
          "trials plan threads and workers for those")
    from tuner.hardware import host_memory_mb, memory_limit

    limit = memory_limit()
    host_mb = host_memory_mb() or 0.0
    check("memory", True, f"{host_mb:,.0f} MB" + (
        f": this process's cgroup limit (a container's, a job's), under the host's RAM; peaks and headroom are "
        f"counted against it ({(limit[0] - limit[1]) / 2**20:,.0f} MB of it free)" if limit and limit[0] / 2**20 <= host_mb
        else " of host RAM"))
    from tuner.data import workers_refused

    refused = workers_refused()
    check("workers", refused is None, refused or "their sockets fit in the temp folder (TMPDIR)")
    shm = shm_mb()
    if shm is not None:  # DataLoader workers' batches in flight (workers x prefetch_factor) live there
        check("shm", shm >= SHM_ENOUGH_MB, f"/dev/shm holds {shm:,.0f} MB, where {' and '.join(SHM_USERS.values())}",
              "a few batches of images in flight need more: start the container with --shm-size=8g or --ipc=host")
    from tuner.hardware import debug_env

    left = debug_env(gpu=cuda)
    check("debug env", not left, "; ".join(left) or "no debugging switch that slows a step is set",
          "unset it for training runs: the trials measure with it, as your run would")
    busy, names = other_load()
    check("other load", busy < 0.25, f"{busy:.2f} cores busy outside this command" + (f" ({names})" if names else ""),
          "a search measures best on a quiet machine: stop that load, or raise measure.max_interference")
    if address:
        try:
            import ray

            import tuner

            # this tuner travels to the nodes, as a submitted search's does (``submit``)
            ray.init(address=address, logging_level="ERROR", log_to_driver=False,
                     runtime_env={"py_modules": [str(Path(tuner.__file__).parent)]})
            res = ray.cluster_resources()
            nodes = len([n for n in ray.nodes() if n.get("Alive")])
            check("ray cluster", True, f"{address}: {nodes} node(s), {res.get('CPU', 0):.0f} CPUs, "
                  f"{res.get('GPU', 0):.0f} GPUs")
            for name, ok, detail, fix in node_checks():
                check(name, ok, detail, fix)
            ray.shutdown()
        except Exception as exc:
            check("ray cluster", False, f"{address}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                  "start one with `ray start --head` or fix --address")
    else:
        check("ray", True, "no --address: `tuner run` starts a local Ray with this machine's CPUs/GPUs")
    for status, name, detail in lines:
        print(f"{status} {name:<12} {detail}", file=out)
    return 0
