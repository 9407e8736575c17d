"""``tuner run``: the search, with Ray Tune scheduling trials and the search policy
(``tuner.policy``, Optuna inside) choosing them.

Order of a search:

1. validate the space and import the workload (errors before Ray starts);
2. write the results folder (``meta.json``, ``space.yaml``) and start Ray (in-process)
   or attach to ``--address``;
3. hand the policy to Ray Tune (``tuner.tune_run.drive``): every measurement it decides,
   the baseline, the configs tried, the rechecks and the confirm rounds, is a Tune trial
   measured in its own process, and written to ``trials.jsonl`` as it lands;
4. write ``summary.json`` (the pick) and print the top configs against the baseline.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from tuner import knobs, spec
from tuner.capacity import Watch, cluster_shape
from tuner.errors import Stopped, UserError
from tuner.localray import (
    attached,
    keep_sigterm,
    link_ray_logs,
    shutdown_ray,
    start_ray,
    tuner_processes,
)
from tuner.policy import SearchPolicy, measure_settings
from tuner.records import (
    aggregate,
    baseline_drift,
    baseline_of,
    best_of,
    configs_tried,
    no_winner_reason,
    pareto_front,
    rank,
    winner_first,
    with_speedups,
    writer_lock,
)
from tuner.remote import TrialJob, user_threads
from tuner.study import Recorder, open_journal, writable_results
from tuner.tables import Progress


def meta_created(out: Path) -> str:
    """When the search in ``out`` was created (meta.json), to tell searches of one name apart."""
    try:
        return str(json.loads((out / "meta.json").read_text()).get("created"))
    except (OSError, ValueError):
        return ""


def plan_resources(space: spec.Space, shape: dict) -> tuple[str, Callable[[dict], float], int, int]:
    """(device, cpus_per_trial(config), gpus_per_trial, max_concurrent)."""
    requested = space.model.device
    gpus_total = shape["gpus"]
    device = "cuda" if (requested == "cuda" or (requested == "auto" and gpus_total > 0)) else "cpu"
    if device == "cuda" and gpus_total == 0:
        raise UserError("device: 'cuda' was asked for but the Ray cluster has no GPUs")
    if device == "cpu" and space.model.objective.metric == "samples_per_joule":
        raise UserError("objective.metric: samples_per_joule is measured from the GPUs' power (NVML); "
                        "this search runs on CPUs: use samples_per_sec")
    node_cpus = max(1, shape["max_node_cpus"])
    gpt = space.model.resources.gpus_per_trial if device == "cuda" else 0
    if device == "cuda" and gpt == 0:
        raise UserError("resources.gpus_per_trial: a GPU search needs at least 1 GPU per trial")
    if gpt > gpus_total:
        raise UserError(f"resources.gpus_per_trial: {gpt} GPUs per trial but the cluster has {gpus_total}")
    if space.model.resources.max_concurrent:
        concurrent = space.model.resources.max_concurrent
    elif device == "cuda":
        concurrent = max(1, gpus_total // gpt)  # one trial per GPU (or GPU group)
    else:
        concurrent = 1  # CPU trials disturb each other's timing: one at a time
    exclusive = device == "cpu" and concurrent == 1

    def cpus_per_trial(config: dict) -> float:
        if exclusive:
            return node_cpus  # the trial owns the machine; its threads may use every core
        return min(node_cpus, knobs.process_cpus(config))

    return device, cpus_per_trial, gpt, concurrent


def run_search(space: spec.Space, *, results_root: Path, address: str | None = None,
               resume: bool = False, quiet: bool = False) -> dict:
    """Run the search and write results/<name>/; returns the summary."""

    m = space.model
    spec.check_name(m.name)
    out = (results_root / m.name).resolve()
    with writable_results(out), writer_lock(out):  # one writer per results folder: a second run/resume is refused
        trials_path = out / "trials.jsonl"
        if trials_path.exists() and trials_path.stat().st_size > 0 and not resume:  # empty: nothing ran
            raise UserError(f"name: results for '{m.name}' already exist in {out}; continue them with "
                            f"`python -m tuner resume {out}` or pick another --name")
        if resume and not trials_path.exists():
            raise UserError(f"{out} holds no search to resume (no trials.jsonl)")
        progress = Progress(m.search_trials(), m.objective.metric, quiet)
        started = False
        try:  # from the folder's first file on, a stop says how to resume it
            if not resume:
                # Where the workload lives and the resolved space (CLI overrides applied):
                # resume reads these. A search stopped before its first trial is resumed
                # like any other. space.yaml comes last and whole: where it is, the folder
                # resumes.
                (out / "meta.json").write_text(json.dumps({
                    "space_file": str(space.path) if space.path else None, "base_dir": str(space.base_dir),
                    "created": time.time(), "tuner": __import__("tuner").__version__}, indent=1))
                trials_path.touch()
                part = out / "space.yaml.part"
                part.write_text(yaml.safe_dump(m.model_dump(mode="json"), sort_keys=False))
                part.replace(out / "space.yaml")
            sessions = len([p for p in out.glob("ray*") if p.name == "ray" or p.name.startswith("ray-resume-")])
            progress.update(msg="starting Ray")
            t_ray = time.time()
            with keep_sigterm():
                # Ray Train, which runs a trial's ranks, reads Ray's state API
                started = start_ray(address, state_api=max(space.domain.get("world_size", [1])) > 1)
            Stopped.check()  # a stop that landed in Ray's imports
            ray_start_s = time.time() - t_ray
            link_ray_logs(out)
            return _search(space, out, progress, ray_start_s, sessions)
        except KeyboardInterrupt as exc:
            # Every trial in flight is cut; what was measured is on disk (each record is
            # written as it lands), and resume runs the rest.
            raise Stopped(Stopped.signal_of(exc), str(out) if (out / "space.yaml").exists() else None) from None
        finally:
            progress.close()
            if started and not address:
                # ends the trials' actors, and with them their processes; a Ray the caller
                # started (ray.init before run_search) is the caller's to end
                shutdown_ray(out / "ray-shutdown.log")


def _search(space: spec.Space, out: Path, progress: Progress, ray_start_s: float, sessions: int) -> dict:
    import optuna

    from tuner.tune_run import drive

    m = space.model
    shape = cluster_shape()
    device, cpus_per_trial, gpus_per_trial, concurrent = plan_resources(space, shape)
    ctx, cuda_there = trial_context(space, device, gpus_per_trial, shape, progress.note)
    for over in space.beyond_cores(ctx.cpu_count):
        progress.note(f"{over}: configs with them oversubscribe the cores, and are measured as written")
    if device == "cuda":
        per_node = min(concurrent, max(1, shape["max_node_gpus"] // max(1, gpus_per_trial)))
        for over in spec.beyond_share(space.domain, shape["max_node_cpus"], per_node):
            progress.note(f"{over}: with them fewer trials run at once")
    recorder = Recorder(out / "trials.jsonl")
    local_ray = ray_start_s > 0 and not attached()  # a Ray started here, on this machine only
    job = TrialJob(
        workload=m.workload, workload_args=m.workload_args, base_dir=str(space.base_dir),
        device=m.device, measure=measure_settings(space), run=m.run.model_dump(), seed=m.seed,
        trial_timeout_s=m.budget.trial_timeout_s, constraints=m.constraints,
        cpus_per_trial=cpus_per_trial, gpus_per_rank=gpus_per_trial,
        spread_ranks=m.resources.spread_ranks, ddp_backend="nccl" if cuda_there else "gloo",
        user_threads=user_threads(),
        observers=tuner_processes(local=local_ray),
        # One inductor cache per compile group, per node, for this search (kept for resume).
        compile_root=os.path.join(tempfile.gettempdir(), "tuner-compile-" + hashlib.sha1(
            f"{out}:{meta_created(out)}".encode()).hexdigest()[:12]),
        # one trial at a time: the driver's loop sleeps through its timed windows
        hush_dir=tempfile.mkdtemp(prefix="tuner-hush-") if concurrent == 1 else None,
        nice=os.getpriority(os.PRIO_PROCESS, 0),
    )
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    policy = SearchPolicy(space, ctx, storage=open_journal(out, progress), records=recorder.previous,
                          sink=recorder.add)
    base = baseline_of(recorder.previous, m.objective.metric)
    if base and base.get("status") == "ok" and not base.get("disturbed"):
        progress.baseline = base.get(m.objective.metric)
    progress.tried = configs_tried(policy.records)  # a resumed search's, so far
    started = time.time()
    try:
        drive(policy, job, recorder=recorder, progress=progress, concurrent=concurrent, started=started,
              watch=Watch(out, grace_s=m.budget.trial_timeout_s), log_to=m.log_to, name=m.name,
              ray_name="ray" if sessions == 0 else f"ray-resume-{sessions}")
    finally:
        if job.hush_dir:
            shutil.rmtree(job.hush_dir, ignore_errors=True)
    search_wall_s = time.time() - started
    records = policy.records
    summary = summarize(space, records, baseline_of(records, m.objective.metric) or {"config": None},
                        describe_cluster=shape, search_wall_s=search_wall_s, ray_start_s=ray_start_s,
                        device=device, out_folder=out, session=records[len(recorder.previous):])
    summary["hot_path"] = check_hot_path(summary, job, cpus_per_trial, gpus_per_trial, progress,
                                         spent=bool(policy.ended and "time budget" in policy.ended),
                                         off=not m.hot_path)
    # what ``benchmarks/search_replay.py --check-live`` needs to decide as this search did
    summary["policy"] = {"context": dataclasses.asdict(ctx), "ended": policy.ended, "started_at": started,
                         "ended_at": search_wall_s, "resumed": bool(recorder.previous)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def check_hot_path(summary: dict, job: TrialJob, cpus_per_trial: Callable[[dict], float], gpus_per_trial: int,
                   progress: Progress, spent: bool = False, off: bool = False) -> dict | None:
    """The hot-path check of the baseline and the pick, once per search, after it (in no
    measurement's time), on a Ray worker holding a trial's resources; ``off``: the space
    says ``hot_path: false``."""
    configs = {}
    if summary.get("best"):  # first: its compile cache is the one the check's process gets
        configs["pick"] = (summary["best"]["config"], False)
    if summary["baseline"].get("config"):
        configs["baseline"] = (summary["baseline"]["config"], True)
    if not configs:
        return None
    if spent or off:
        why = "the time budget was spent" if spent else "hot_path: false"
        return {"error": f"{why}; run `python -m tuner profile` on the results folder"}
    import ray

    from tuner.remote import check_configs

    progress.update(msg="checking the hot path of the baseline and the pick")
    config = next(iter(configs.values()))[0]
    task = ray.remote(check_configs).options(num_cpus=cpus_per_trial(config), num_gpus=gpus_per_trial,
                                             max_retries=0)
    try:
        return ray.get(task.remote(configs, job))
    except Exception as exc:  # the search's results stand without it
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}


def trial_context(space: spec.Space, device: str, gpus_per_trial: int, shape: dict,
                  note: Callable[[str], None]) -> tuple[knobs.Context, bool]:
    """The knob context of the machines the trials run on, and whether their GPUs are
    CUDA's (logical GPUs are not: their ranks talk over gloo): the device kind, the cores,
    whether the workload has sources, and what bf16 does there, asked of a trial node
    rather than of this driver (a V100 or T4 has no bf16: the guides' bf16 start would be
    a wasted trial; a CPU without bf16 in hardware runs it several times slower than
    fp32, and that one trial would make the search's model blame every other knob of its
    start). Asked first: the worker that answers measures the baseline next, and its start
    overlaps this driver's import of the workload. A node where Ray counts more CPUs than
    a trial's process can use gets a ``note``."""
    import ray

    from tuner.workloads import load_workload, workload_facts

    m = space.model
    facts = (ray.remote(num_gpus=gpus_per_trial)(_gpu_facts) if device == "cuda"
             else ray.remote(num_cpus=1)(_cpu_facts)).remote()
    workload = load_workload(m.workload, m.workload_args, space.base_dir)
    bf16_ok, bf16_native, cuda_there = True, True, False
    if device == "cuda":
        bf16_ok, cuda_there, usable = ray.get(facts)
    else:
        bf16_native, usable = ray.get(facts)
    if usable < shape["max_node_cpus"]:
        # a `ray start` in a Slurm allocation or a container counts the node's cores
        note(f"Ray counts {shape['max_node_cpus']} CPUs on a node where a trial's process can use {usable} "
             f"(its CPU affinity or cgroup quota): trials plan threads and workers for cores they do not have; "
             f"start Ray there with --num-cpus {usable}")
    for name, values in space.domain.items():  # a GPU knob searched on CPUs is a wasted trial
        if knobs.KNOBS[name].gpu_only and device != "cuda" and len(values) > 1:
            raise UserError(f"knobs.{name}: a GPU knob, but this search runs on CPUs; remove it or fix it")
    return knobs.Context(device=device, cpu_count=shape["max_node_cpus"], **workload_facts(workload),
                         bf16_ok=bf16_ok, bf16_native=bf16_native), cuda_there


def _gpu_facts() -> tuple[bool, bool, int]:
    """On the GPU a trial gets: (bf16 supported, CUDA there at all, the cores a trial's
    process can use). Logical GPUs (Ray's num_gpus on a CPU machine, as the tests declare)
    have no CUDA: bf16 runs on the CPU, and the ranks of a multi-rank trial talk over
    gloo, not NCCL."""
    import torch

    from tuner.hardware import usable_cores

    if not torch.cuda.is_available():
        return True, False, usable_cores()
    return bool(torch.cuda.is_bf16_supported()), True, usable_cores()


def _cpu_facts() -> tuple[bool, int]:
    """On a trial node's CPU: (whether it runs bf16 in hardware, the cores a trial's
    process can use). A plain function, because Ray's remote() takes functions and
    classes, not the lru_cache wrapper."""
    from tuner.hardware import cpu_has_bf16, usable_cores

    return cpu_has_bf16(), usable_cores()


def summarize(space: spec.Space, records: list[dict], baseline: dict, *, describe_cluster: dict,
              search_wall_s: float, ray_start_s: float, device: str, out_folder: Path | str = "",
              session: list[dict] | None = None) -> dict:
    """summary.json: best (config + metrics), baseline, speedup, pareto, hardware, search figures.
    ``session``: the records this run measured (a resumed search's wall time is this run's
    alone, and its overhead ratio holds only this run's trials); default ``records``."""
    m = space.model
    metric = m.objective.metric
    rows = with_speedups(aggregate(records, metric), records, metric)
    ranked = rank(rows, metric)
    best = best_of(ranked)
    best_speedup = best["speedup"] if best is not None else None
    in_trial = sum(r.get("trial_wall_s") or 0.0 for r in (records if session is None else session))
    verdict = None
    if best_speedup is not None and best_speedup < 1.0:
        verdict = (f"the chosen config measured {best_speedup:.2f}x the baseline (the plain PyTorch loop): "
                   f"on this machine no config searched beat the plain loop; keep your current setup")
    disturbed = sum(1 for r in records if r.get("disturbed"))
    summary = {
        "name": m.name,
        "verdict": verdict,
        "disturbed_measurements": disturbed,
        "objective": m.objective.model_dump(),
        "best": _public(best) if ranked else None,
        "no_winner": None if best is not None else no_winner_reason(records, metric, str(out_folder)),
        "baseline": {k: baseline.get(k) for k in ("config", "status", "reason", "samples_per_sec",
                                                     "samples_per_sec_spread", "projected_run_s",
                                                     "peak_host_memory_mb", "peak_device_memory_mb",
                                                     "measurements", "disturbed")},
        "speedup_vs_baseline": best_speedup,
        "baseline_drift": baseline_drift(records, metric),
        "top": [_public(r) for r in winner_first(ranked, best)[:5]],
        "pareto": [_public(r) for r in pareto_front(rows, metric)] if m.objective.memory else None,
        "infeasible": [{"config": r["config"], "reason": r["reason"]} for r in rows
                       if not r["feasible"] and not r.get("held")],
        "held": [{"config": r["config"], "reason": r["reason"]} for r in rows if r.get("held")],
        "trials": len(configs_tried(records)),
        "measurements": len(records),
        "device": device,
        "cluster": describe_cluster,
        "hardware": (best or {}).get("hardware") or baseline.get("hardware"),
        "search_wall_s": search_wall_s,
        "ray_start_s": ray_start_s,
        "in_trial_s": in_trial,
        "overhead_ratio": search_wall_s / in_trial if in_trial > 0 else None,
        "sampler": m.sampler,
        "workload": {"ref": m.workload, "args": m.workload_args},
    }
    if ranked:
        by_model: dict[str, dict] = {}
        for r in ranked:
            by_model.setdefault(r["device_model"], _public(r))
        summary["best_per_device_model"] = by_model
    return summary


def _public(row: dict | None) -> dict | None:
    """A row as summary.json holds it (with its speed-up: ``records.with_speedups``)."""
    if row is None:
        return None
    return {k: v for k, v in row.items() if k not in ("key",)}
