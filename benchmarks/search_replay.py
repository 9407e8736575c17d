"""How good the search's pick is, replayed on recorded landscapes; and whether a live
search decided as the search policy does.

The replay drives the search itself: ``tuner.policy.SearchPolicy``, the object Ray Tune
drives in a live search, with the same starts, sampler, screening, rechecks, retry room,
window caps (``tuner.policy.measure_settings``), confirm rounds and pick. What a replay
adds is a machine: a landscape (``benchmarks/landscapes/<name>.json``, next to its space
``<name>.yaml``) is the full grid of a space, each config measured once the way a search
measures it, every timed window kept in order, plus repeats for the noise between
trials. A replayed measurement of a config is its recorded windows scaled to the
config's judged rate (``judged_rates``), the first ones in their recorded order (the
start-up transient that screening sees) and the rest drawn from its later windows, all
times a factor N(1, repeat CV) for the drift between trials; as many windows as the
measurement's stopping rules take (``tuner.windows.windows_verdict``).

Strategies: ``tuner`` (the search as it ships); ``random``, ``tpe-mv`` and ``gp``
(random sampling, Optuna's multivariate TPE and its GP sampler inside the same policy:
starts, screening, confirm rounds); ``stock-tpe`` (stock Ray Tune + OptunaSearch: TPE
at Optuna's defaults, the pick the best single figure reported); ``oracle`` (a sampler
that knows the judge's rates and proposes the best configs first, inside the same policy:
no sampler finds better configs, so what it loses is the pick's noise among the best
configs, which the measurements' noise and the confirm rounds set). Each search of N
configs is its own search (``--trials N`` does the same), for N in 6, 8, 12, 16, 24.
Reported per landscape: the pick's judged rate over the landscape's best, median and
10th percentile over the seeds; the best config the search measured in full over the
landscape's best (``explored``: what a pick without noise would read, so that a shortfall
is told apart as exploration's or the pick's); and the share of screened configs within
3% of the pick.
A landscape recorded after the search's rules were frozen carries ``"held_out": true``:
no rule or constant is chosen on it, and the results page shows it apart.

    python benchmarks/search_replay.py [--seeds 100] [--landscapes files gpt2] [--strategies tuner stock-tpe]
    python benchmarks/search_replay.py --check-live results/NAME     # exit 0: the same decisions
    python benchmarks/search_replay.py record benchmarks/landscapes/files.yaml   # a quiet machine
    python benchmarks/search_replay.py repeat benchmarks/landscapes/files.yaml   # contenders twice more
    python benchmarks/search_replay.py budget gpu_resnet50 --time-s 480   # under --time-budget
    python benchmarks/search_replay.py tuned [--trials 12]   # the landscapes rules are chosen on, alone

``--check-live`` feeds a finished live search's records to the policy in the order they
landed, with its seed and its machine's knob context, and exits 0 only where the policy
makes the same decisions: the same configs, measured in full or held to the same
screening threshold, the same confirm contenders and the same pick; else it prints the
first difference. Writes ``benchmarks/out/search_replay.json``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import itertools
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import optuna
from common import stamp

from tuner import apply, knobs, spec
from tuner.hardware import cpu_has_bf16, describe
from tuner.policy import Done, SearchPolicy, Task, Wait, measure_settings
from tuner.records import read_json, read_trials
from tuner.spec import Canonical, SearchSpace
from tuner.study import make_study
from tuner.windows import median_error, windows_verdict

HERE = Path(__file__).parent
LANDSCAPES = HERE / "landscapes"
BUDGETS = (6, 8, 12, 16, 24)
REPEAT_BAND = 0.9  # configs within this of a landscape's best are measured three times
STRATEGIES = ("tuner", "stock-tpe", "tpe-mv", "gp", "random", "oracle")


# ---- recording a landscape -------------------------------------------------------------


def record(space_path: Path, repeats: int = 4, held_out: bool = False) -> Path:
    """Measure every distinct config of the space once (as a trial does), then ``repeats``
    configs two more times (the best two and two others) for the repeat noise. The file
    is written after every config, and a recording cut short (a lent GPU's time) goes on
    where it stopped when run again."""
    space = spec.load(space_path)
    out = space_path.with_suffix(".json")
    hardware = {**describe(), "cpu_has_bf16": cpu_has_bf16()}
    ctx = context(space, hardware)
    canon, ss = Canonical(space, ctx), SearchSpace(space, ctx)
    settings = space.model.measure.model_dump()
    measure = _measurer(space)
    previous = json.loads(out.read_text()) if out.exists() else {}
    grid = previous.get("grid", []) if previous.get("partial") else []
    seen, t0 = {g["key"] for g in grid}, time.time()
    measured = previous.get("measured") if previous.get("partial") else None  # when the grid began
    measured = measured or time.strftime("%Y-%m-%d %H:%M")

    def save(partial: bool, repeated: list) -> None:
        out.write_text(json.dumps({
            "space": space_path.name, "measured": measured,
            "command": " ".join(sys.argv), "hardware": hardware, "measure": settings, "grid": grid,
            "repeats": repeated, **({"partial": True} if partial else {}),
            # held out: recorded after the search's rules were frozen at this commit; no rule
            # or constant is chosen on it
            **({"held_out": True, "rules_at": _commit()} if held_out else {})}, indent=1))

    combos = list(itertools.product(*space.searched.values()))
    for i, values in enumerate(combos):
        config = ss.active(dict(zip(space.searched, values, strict=True)))
        key = canon(config)
        if key in seen:
            continue
        seen.add(key)
        r = measure(config)
        grid.append({"config": config, "key": key, "status": r.get("status"), "reason": r.get("reason"),
                     "samples_per_sec": r.get("samples_per_sec"), "windows": r.get("samples_per_sec_windows"),
                     "trial_wall_s": r.get("trial_wall_s"),
                     # the pipeline's stages apart, for a model of rates rather than of one grid
                     **{k: r.get(k) for k in ("data_wait_fraction", "step_time_ms", "compute_samples_per_sec",
                                              "load_samples_per_sec_per_process", "compile_s",
                                              "trial_cpu_cores", "loader_cpu_cores",
                                              "peak_host_memory_mb", "gpu_power_w", "joules_per_sample",
                                              # how the figure was made from the windows: a
                                              # fitted one does not spread as its windows do
                                              "steady_from")}})
        save(True, [])
        print(f"  {i + 1}/{len(combos)} {config}: {r.get('samples_per_sec') or 0:.1f} ({time.time() - t0:.0f} s)",
              flush=True)
    ok = sorted((g for g in grid if g["samples_per_sec"]), key=lambda g: -g["samples_per_sec"])
    chosen = ok[:min(2, repeats)] + random.Random(0).sample(ok[2:], min(len(ok) - 2, max(0, repeats - 2)))
    repeated = []
    for g in chosen:
        figures = [g["samples_per_sec"]] + [measure(g["config"]).get("samples_per_sec") for _ in range(2)]
        repeated.append({"config": g["config"], "samples_per_sec": figures})
        print(f"  repeat {g['config']}: {[round(f or 0, 1) for f in figures]}", flush=True)
    save(False, repeated)
    print(f"wrote {out} ({len(grid)} configs, {time.time() - t0:.0f} s)")
    return out


@functools.cache
def _commit() -> str | None:
    """The commit whose rules ran, marked ``+uncommitted`` where tuner/ differs from it.
    Read once, when the run starts (``main``): the rules are the ones imported then, and an
    edit made while a long replay runs is not in them."""
    import subprocess

    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "../tuner"], capture_output=True, text=True,
                           cwd=HERE).stdout.strip()
    return (out.stdout.strip() + ("+uncommitted" if dirty else "")) or None


def _measurer(space: spec.Space) -> Any:
    from tuner.trial import make_request, run_isolated

    def measure(config: dict) -> dict:
        req = make_request(workload=space.model.workload, workload_args=space.model.workload_args,
                           base_dir=str(space.base_dir), config=space.derive({**space.fixed, **config}),
                           device=space.model.device, measure=space.model.measure.model_dump(),
                           run=space.model.run.model_dump())
        return run_isolated(req, timeout_s=600)

    return measure


def repeat(space_path: Path, within: float = REPEAT_BAND) -> Path:
    """Measure two more times every config of a recorded landscape whose figure is within
    ``within`` of its best and has no repeats yet: the judge's rate of a config is the
    mean of its figures, so every contender for the best needs the same three. The best
    is the judged one (``_judged_best``), taken again after each config's repeats: where
    the best first figure was a lucky draw, its mean sits lower, and the configs within
    ``within`` of that mean need their three figures too (``repeat_band``)."""
    path = space_path.with_suffix(".json")
    landscape = json.loads(path.read_text())
    measure = _measurer(spec.load(space_path))
    repeated = 0
    while True:
        done = {json.dumps(r["config"], sort_keys=True) for r in landscape.get("repeats", [])}
        band = repeat_band(landscape, within)
        g = next((g for g in sorted(landscape["grid"], key=lambda g: -(g["samples_per_sec"] or 0))
                  if (g["samples_per_sec"] or 0) >= band and json.dumps(g["config"], sort_keys=True) not in done),
                 None)
        if g is None:
            break
        figures = [g["samples_per_sec"]] + [measure(g["config"]).get("samples_per_sec") for _ in range(2)]
        landscape.setdefault("repeats", []).append({"config": g["config"], "samples_per_sec": figures})
        path.write_text(json.dumps(landscape, indent=1))  # kept if the run is cut short
        print(f"  repeat {g['config']}: {[round(f or 0, 1) for f in figures]}", flush=True)
        repeated += 1
    landscape.setdefault("repeats_added", []).append({
        "date": time.strftime("%Y-%m-%d %H:%M"), "within": within, "configs": repeated,
        "hardware": {**describe(), "cpu_has_bf16": cpu_has_bf16()}})
    path.write_text(json.dumps(landscape, indent=1))
    print(f"wrote {path} ({repeated} configs repeated)")
    return path


def repeat_band(landscape: dict, within: float = REPEAT_BAND) -> float:
    """The figure above which a config needs its repeats: ``within`` of the judged best
    (where the best first figure was a lucky draw, its mean sits lower, and the configs
    near that mean are the contenders), and never above ``within`` of the best first
    figure, which the judge (``judged_rates``) asks of every config (where the best's
    repeats read higher, the machine drifted up between them)."""
    first_best = max((g["samples_per_sec"] or 0.0 for g in landscape["grid"]), default=0.0)
    return within * min(_judged_best(landscape), first_best)


def _judged_best(landscape: dict) -> float:
    """The best config's rate as the judge would take it once the configs near it have
    their repeats (``rates_by``)."""
    return max(rates_by(landscape, lambda c: json.dumps(c, sort_keys=True)).values(), default=0.0)


def rates_by(landscape: dict, key: Callable[[dict], Any]) -> dict:
    """Each config's rate under ``key`` of its config: the mean of its figures where it was
    repeated (failed repeats left out), its first figure otherwise."""
    first = {key(g["config"]): g["samples_per_sec"] or 0.0 for g in landscape["grid"]}
    means = {key(r["config"]): statistics.mean(f) for r in landscape.get("repeats", [])
             if (f := [x for x in r["samples_per_sec"] if x])}
    return {k: means.get(k, v) for k, v in first.items()}


def context(space: spec.Space, hardware: dict | None = None) -> knobs.Context:
    """The search's knob context on the machine that measured the landscape (``hardware``
    as recorded; None: this machine), so that a GPU landscape replays here as on its GPU."""
    from tuner.trial import make_request, resolve_config

    resolved = resolve_config(make_request(workload=space.model.workload, workload_args=space.model.workload_args,
                                           base_dir=str(space.base_dir), device="cpu"))
    ctx = apply.context_for(resolved.device, resolved.workload)
    hardware = hardware or {}
    gpu = space.model.device == "cuda"
    return dataclasses.replace(ctx, device="cuda" if gpu else "cpu",
                               cpu_count=hardware.get("cpu_count") or ctx.cpu_count,
                               bf16_native=gpu or hardware.get("cpu_has_bf16", ctx.bf16_native))


def _repeated(landscape: dict) -> list[tuple[dict, list[float]]]:
    """Each repeated config and its figures (failed ones left out), where two or more remain."""
    return [(r["config"], f) for r in landscape.get("repeats", [])
            if len(f := [x for x in r["samples_per_sec"] if x]) >= 2]


def repeat_cv(landscape: dict) -> float:
    """The repeat-to-repeat CV of one config's figure, pooled over the repeated configs
    (at least 2%: a trial a minute later meets a machine that drifted)."""
    cvs = [statistics.stdev(f) / statistics.mean(f) for _, f in _repeated(landscape)]
    return max(0.02, statistics.median(cvs)) if cvs else 0.03


def runner_up(landscape: dict) -> dict | None:
    """How well the landscape's own repeats order its best config and the next one: the
    runner-up's mean over the best's, and Welch's t-test of their figures (two-sided p).
    None where fewer than two configs were repeated. The replay takes the means as exact;
    where p is large, a pick of the runner-up reads short of a best that the landscape's
    own figures do not show to be faster."""
    from scipy import stats

    repeated = sorted(((statistics.mean(f), f) for _, f in _repeated(landscape)), key=lambda mf: -mf[0])
    if len(repeated) < 2:
        return None
    (best, a), (second, b) = repeated[:2]
    p = float(stats.ttest_ind(a, b, equal_var=False).pvalue)
    if not math.isfinite(p):  # figures without spread: apart unless equal
        p = 1.0 if best == second else 0.0
    return {"ratio": second / best, "p": p, "figures": [len(a), len(b)]}


# ---- the replayed machine ----------------------------------------------------------------


def judged_rates(landscape: dict, canon: Canonical, ss: SearchSpace) -> tuple[dict, str]:
    """Each config's rate as the judge takes it, and how ("means" or "first figures").
    The best config's first figure is the luckiest draw of many (the winner's curse:
    repeated, the best configs of the grids read 0.92-1.01 of it on average), so where
    every config within ``REPEAT_BAND`` of the best has three figures on one host
    (``repeat``), a config's rate is their mean; otherwise every config's is its first
    figure (means for a few and first figures for the rest would judge the two kinds
    differently)."""
    key = lambda c: canon(ss.active(c))  # noqa: E731
    first = {key(g["config"]): g["samples_per_sec"] or 0.0 for g in landscape["grid"]}
    repeated = {key(r["config"]) for r in landscape.get("repeats", []) if any(r["samples_per_sec"])}
    best = max(first.values())
    if not all(k in repeated for k, v in first.items() if v >= REPEAT_BAND * best):
        return first, "first figures"
    return rates_by(landscape, key), "means"


def per_time(rates: list[float]) -> float:
    """A trial's figure from its windows' rates: all samples over all time, as the trial
    takes it (``tuner.windows.epoch_fit``). Windows hold equal samples, so that is the
    harmonic mean, and a set of windows drawn from a config's recorded ones then reads on
    average what all of them read. (Their median does not where the windows spread
    several-fold, as grouped batches of unequal length make them.)"""
    return statistics.harmonic_mean(rates)


class Machine:
    """Measurements drawn from a landscape, for one seed, under a search's window caps."""

    TRANSIENT = 2  # windows kept in their recorded order: the start-up transient

    def __init__(self, landscape: dict, canon: Canonical, ss: SearchSpace, seed: int, settings: dict):
        self.truth = {canon(ss.active(g["config"])): g for g in landscape["grid"]}
        self.rate, _ = judged_rates(landscape, canon, ss)
        self.optimum = max(self.rate.values())
        self.cv = repeat_cv(landscape)
        # the configs measured as three whole trials: their figures are drawn at the
        # repeats' spread (``measure``)
        self.repeated = {canon(ss.active(c)) for c, _ in _repeated(landscape)}
        self.settings = settings
        self.canon = canon
        self.rng = random.Random(seed)
        walls = [g["trial_wall_s"] for g in landscape["grid"] if g.get("trial_wall_s")]
        self.typical_wall = statistics.median(walls) if walls else 10.0
        # the baseline is the plain loop, eager in one process: as long as the eager trials of
        # one rank, not the grid's median, which compiled trials raise
        plain = [g["trial_wall_s"] for g in landscape["grid"] if g.get("trial_wall_s")
                 and (g["config"].get("compile") or "off") == "off" and (g["config"].get("world_size") or 1) == 1]
        self.baseline_wall = statistics.median(plain) if plain else self.typical_wall
        feasible = [v for v in self.rate.values() if v]
        self.baseline_rate = min(feasible)  # the plain loop is no contender; its figure only fills rounds

    def measure(self, task: Task) -> dict:
        """A trial's record of ``task``: its figure, windows, error, and wall time (the
        fixed part of a trial, half its recorded wall, and its windows in proportion)."""
        if task.baseline:
            return {"status": "ok", "config": task.config, "samples_per_sec": self.baseline_rate,
                    "samples_per_sec_error": 0.02, "trial_wall_s": self.baseline_wall}
        key = self.canon(task.config)
        g = self.truth[key]
        wall = g.get("trial_wall_s") or self.typical_wall
        if not g["samples_per_sec"]:
            return {"status": "infeasible", "reason": g.get("reason"), "config": task.config,
                    "samples_per_sec": None, "trial_wall_s": wall}
        recorded = g["windows"] or [g["samples_per_sec"]]
        steady = recorded[self.TRANSIENT:] or recorded
        # every window at the judged rate's scale: the threshold and the full figures are
        # judged means, so must be the windows screened against them
        scale = self.rate[key] / per_time(steady)
        factor = max(0.5, self.rng.gauss(1.0, self.cv))
        rates, verdict = [], None
        s = self.settings
        while verdict is None and len(rates) < s["max_windows"]:
            i = len(rates)
            raw = recorded[i] if i < min(self.TRANSIENT, len(recorded)) else self.rng.choice(steady)
            rates.append(raw * scale * factor)
            verdict = windows_verdict(rates, task.screen, min_windows=s["min_windows"], target_error=s["target_error"],
                                      screen_windows=s["screen_windows"], capped=len(rates) >= s["max_windows"])
        screened = verdict == "screened"
        body = rates[self.TRANSIENT:]
        if screened:
            figure = per_time(rates)
        elif key in self.repeated or g.get("steady_from") == "batch lengths":
            # Where a config was measured as three whole trials, its figure spreads as
            # trials do (the repeats' spread): its windows are a proxy for that, and a poor
            # one where they hold stalls that the trial's figure sets apart (epoch
            # boundaries, a host's neighbours: windows two-fold apart from trials that
            # agree closely). A figure fitted on its batches' lengths does not spread
            # as its windows do either (they hold batches many-fold apart in cost, by
            # design). The windows above still decide the screen and the trial's length,
            # as a live trial's raw windows do.
            figure = self.rate[key] * factor
        else:
            figure = per_time(body or rates)
        return {"status": "ok", "config": task.config, "samples_per_sec": figure,
                "samples_per_sec_error": median_error(rates) if len(rates) > 1 else 0.05, "screened": screened,
                "trial_wall_s": wall * (0.5 + 0.5 * len(rates) / max(len(recorded), 1)),
                # the cores the trial and its workers used, and its data wait (the pipeline's
                # stages apart), where the landscape recorded them
                **{k: g[k] for k in ("trial_cpu_cores", "loader_cpu_cores", "data_wait_fraction")
                   if g.get(k) is not None}}


# ---- one replayed search -------------------------------------------------------------------


def variant(space: spec.Space, trials: int, sampler: str | None = None) -> spec.Space:
    """``space`` with a budget of ``trials`` configs (and another sampler's name)."""
    model = space.model.model_copy(deep=True)
    model.budget.trials = trials
    if sampler:
        model.sampler = sampler
    return dataclasses.replace(space, model=model)


def replay(landscape: dict, space: spec.Space, ctx: knobs.Context, strategy: str, seed: int, trials: int,
           time_s: float | None = None) -> dict:
    """One search of ``trials`` configs on the landscape (under ``time_s`` seconds of its
    trials' recorded walls, as ``--time-budget``): the pick's judged rate over the best, the
    screening false negatives, the measurements and distinct configs it took, its wall."""
    if strategy == "stock-tpe":
        return stock_tpe(landscape, space, ctx, seed, trials)
    policy, machine, now, decision = _search(landscape, space, ctx, strategy, seed, trials, time_s)
    best = policy.pick().row
    spent = {"measurements": len(policy.records), "wall_s": now, "ended": decision.why,
             "configs": len({r["key"] for r in policy.records if r.get("phase") == "search"})}
    if best is None:
        return {"pick": 0.0, "false_negatives": [], **spent}
    pick = machine.rate[best["key"]]
    screened = {r["key"] for r in policy.records if r.get("screened")}
    full = {r["key"] for r in policy.records if r.get("status") == "ok" and not r.get("screened")}
    return {"pick": pick / machine.optimum, **spent, "explored": explored(policy.records, machine),
            "false_negatives": [machine.rate[k] >= 0.97 * pick for k in screened - full],
            "shortfall": shortfall(policy.records, machine, best["key"])}


def _search(landscape: dict, space: spec.Space, ctx: knobs.Context, strategy: str, seed: int, trials: int,
            time_s: float | None) -> tuple[SearchPolicy, Machine, float, Done]:
    """One search driven to its end on the landscape: the policy (its records and pick),
    the machine that measured, the wall its trials took, and why it ended."""
    canon, ss = Canonical(space, ctx), SearchSpace(space, ctx)
    names = {"tuner": None, "random": "random", "tpe-mv": "tpe", "gp": "tpe", "oracle": "tpe"}
    space = variant(space, trials, names[strategy])
    space.model.seed = seed
    space.model.budget.time_s = time_s
    machine = Machine(landscape, canon, ss, seed, measure_settings(space))
    sampler = {"tpe-mv": lambda: optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=4),
               "gp": lambda: optuna.samplers.GPSampler(seed=seed, n_startup_trials=4, warn_independent_sampling=False),
               "oracle": lambda: Oracle(landscape, machine.rate, canon, ss),
               }.get(strategy, lambda: None)()
    policy = SearchPolicy(space, ctx, make_study(space, ctx, sampler=sampler))
    now = 0.0
    while not isinstance(decision := policy.next(now), Done):
        if isinstance(decision, Wait):  # one at a time: nothing is ever in flight here
            raise RuntimeError(f"the policy waits with nothing in flight: {decision.why}")
        record = machine.measure(decision)
        now += record["trial_wall_s"]
        policy.on_result(decision, record)
    return policy, machine, now, decision


def trace(name: str, seed: int, trials: int) -> list[str]:
    """One replayed search of the tuner on a landscape the rules are chosen on, told a
    measurement a line: its phase, the figure the search saw, that config's judged rate
    over the landscape's best, and the knobs the landscape varies; then the pick and the
    best config. What a rule is reasoned from: why a search never measured a config, or
    lost it in the rounds. A held-out landscape is refused: no rule is chosen from it."""
    landscape, space, ctx = _load(name)
    if landscape.get("held_out"):
        raise SystemExit(f"{name}: held out (recorded after the rules were frozen): its searches are judged, "
                         f"not traced to choose a rule by")
    varied = list(space.searched)
    policy, machine, now, decision = _search(landscape, space, ctx, "tuner", seed, trials, None)

    def knobs_of(config: dict) -> str:
        return ", ".join(f"{k}={config.get(k)}" for k in varied)

    lines = [f"{name}, seed {seed}, {trials} configs: {len(policy.records)} measurements, {now:.0f} s of trials"]
    for r in policy.records:
        judged = machine.rate.get(r.get("key"))
        figure = r.get("samples_per_sec")
        lines.append(f"  {r.get('phase', ''):<9} {figure or 0:>9.1f} {'screened' if r.get('screened') else '':<8} "
                     f"{'' if judged is None else f'{judged / machine.optimum:.3f}':>5}  "
                     f"{'baseline' if r.get('phase') == 'baseline' else knobs_of(r['config'])}")
    best = policy.pick().row
    top = max(machine.rate, key=machine.rate.__getitem__)
    lines.append(f"pick: {machine.rate[best['key']] / machine.optimum:.3f} of the best, {knobs_of(best['config'])}"
                 if best else "pick: none")
    lines.append(f"best: {knobs_of(machine.truth[top]['config'])}; ended: {decision.why}")
    return lines


def explored(records: list[dict], machine: Machine) -> float:
    """The best config a search measured in full (not screened, not the baseline) over the
    landscape's best: what its pick would read if the pick knew each measured config's
    rate, so that the pick's shortfall below it is noise, and the shortfall of this one
    exploration (the best configs never measured in full)."""
    full = {r["key"] for r in records if r.get("phase") != "baseline" and r.get("status") == "ok"
            and not r.get("screened") and r.get("key") in machine.rate}
    return max((machine.rate[k] for k in full), default=0.0) / machine.optimum


def shortfall(records: list[dict], machine: Machine, pick: str) -> str:
    """Where the pick falls short of the best config the search measured in full: ``none``,
    ``close`` (within 3% of it), ``lost in the rounds`` (that config was a confirm
    contender and lost them) or ``no contender`` (its search figure left it out of the
    confirm rounds)."""
    full = {r["key"] for r in records if r.get("phase") != "baseline" and r.get("status") == "ok"
            and not r.get("screened") and r.get("key") in machine.rate}
    best = max(full, key=machine.rate.__getitem__, default=pick)
    gap = (machine.rate[best] - machine.rate[pick]) / machine.optimum
    if gap <= 1e-9:
        return "none"
    if gap < 0.03:
        return "close"
    confirmed = {r["key"] for r in records if r.get("phase") == "confirm"}
    return "lost in the rounds" if best in confirmed else "no contender"


class Oracle(optuna.samplers.BaseSampler):
    """A sampler that knows the judge's rates: each trial it is asked is the best config
    not yet proposed (after the starts the policy queues for every sampler but the guided
    one). The policy's screening, confirm rounds and pick are as for any sampler, so its
    figures are the pick's noise among the best configs alone."""

    def __init__(self, landscape: dict, rates: dict, canon: Canonical, ss: SearchSpace):
        configs = {canon(ss.active(g["config"])): ss.active(g["config"]) for g in landscape["grid"]}
        self.order = [configs[k] for k in sorted(configs, key=lambda k: -(rates.get(k) or 0.0))]
        self.canon = canon
        self.plans: dict[int, dict] = {}

    def infer_relative_search_space(self, study: optuna.Study, trial: Any) -> dict:
        return {}

    def sample_relative(self, study: optuna.Study, trial: Any, search_space: dict) -> dict:
        return {}

    def sample_independent(self, study: optuna.Study, trial: Any, param_name: str, param_distribution: Any) -> Any:
        if trial.number not in self.plans:
            asked = {self.canon(p) for p in self.plans.values()}
            asked |= {self.canon(t.params) for t in study.get_trials(deepcopy=False) if t.number != trial.number}
            self.plans[trial.number] = next((c for c in self.order if self.canon(c) not in asked), self.order[0])
        value = self.plans[trial.number].get(param_name)
        choices = getattr(param_distribution, "choices", None)
        return value if choices is None or value in choices else choices[0]


def stock_tpe(landscape: dict, space: spec.Space, ctx: knobs.Context, seed: int, trials: int) -> dict:
    """Stock Ray Tune + OptunaSearch: TPE at Optuna's defaults, ``trials`` configs, each
    measured once in full; the pick is the best single figure reported."""
    canon, ss = Canonical(space, ctx), SearchSpace(space, ctx)
    machine = Machine(landscape, canon, ss, seed, space.model.measure.model_dump())
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    figures: dict[str, float] = {}
    for number in range(trials):
        trial = study.ask()
        ss(trial)
        config = space.derive({**space.fixed, **{k: trial.params.get(k, v[0]) for k, v in space.searched.items()}})
        rec = machine.measure(Task(number, "search", config))
        value = rec["samples_per_sec"] if rec["status"] == "ok" else 0.0
        figures[canon(config)] = max(figures.get(canon(config), 0.0), value)
        study.tell(trial, value)
    pick = max(figures, key=figures.get)
    return {"pick": machine.rate[pick] / machine.optimum if figures[pick] else 0.0, "false_negatives": None,
            "measurements": trials}


# ---- a live search, decision by decision ------------------------------------------------------


def check_live(folder: Path) -> int:
    """0 where the policy, fed a finished live search's records in the order they landed,
    decides as the live search did; 1 at the first difference (printed); 2 where the
    folder cannot be checked."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    summary = read_json(folder / "summary.json")
    live = summary.get("policy")
    if not live:
        print(f"{folder}: no policy record in summary.json (a search from an older tuner)")
        return 2
    if live.get("resumed"):
        print(f"{folder}: a resumed search: its first session's decisions are not in this session's records")
        return 2
    space = spec.load(folder / "space.yaml")
    meta = read_json(folder / "meta.json")
    if meta.get("base_dir"):
        space.base = Path(meta["base_dir"])
    ctx = knobs.Context(**live["context"])
    policy = SearchPolicy(space, ctx)
    # a config not run because it would hang is decided inside the decision after it: the
    # policy makes it again there
    records = [r for r in read_trials(folder / "trials.jsonl") if not r.get("skipped")]
    decided = {r["task"]: r for r in records if "task" in r}
    events = sorted([(r["decided_at"], 0, r) for r in decided.values()]
                    + [(r["time"] - live["started_at"], 1, r) for r in records], key=lambda e: (e[0], e[1]))
    tasks: dict[int, Task] = {}
    for at, kind, rec in events:
        if kind == 0:
            decision = policy.next(at)
            problem = _differs(decision, rec, policy)
            if problem:
                print(f"decision {rec['task']} ({at:.1f} s): {problem}")
                return 1
            tasks[rec["task"]] = decision
        elif rec["phase"] == "lost":
            policy.on_lost(tasks[rec["task"]], rec["reason"].rsplit("; ", 1)[0], rec["reason"].endswith("tried again"))
        else:
            policy.on_result(tasks[rec["task"]], rec)
    end = policy.next(live["ended_at"])
    if not isinstance(end, Done):
        print(f"the end ({live['ended_at']:.1f} s): the policy would measure more ({end})")
        return 1
    ours, theirs = policy.pick().row, summary.get("best")
    # (keys made anew from the configs: a knob added since the search ran is in ours only)
    if (ours and _key(policy, ours)) != (theirs and _key(policy, theirs)):
        print(f"the pick: the policy picks {ours and ours['config']}, the live search picked {theirs and theirs['config']}")
        return 1
    print(f"{folder}: the same {len(decided)} decisions and the same pick ({ours and ours['config']})")
    return 0


def _key(policy: SearchPolicy, row: dict) -> str:
    return policy.record_key(row)


def _differs(decision: Any, rec: dict, policy: SearchPolicy) -> str | None:
    """What differs between the policy's decision and the one the live search made."""
    if not isinstance(decision, Task):
        return f"the policy decided {decision}, the live search measured {rec['phase']} {rec['config']}"
    live_phase = "search" if rec["phase"] == "lost" else rec["phase"]
    if str(decision.phase) != live_phase and rec["phase"] != "lost":
        return f"phase {decision.phase} against {rec['phase']}"
    if policy.canon(decision.config) != policy.record_key(rec):
        return f"config {decision.config} against {rec['config']}"
    if decision.screen != rec.get("screen"):
        return f"screening threshold {decision.screen} against {rec.get('screen')}"
    if decision.confirm_round != rec.get("confirm_round"):
        return f"confirm round {decision.confirm_round} against {rec.get('confirm_round')}"
    return None


# ---- the benchmark ---------------------------------------------------------------------------


def _job(args: tuple) -> tuple:
    name, strategy, seed = args
    landscape, space, ctx = _load(name)
    return name, strategy, seed, {b: replay(landscape, space, ctx, strategy, seed, b) for b in BUDGETS}


_CACHE: dict[str, tuple] = {}


def _load(name: str) -> tuple[dict, spec.Space, knobs.Context]:
    if name not in _CACHE:
        landscape = json.loads((LANDSCAPES / f"{name}.json").read_text())
        space = spec.load(LANDSCAPES / landscape["space"])
        ctx = context(space, landscape["hardware"])
        _CACHE[name] = (landscape, space, ctx)
    return _CACHE[name]


def real_run() -> dict:
    """The real tuner on the quickstart space, end to end: wall time to its recommendation."""
    import shutil
    import subprocess

    results = HERE / "out" / "results"
    shutil.rmtree(results / "replay-quickstart", ignore_errors=True)
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "tuner", "run", str(HERE.parent / "search_spaces" / "quickstart.yaml"),
                           "--name", "replay-quickstart", "--results-dir", str(results), "--quiet"],
                          capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    summary = json.loads((results / "replay-quickstart" / "summary.json").read_text())
    return {"command_wall_s": wall, "search_wall_s": summary["search_wall_s"], "in_trial_s": summary["in_trial_s"],
            "trials": summary["trials"], "measurements": summary["measurements"],
            "speedup_vs_baseline": summary["speedup_vs_baseline"]}


def judge(name: str) -> str:
    """How the landscape's rates are judged (``judged_rates``)."""
    landscape, space, ctx = _load(name)
    return judged_rates(landscape, Canonical(space, ctx), SearchSpace(space, ctx))[1]


def quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def main() -> None:
    _commit()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    rec = sub.add_parser("record", help="measure a landscape's full grid")
    rec.add_argument("space", nargs="+")
    rec.add_argument("--repeats", type=int, default=4, help="configs measured twice more (the best two, then random)")
    rec.add_argument("--held-out", action="store_true",
                     help="recorded after the search's rules were frozen: no rule is chosen on it")
    rep = sub.add_parser("repeat", help="measure the configs near a landscape's best twice more")
    rep.add_argument("space", nargs="+")
    rep.add_argument("--within", type=float, default=REPEAT_BAND, help="configs at this fraction of the best or above (the default: within 10%%)")
    bud = sub.add_parser("budget", help="replay the search under a time budget: the configs it fits, and its pick")
    bud.add_argument("landscapes", nargs="+", help="names under benchmarks/landscapes")
    bud.add_argument("--time-s", type=float, nargs="+", default=[480.0], help="budgets, as --time-budget")
    bud.add_argument("--trials", type=int, nargs="+", default=[10, 100],
                     help="budget.trials (10: the shipped GPU spaces'; more than a grid has: the time alone binds)")
    bud.add_argument("--seeds", type=int, default=100)
    bud.add_argument("--out", default=str(HERE / "out" / "search_budget.json"))
    tun = sub.add_parser("tuned", help="the tuner on the landscapes the rules are chosen on (never a held-out one): "
                                      "the figures to choose a rule or a constant by")
    tun.add_argument("--trials", type=int, default=12)
    tun.add_argument("--seeds", type=int, default=100)
    tun.add_argument("--first-seed", type=int, default=0, help="another set of seeds, to check a choice on")
    tun.add_argument("--jobs", type=int, default=2)
    tra = sub.add_parser("trace", help="one replayed search on a landscape the rules are chosen on, a measurement a line")
    tra.add_argument("landscape", help="a name under benchmarks/landscapes")
    tra.add_argument("--seed", type=int, default=0)
    tra.add_argument("--trials", type=int, default=12)
    ap.add_argument("--check-live", metavar="RESULTS_DIR", help="check a finished live search's decisions")
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--gp-seeds", type=int, default=10, help="the GP sampler is slow: fewer seeds")
    ap.add_argument("--landscapes", nargs="*", help="names under benchmarks/landscapes (default: all recorded)")
    ap.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--real-run", action="store_true", help="also time the real quickstart search")
    ap.add_argument("--real-run-only", action="store_true",
                    help="time the real quickstart search into the existing JSON, no replay")
    ap.add_argument("--out", default=str(HERE / "out" / "search_replay.json"))
    ap.add_argument("--add", action="store_true",
                    help="replay only --landscapes and add them to the existing JSON (landscapes recorded "
                         "after it, under the same rules; with --strategies, only those strategies' rows "
                         "are replaced)")
    a = ap.parse_args()
    if a.check_live:
        sys.exit(check_live(Path(a.check_live)))
    if a.cmd == "record":
        for s in a.space:
            record(Path(s), a.repeats, a.held_out)
        return
    if a.cmd == "repeat":
        for s in a.space:
            repeat(Path(s), a.within)
        return
    if a.cmd == "tuned":
        tuned(a.trials, a.seeds, a.first_seed, a.jobs)
        return
    if a.cmd == "trace":
        print("\n".join(trace(a.landscape, a.seed, a.trials)))
        return
    if a.cmd == "budget":
        budget_replays(a.landscapes, a.time_s, a.trials, a.seeds, Path(a.out))
        return
    if a.real_run_only:
        data = json.loads(Path(a.out).read_text())
        data["real_run"] = real = real_run()
        Path(a.out).write_text(json.dumps(data, indent=1, default=str))
        print(f"quickstart, the real tuner: {real['command_wall_s']:.0f} s to its recommendation; wrote {a.out}")
        return
    run_replays(a)


def run_replays(a: argparse.Namespace) -> None:
    names = a.landscapes or sorted(p.stem for p in LANDSCAPES.glob("*.json"))
    jobs = [(n, s, seed) for n in names for s in a.strategies
            for seed in range(a.gp_seeds if s == "gp" else a.seeds)]
    t0 = time.time()
    results: dict = {}
    for name, strategy, _seed, out in _mapped(_job, jobs, a.jobs, chunksize=4):
        for b, r in out.items():
            results.setdefault(name, {}).setdefault(strategy, {}).setdefault(b, []).append(r)
    table = {name: _table(name, results[name], a.strategies) for name in names}
    if a.add:
        _add(Path(a.out), names, table, time.time() - t0, a.strategies)
        return
    real = real_run() if a.real_run else None
    if real:
        print(f"quickstart, the real tuner: {real['command_wall_s']:.0f} s to its recommendation "
              f"({real['trials']} configs, {real['measurements']} measurements, "
              f"{real['speedup_vs_baseline']:.2f}x the plain loop)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    # a rule once chosen with held-out figures in view stays said, whatever replays since
    seen = json.loads(Path(a.out).read_text()).get("held_out_seen") if Path(a.out).exists() else None
    Path(a.out).write_text(json.dumps({
        "real_run": real, "benchmark": "search_replay", **stamp(), "previous": _previous(Path(a.out)),
        "seeds": a.seeds, "gp_seeds": a.gp_seeds, "budgets": BUDGETS, "wall_s": time.time() - t0,
        "landscapes": {n: _landscape_facts(n) for n in names},
        "results": table, **({"held_out_seen": seen} if seen else {})}, indent=1, default=str))
    print(f"\nwrote {a.out} ({time.time() - t0:.0f} s)")


def _mapped(fn: Callable, items: list, jobs: int, chunksize: int) -> Iterator:
    """``fn`` over ``items`` in ``jobs`` processes (in this one for a single job), with
    Optuna's per-trial log lines off in each."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if jobs <= 1:
        yield from map(fn, items)
        return
    with ProcessPoolExecutor(jobs, initializer=optuna.logging.set_verbosity,
                             initargs=(optuna.logging.WARNING,)) as pool:
        yield from pool.map(fn, items, chunksize=chunksize)


def _tuned_job(args: tuple) -> tuple:
    name, seed, trials = args
    landscape, space, ctx = _load(name)
    return name, replay(landscape, space, ctx, "tuner", seed, trials)


def tuned(trials: int, seeds: int, first_seed: int, jobs: int) -> None:
    """The tuner on every landscape the rules are chosen on, never a held-out one: per
    landscape and on average, the pick over the best (median, 10th percentile, mean), the
    best config measured in full, the measurements; and where the picks' shortfall below
    that config comes from (``shortfall``), the figures a rule or a constant is chosen by."""
    names = [n for n in sorted(p.stem for p in LANDSCAPES.glob("*.json")) if not _load(n)[0].get("held_out")]
    runs: dict[str, list[dict]] = {}
    for name, r in _mapped(_tuned_job, [(n, s, trials) for n in names for s in range(first_seed, first_seed + seeds)],
                           jobs, chunksize=8):
        runs.setdefault(name, []).append(r)
    rows = {}
    for name, rs in runs.items():
        f = {**_figures(rs), "mean": statistics.mean(r["pick"] for r in rs)}
        rows[name] = f
        print(f"{name:<20} pick {f['median']:.3f} / {f['p10']:.3f} (mean {f['mean']:.3f})  "
              f"best measured {f.get('explored_median', 0.0):.3f}  measurements {f['measurements']:.1f}")

    def mean(field: str) -> float:
        return statistics.mean(f[field] for f in rows.values())

    print(f"\n{len(rows)} landscapes, {trials} configs, seeds {first_seed}-{first_seed + seeds - 1}: mean median "
          f"{mean('median'):.4f}, mean p10 {mean('p10'):.4f}, mean pick {mean('mean'):.4f}, mean measurements "
          f"{mean('measurements'):.1f}; median below 0.97 on {sum(f['median'] < 0.97 for f in rows.values())}, "
          f"p10 below 0.93 on {sum(f['p10'] < 0.93 for f in rows.values())}")
    kinds = collections.Counter(r["shortfall"] for rs in runs.values() for r in rs)
    lost = collections.Counter()
    for rs in runs.values():
        for r in rs:
            lost[r["shortfall"]] += r["explored"] - r["pick"]
    print("the pick below the best config measured: " + ", ".join(
        f"{k} {n} searches ({lost[k]:.2f} summed)" for k, n in kinds.most_common()))


def budget_replays(names: list[str], budgets: list[float], trials: list[int], seeds: int, out: Path) -> None:
    """The search under ``--time-budget``: on each landscape, for each budget and trial
    count, ``seeds`` searches whose clock is their trials' recorded walls (each trial from
    its process's start to its result; what a live search adds around them, Ray's start
    and the scheduling between trials, is not in them). Reported: the distinct configs the
    search measured, its measurements, the wall it used and why it stopped, and the pick
    over the landscape's best."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows = []
    for name in names:
        landscape, space, ctx = _load(name)
        for time_s, n in itertools.product(budgets, trials):
            runs = [replay(landscape, space, ctx, "tuner", seed, n, time_s) for seed in range(seeds)]
            picks, configs = [r["pick"] for r in runs], [r["configs"] for r in runs]
            walls = [g["trial_wall_s"] for g in landscape["grid"] if g.get("trial_wall_s")]
            rows.append({"landscape": name, "landscape_hardware": landscape["hardware"], "time_s": time_s,
                         "trials": n, "trial_wall_s_median": statistics.median(walls),
                         "configs_median": statistics.median(configs), "configs_min": min(configs),
                         "measurements_median": statistics.median(r["measurements"] for r in runs),
                         "wall_s_median": statistics.median(r["wall_s"] for r in runs),
                         "wall_s_max": max(r["wall_s"] for r in runs),
                         "pick_median": statistics.median(picks), "pick_p10": quantile(picks, 0.1),
                         "ended": dict(collections.Counter(r["ended"] for r in runs))})
            r = rows[-1]
            print(f"{name} under {time_s:.0f} s, trials {n}: {r['configs_median']:.0f} configs (least "
                  f"{r['configs_min']}), {r['measurements_median']:.0f} measurements, wall {r['wall_s_median']:.0f} s "
                  f"(most {r['wall_s_max']:.0f}); pick / best {r['pick_median']:.3f}, p10 {r['pick_p10']:.3f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "search_budget", **stamp(), "seeds": seeds, "rules_at": _commit(),
                               "rows": rows}, indent=1, default=str))
    print(f"wrote {out}")


def _landscape_facts(name: str) -> dict:
    landscape, _, ctx = _load(name)
    judged = judge(name)
    return {"measured": landscape.get("measured"), "hardware": landscape["hardware"],
            "configs": len(landscape["grid"]), "repeat_cv": repeat_cv(landscape), "judge": judged,
            "runner_up": runner_up(landscape) if judged == "means" else None,
            "held_out": bool(landscape.get("held_out")), "rules_at": landscape.get("rules_at"),
            # on a CPU, whether its trials reported the cores they and their workers used:
            # without them the replay never gives the split starts the threads those cores leave
            "cores_recorded": any(g.get("loader_cpu_cores") is not None for g in landscape["grid"])
            if ctx.device == "cpu" else None}


def _add(out: Path, names: list[str], table: dict, wall_s: float, strategies: list[str]) -> None:
    """Landscapes recorded after the JSON's run, replayed under the same rules, added to it
    (each landscape says when it was measured; ``added`` says when and by what). Only the
    strategies replayed are replaced: a change to the tuner's rules replays the tuner alone,
    and the other strategies' rows, which it does not touch, stand."""
    data = json.loads(out.read_text())
    for n in names:
        data["landscapes"][n] = _landscape_facts(n)
        data["results"][n] = {**data["results"].get(n, {}), **table[n]}
    # an earlier addition whose rows this one replaces, every one, no longer describes the page
    data["added"] = [a for a in data.get("added") or []
                     if not (set(a["landscapes"]) <= set(names) and set(a.get("strategies") or ["*"]) <= set(strategies))]
    data["added"].append({**stamp(), "landscapes": names, "strategies": sorted(strategies),
                          "wall_s": wall_s, "rules_at": _commit()})
    out.write_text(json.dumps(data, indent=1, default=str))
    print(f"\nadded {', '.join(names)} to {out}")


def _previous(out: Path) -> dict | None:
    """The figures at 12 configs of the run this one replaces, where that run is the last
    one before the replay drove the policy itself (the results page shows where they moved)."""
    try:
        old = json.loads(out.read_text())
    except (OSError, ValueError):
        return None
    if "previous" in old:
        return old["previous"]
    return {"date": old.get("date"), "why": "",
            "results": {n: {s: {"12": r["12"]} for s, r in rows.items() if "12" in r}
                        for n, rows in old.get("results", {}).items()}}


def _figures(runs: list[dict]) -> dict:
    """What one strategy's searches at one budget read over their seeds: the pick over the
    best (median, 10th percentile), the best config measured in full, the screening's
    false negatives, the measurements."""
    picks = [r["pick"] for r in runs]
    fns = [x for r in runs for x in (r["false_negatives"] or [])]
    reached = [r["explored"] for r in runs if r.get("explored") is not None]
    return {"median": statistics.median(picks), "p10": quantile(picks, 0.1), "seeds": len(runs),
            **({"explored_median": statistics.median(reached), "explored_p10": quantile(reached, 0.1)}
               if reached else {}),
            "screened": len(fns), "false_negative_rate": (sum(fns) / len(fns)) if fns else None,
            "measurements": statistics.median(r["measurements"] for r in runs)}


def _table(name: str, results: dict, strategies: list[str]) -> dict:
    """One landscape's figures per strategy and budget, printed as they are tabled."""
    landscape = _load(name)[0]
    ok = [g["samples_per_sec"] for g in landscape["grid"] if g["samples_per_sec"]]
    print(f"\n{name}: {len(landscape['grid'])} configs, best {max(ok):.1f}, median "
          f"{statistics.median(ok):.1f} samples/s; repeat CV {repeat_cv(landscape):.3f} "
          f"({landscape['hardware'].get('cpu')}, {landscape.get('measured', '?')})"
          + ("  [held out]" if landscape.get("held_out") else ""))
    print(f"  {'strategy':<10}" + "".join(f"{b:>16}" for b in BUDGETS) + "   (pick / best: median, p10)")
    table: dict = {}
    for strategy in strategies:
        row = {}
        for b in BUDGETS:
            row[b] = _figures(results[strategy][b])
        table[strategy] = row
        print(f"  {strategy:<10}" + "".join(f"{row[b]['median']:>9.3f} {row[b]['p10']:.3f}" for b in BUDGETS))
    fn = table.get("tuner", {}).get(12, {})
    if fn.get("false_negative_rate") is not None:
        print(f"  tuner's screening at 12 configs: {fn['screened']} screened over the seeds, "
              f"{fn['false_negative_rate']:.1%} within 3% of the pick")
    return table


if __name__ == "__main__":
    main()
