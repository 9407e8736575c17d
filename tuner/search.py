"""``tuner run``: the search, with Ray Tune scheduling trials and Optuna choosing them.

Order of a search:

1. validate the space and import the workload (errors before Ray starts);
2. start Ray (in-process) or attach to ``--address``;
3. measure the baseline (the plain PyTorch loop) as a Ray task;
4. ``Tuner.fit`` with ``OptunaSearch`` (our ``GuidedSampler`` by default, Optuna's
   study kept in a journal file); the first trials are PyTorch's defaults in the
   optimized loop and the guides' recommended config (and, on CPUs, the same with the
   other splits of the cores); one trial per config,
   resources from the config;
   every trial runs in its own process (``tuner.trial.run_isolated``) so that a
   hang, crash or OOM is a result, and is written to ``trials.jsonl`` as it lands;
5. re-measure the top configs (``confirm``), interleaved with the baseline, and choose
   the winner on the median of all of its measurements (on top of ``budget.trials``,
   which counts the configs tried);
6. write ``summary.json`` and print the top configs against the baseline.

The rooms it calls on: ``tuner.localray`` (Ray), ``tuner.tune_run`` (the Tune run),
``tuner.screening`` (the Board), ``tuner.study`` (records and the Optuna study).
"""

from __future__ import annotations

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
from tuner.records import (
    aggregate,
    baseline_of,
    best_of,
    cold_compile_of,
    no_winner_reason,
    pareto_front,
    rank,
    speedup,
    winner_first,
    with_cold_compile,
    within_noise,
    writer_lock,
)
from tuner.screening import Board
from tuner.study import Recorder, open_journal, repair_study, writable_results
from tuner.tables import Progress
from tuner.tune_run import SearchRun, TrialJob, fit, round_fits


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
    import ray

    m = space.model
    trials_path = out / "trials.jsonl"
    shape = cluster_shape()
    device, cpus_per_trial, gpus_per_trial, concurrent = plan_resources(space, shape)

    from tuner.trial import make_request, resolve_config

    # bf16 where the trials run (a V100 or T4 has none: the guides' bf16 start would be a
    # wasted trial), asked of a GPU node, not of this driver.
    # On CPUs: whether they run bf16 in hardware (without, the guides' bf16 start ran conv at
    # 18 samples/s against fp32's 293 here, and that one trial made the search's model
    # blame every other knob of that start).
    # Asked first: the worker that answers measures the baseline next, and its start
    # overlaps this driver's import of the workload.
    facts = (ray.remote(num_gpus=gpus_per_trial)(_gpu_facts) if device == "cuda"
             else ray.remote(num_cpus=1)(_cpu_facts)).remote()
    # The knob context of the trial machines: device kind, cores, whether the workload has sources.
    workload = resolve_config(make_request(
        workload=m.workload, workload_args=m.workload_args, base_dir=str(space.base_dir), device="cpu")).workload
    bf16_ok, cuda_ok, bf16_native = True, device == "cuda", True
    if device == "cuda":
        bf16_ok, cuda_ok = ray.get(facts)
    else:
        bf16_native = ray.get(facts)
    ctx = knobs.Context(device=device, cpu_count=shape["max_node_cpus"], has_groups=workload.groups is not None,
                        bf16_ok=bf16_ok, bf16_native=bf16_native)
    for name, values in space.domain.items():  # a GPU knob searched on CPUs is a wasted trial
        if knobs.KNOBS[name].gpu_only and device != "cuda" and len(values) > 1:
            raise UserError(f"knobs.{name}: a GPU knob, but this search runs on CPUs; remove it or fix it")
    # The first trials: PyTorch's defaults in the optimized loop, then the guides' advice.
    start = space.start_points(ctx)

    recorder = Recorder(trials_path, ctx)
    local_ray = ray_start_s > 0 and not attached()  # a Ray started here, on this machine only
    screening = m.objective.metric == "samples_per_sec" and not m.objective.memory and m.measure.screen_windows > 0
    job = TrialJob(
        workload=m.workload, workload_args=m.workload_args, base_dir=str(space.base_dir),
        device=m.device, measure=search_measure(space), run=m.run.model_dump(), seed=m.seed,
        trial_timeout_s=m.budget.trial_timeout_s, constraints=m.constraints, objective=m.objective,
        fixed=space.fixed, derive=space.derive, cpus_per_trial=cpus_per_trial, gpus_per_rank=gpus_per_trial,
        spread_ranks=m.resources.spread_ranks, ddp_backend="nccl" if cuda_ok else "gloo",
        observers=tuner_processes(local=local_ray),
        # One inductor cache per compile group, per node, for this search (kept for resume).
        compile_root=os.path.join(tempfile.gettempdir(), "tuner-compile-" + hashlib.sha1(
            f"{out}:{meta_created(out)}".encode()).hexdigest()[:12]),
        # one trial at a time: the driver's loop sleeps through its timed windows
        hush_dir=tempfile.mkdtemp(prefix="tuner-hush-") if concurrent == 1 else None,
        nice=os.getpriority(os.PRIO_PROCESS, 0),
    )
    board = Board(screening=screening, recheck_after=m.measure.recheck_after)
    try:
        for r in recorder.records:  # a resumed search: what was measured before
            if r.get("phase") in ("search", "recheck", "confirm"):
                board.update(r)
        run = SearchRun(space, ctx, job, out, recorder, progress, concurrent, t_search=time.time(), board=board,
                        watch=Watch(out, grace_s=m.budget.trial_timeout_s))

        previous = [r for r in recorder.records if r.get("phase") == "search"]
        baseline_rec = next((r for r in recorder.records if r.get("phase") == "baseline"), None)
        if baseline_rec is None:
            progress.update(msg="measuring the baseline (plain PyTorch loop)")
            [baseline_rec] = run.measure_all([(space.baseline_config(), True)])
            baseline_rec["phase"] = "baseline"
            recorder.add(baseline_rec)
        if baseline_rec.get("status") == "ok" and not baseline_rec.get("disturbed"):
            # (a baseline measured on a disturbed machine would inflate every "x baseline";
            # the summary's comes from all of its rounds)
            progress.baseline = baseline_rec.get(m.objective.metric)

        # -- the search proper
        remaining = max(0, m.search_trials() - len({r["key"] for r in previous}))
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = open_journal(space, out, progress)
        if previous:
            repair_study(space, ctx, storage, previous)
        if remaining > 0:
            fit(run, start, storage, remaining, previous,
                 ray_name="ray" if sessions == 0 else f"ray-resume-{sessions}")

        # -- confirm: re-measure the top configs in interleaved rounds (A B C base, A B C
        #    base: a drift of the machine hits every contender and the baseline alike) and
        #    choose on the median of all measurements.
        if confirms(space):
            _confirm(run, baseline_rec)
        search_wall_s = time.time() - run.t_search

        summary = summarize(space, recorder.records, baseline_of(recorder.records, m.objective.metric) or baseline_rec,
                            describe_cluster=shape,
                            search_wall_s=search_wall_s, ray_start_s=ray_start_s, device=device, out_folder=out)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        return summary
    finally:
        if job.hush_dir:
            shutil.rmtree(job.hush_dir, ignore_errors=True)


def confirms(space: spec.Space) -> bool:
    """Whether the search ends with confirm rounds."""
    return space.model.confirm_measurements() > 0


def search_measure(space: spec.Space) -> dict:
    """How a search measures each config: the space's ``measure`` settings, except that
    with confirm rounds to follow every measurement stops at ``min_windows``. Precision
    then comes from repeats: the contenders and the baseline are measured again in
    interleaved rounds and their figures pooled, which a drift of the machine hits
    alike, where more windows in one go would not. On this 2-core VM a window's figure
    spreads 10-15%, so the 1% error target sent every contender to ``max_windows``: a
    third of a search's time for a precision the confirm rounds then re-measured."""
    settings = space.model.measure.model_dump()
    if confirms(space):
        settings["max_windows"] = settings["min_windows"]
    return settings


def _confirm(run: SearchRun, baseline_rec: dict) -> None:
    """Interleaved rounds over the contenders and the baseline (A B C base, A B C base:
    a drift of the machine hits every contender and the baseline alike).

    The contenders are the top ``confirm.top`` configs still within noise of the leader;
    after each round the ranking is redone, and the rounds stop once a single contender
    is left within noise (the order is clear), after ``confirm.repeats`` rounds, or once
    the confirm rounds' share of ``budget.trials`` is spent (a round that does not fit
    whole keeps its best contenders and the baseline). A round's measurements run
    concurrently where trials can (several GPUs), one after the other on a CPU machine,
    in order. Under a time budget, a round after the first starts only if it fits.
    """

    m, recorder, progress = run.space.model, run.recorder, run.progress
    metric = m.objective.metric
    # A resumed search: what the rounds already measured is spent, and the last round
    # they reached is taken up again (it may have been cut short) with what is left.
    done = [r for r in recorder.records if r.get("confirm_round")]
    left = m.confirm_measurements() - len(done)
    reached = max((r["confirm_round"] for r in done), default=0)
    first = reached - 1 if reached and left > 0 else reached
    for rnd in range(first, m.confirm.repeats):
        # the search proper kept time for one round; another starts only if it fits
        if m.budget.time_s is not None and (time.time() - run.t_search >= m.budget.time_s
                                            or rnd > first and not round_fits(run)):
            progress.update(msg="time budget spent: no more confirm rounds")
            break
        contenders = within_noise(rank(aggregate(recorder.records, metric), metric), metric)[: m.confirm.top]
        if left < 1 or not contenders or (rnd > 0 and len(contenders) < 2):
            break  # the first round always runs: the winner is chosen on repeated figures
        with_base = baseline_rec.get("status") == "ok" and left >= 2
        batch = [(row["config"], False) for row in contenders[: left - with_base]]
        if with_base:
            batch.append((baseline_rec["config"], True))
        left -= len(batch)
        progress.update(msg=f"confirm round {rnd + 1}/{m.confirm.repeats}: re-measuring {len(batch) - with_base} "
                            f"contender(s) within noise of the leader" + (" and the baseline" if with_base else "")
                            + ", interleaved")
        step = max(1, run.concurrent)
        for i in range(0, len(batch), step):
            group = batch[i:i + step]
            for (_, is_base), rec in zip(group, run.measure_all(group), strict=True):
                rec["phase"] = "baseline" if is_base else "confirm"
                rec["confirm_round"] = rnd + 1
                recorder.add(with_cold_compile(rec, cold_compile_of(recorder.records, rec.get("compile_group"))))


def _gpu_facts() -> tuple[bool, bool]:
    """On the GPU a trial gets: (bf16 supported, CUDA there at all). Logical GPUs (Ray's
    num_gpus on a CPU machine, as the tests declare) have no CUDA: bf16 runs on the CPU,
    and the ranks of a multi-rank trial talk over gloo, not NCCL."""
    import torch

    if not torch.cuda.is_available():
        return True, False
    return bool(torch.cuda.is_bf16_supported()), True


def _cpu_facts() -> bool:
    """On a trial node's CPU: whether it runs bf16 in hardware. A plain function, because
    Ray's remote() takes functions and classes, not the lru_cache wrapper."""
    from tuner.hardware import cpu_has_bf16

    return cpu_has_bf16()


def summarize(space: spec.Space, records: list[dict], baseline: dict, *, describe_cluster: dict,
              search_wall_s: float, ray_start_s: float, device: str, out_folder: Path | str = "") -> dict:
    """summary.json: best (config + metrics), baseline, speedup, pareto, hardware, search figures."""
    m = space.model
    metric = m.objective.metric
    rows = aggregate(records, metric)
    ranked = rank(rows, metric)
    best = best_of(ranked)
    base_value = baseline.get(metric) if baseline.get("status") == "ok" else None
    best_speedup = speedup(best[metric], base_value, metric) if best is not None else None
    in_trial = sum(r.get("trial_wall_s") or 0.0 for r in records)
    search = [r for r in records if r.get("phase") == "search"]
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
        "top": [_public(r) for r in winner_first(ranked, best)[:5]],
        "pareto": [_public(r) for r in pareto_front(rows, metric)] if m.objective.memory else None,
        "infeasible": [{"config": r["config"], "reason": r["reason"]} for r in rows if not r["feasible"]],
        "trials": len(search),
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
    if row is None:
        return None
    return {k: v for k, v in row.items() if k not in ("key",)}
