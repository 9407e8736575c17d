"""A measurement on a Ray worker: what every measurement of a search shares
(``TrialJob``), the config measured in a child process (``measure_config``), and the Ray
Tune trainable that hands it to an idle worker of its node (``trainable``). Workers
import this module: it imports neither Ray nor torch at its top."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tuner import knobs
from tuner.records import Record, apply_constraints, logged_metrics
from tuner.settings import HUSH_ENV


@dataclass
class TrialJob:
    """What every measurement of one search shares: each Tune trial gets it from Ray
    (so it holds nothing that cannot be pickled)."""

    workload: str
    workload_args: dict
    base_dir: str
    device: str  # as the space asks: auto, cpu or cuda
    measure: dict
    run: dict
    seed: int
    trial_timeout_s: float
    constraints: Any
    cpus_per_trial: Callable[[dict], float]
    gpus_per_rank: int
    spread_ranks: bool = False
    ddp_backend: str = "gloo"
    observers: list[int] = field(default_factory=list)  # the tuner's own processes beside a trial
    compile_root: str | None = None  # one inductor cache per compile group under it
    hush_dir: str | None = None  # where a trial in its timed windows says so (``measure.hushed``)
    nice: int = 0  # the driver's niceness: trials run at it, not at Ray's worker niceness
    user_threads: str | None = None  # the driver's OMP_NUM_THREADS: the user's runs read it


# Set in a submitted search's environment: its driver runs under Ray's job supervisor, whose
# OMP_NUM_THREADS is Ray's (1), not a user's.
SUBMITTED_ENV = "TUNER_SUBMITTED"


def user_threads() -> str | None:
    """The OMP_NUM_THREADS the user started this search with, which their own runs read
    (``TrialJob.user_threads``); None where they set none, or in a submitted Ray job."""
    return None if os.environ.get(SUBMITTED_ENV) else os.environ.get("OMP_NUM_THREADS")


def _threads_env(job: TrialJob) -> dict:
    """The trial's OMP_NUM_THREADS where the user started the search with one; else none,
    and PyTorch chooses in the trial as in the user's own run (``TrialRequest.threads_cap``)."""
    return {"OMP_NUM_THREADS": job.user_threads} if job.user_threads else {}


def _compile_cache(knob_config: dict, job: TrialJob) -> str | None:
    key = compile_group_key(knob_config, job.workload, job.workload_args)
    if key is None or not job.compile_root:
        return None
    return os.path.join(job.compile_root, key)  # on the node that runs the trial


def compile_group_key(knob_config: dict, workload: str, workload_args: dict) -> str | None:
    """The compile group of a config (None when it does not compile)."""
    if knob_config.get("compile", "off") == "off":
        return None
    import hashlib

    what = [workload, workload_args, knobs.compile_group(knob_config)]
    return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class Placement:
    """What Ray gave the Tune trial that hands its measurement to another worker
    (``_measure``): that worker holds no GPU and no CPU of its own."""

    gpu_ids: list[str]
    visible: str | None  # CUDA_VISIBLE_DEVICES
    holder: int  # the trial actor's process, idle beside the trial: not load


def measure_config(knob_config: dict, job: TrialJob, baseline: bool = False, screen: dict | None = None,
                   placement: Placement | None = None) -> Record:
    """Measure one config in a child process, or through Ray Train when it has several
    ranks; returns the record (never raises). ``placement``: the resources of the Tune
    trial this measures for, when that is not this process."""
    from tuner.trial import make_request, run_isolated

    env = _threads_env(job)
    cpus = job.cpus_per_trial(knob_config)
    visible = placement.visible if placement else os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    if job.hush_dir:
        env[HUSH_ENV] = job.hush_dir
    request = make_request(workload=job.workload, workload_args=job.workload_args,
                           base_dir=job.base_dir, config=knob_config, baseline=baseline,
                           device=job.device, measure=job.measure, run=job.run,
                           seed=job.seed, env=env,
                           observers=[os.getpid(), *([placement.holder] if placement else []), *job.observers],
                           screen=screen,
                           compile_cache=_compile_cache(knob_config, job), nice=job.nice,
                           threads_cap=int(cpus))
    started = time.time()
    world = int(knob_config.get("world_size", 1))
    if world > 1:
        from tuner.distributed import run_ranks

        record = run_ranks(request, timeout_s=job.trial_timeout_s, spread=job.spread_ranks,
                           use_gpu=job.gpus_per_rank > 0, backend=job.ddp_backend)
    else:
        record = run_isolated(request, timeout_s=job.trial_timeout_s)
    record.update(started_at=started, ended_at=time.time())
    record.pop("traceback", None)
    import ray

    if ray.is_initialized():
        record["node"] = ray.get_runtime_context().get_node_id()
        record["node_ip"] = ray.util.get_node_ip_address()
        record["gpu_ids"] = placement.gpu_ids if placement else [str(g) for g in ray.get_gpu_ids()]
    else:  # outside Ray (tests of this function), where asking for the node would start a Ray
        record["node"], record["gpu_ids"] = None, []
    record["cpus_reserved"] = cpus if world == 1 else world * knobs.process_cpus(knob_config)
    record["compile_group"] = compile_group_key(knob_config, job.workload, job.workload_args)
    record["workload"] = {"ref": job.workload, "args": job.workload_args}
    hw = record.get("hardware") or {}
    record["gpu_model"] = hw.get("gpu")
    return apply_constraints(record, job.constraints)


def measure_on_worker(knob_config: dict, job: TrialJob, baseline: bool = False, screen: dict | None = None) -> Record:
    """``measure_config`` for a Tune trial, run by an idle worker of this node rather
    than by the trial's actor: one worker for every measurement of the search, so that
    the baseline, the trials and the confirm rounds start their processes from one
    parent, in one environment. It takes no resources: the actor holds the trial's. A config
    with several ranks is driven from the actor, through Ray Train."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if int(knob_config.get("world_size", 1)) > 1:
        return measure_config(knob_config, job, baseline=baseline, screen=screen)
    placement = Placement(gpu_ids=[str(g) for g in ray.get_gpu_ids()],
                          visible=os.environ.get("CUDA_VISIBLE_DEVICES"), holder=os.getpid())
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    task = ray.remote(measure_config).options(num_cpus=0, max_retries=0, scheduling_strategy=here)
    return ray.get(task.remote(knob_config, job, baseline=baseline, screen=screen, placement=placement))


def check_configs(configs: dict[str, tuple[dict, bool]], job: TrialJob) -> dict:
    """The hot-path check (``tuner.hotpath``) of each named ``(config, baseline)``, in one
    fresh process as a trial runs (the first config's compile cache); a check that fails
    says why in its place."""
    from dataclasses import replace

    from tuner.trial import make_request, run_isolated

    # every rank runs the same user code: one rank is checked
    named = [(name, {**config, "world_size": 1}, baseline) for name, (config, baseline) in configs.items()]
    first = named[0][1]
    env = _threads_env(job)
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    request = replace(make_request(workload=job.workload, workload_args=job.workload_args,
                                   base_dir=job.base_dir, config=first, baseline=named[0][2],
                                   device=job.device, measure=job.measure, run=job.run, seed=job.seed,
                                   env=env, compile_cache=_compile_cache(first, job), nice=job.nice,
                                   threads_cap=int(job.cpus_per_trial(first))),
                      check_hot_path=True, also_check=[(c, b) for _, c, b in named[1:]])
    record = run_isolated(request, timeout_s=job.trial_timeout_s * len(named))
    if record.get("status") != "ok" or not record.get("hot_path"):
        return {name: {"error": record.get("reason") or str(record.get("status"))} for name, _, _ in named}
    results = [record["hot_path"], *record.get("hot_path_also", [])]
    return {name: result for (name, _, _), result in zip(named, results, strict=True)}


def trainable(config: dict, job: TrialJob) -> None:
    """The Ray Tune trainable: one measurement (``tuner.policy.Task`` as ``task_config``
    gives it), reported once, its record whole."""
    from ray import tune

    record = measure_on_worker(config["knobs"], job, baseline=config["phase"] == "baseline", screen=config["screen"])
    record["trial_id"] = tune.get_context().get_trial_id()
    tune.report({**logged_metrics(record), "record": json.dumps(record, default=str)})


def task_config(task: Any) -> dict:
    """What a Tune trial gets of a ``tuner.policy.Task``: plain data, the knobs apart (what
    the loggers record as its parameters)."""
    return {"knobs": task.config, "phase": str(task.phase), "screen": task.screen}


def driver_bundle(config: dict, cpus_per_trial: Callable[[dict], float], gpus_per_trial: int) -> dict:
    """What the Ray task or Tune trial that measures ``config`` reserves: the trial's
    CPUs and GPUs; nothing for several ranks, which reserve their own through Ray
    Train (``tuner.distributed``) beside the trial that drives them."""
    if config.get("world_size", 1) > 1:
        return {}
    bundle = {"CPU": cpus_per_trial(config)}
    if gpus_per_trial:
        bundle["GPU"] = gpus_per_trial
    return bundle
