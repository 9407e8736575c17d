"""How good the search's pick is, replayed on recorded landscapes: minutes, not hours, so
that every change to the search is judged on every landscape, not on one live search.

A landscape (``benchmarks/landscapes/<name>.json``, next to its space ``<name>.yaml``)
is the full grid of a space, each config measured once the way a search measures it,
every timed window kept in order (the first windows hold the start-up transient that
screening sees), plus a few configs measured three times for the repeat noise. Record
one (a quiet machine: nothing else running), then measure every config within 10% of its
best twice more (on the same host: the VM's hosts differ by up to 2x), so that the judge
takes the mean of three figures for each contender (``judged_rates``):

    python benchmarks/search_replay.py record benchmarks/landscapes/files.yaml
    python benchmarks/search_replay.py repeat benchmarks/landscapes/files.yaml

A replayed measurement of a config is its recorded windows, the first ones in their
recorded order and the rest drawn from its later windows, all times a factor
N(1, repeat CV) for the drift between trials; as many windows as the measurement's
stopping rules take (screening, the target error, clearly below the incumbent). The strategies:

- ``tuner``: the real search logic: ``GuidedSampler`` with the starts, the ``Board``'s
  screening and rechecks, the screening rule of ``tuner.measure``, the confirm round
  chosen by ``tuner.records`` (``within_noise``) and the winner by ``best_of``; N configs
  tried, the confirm round on top (as ``--trials N`` does);
- ``stock-tpe``: stock Ray Tune + OptunaSearch (TPE, Optuna's defaults), N configs, the
  pick is the best single figure reported (``get_best_result``);
- ``tpe-mv``, ``gp``: Optuna's multivariate TPE and its GP sampler in the tuner's flow
  (starts, screening, confirm), as the engines the tuner could use instead;
- ``random``: random configs in the tuner's flow.

Reported per landscape and number of configs (6, 8, 12, 16, 24): the pick's judged
rate over the landscape's best, median and 10th percentile over the seeds; and the
screening false-negative rate: the share of screened configs whose recorded figure is
within 3% of the final pick's.

    python benchmarks/search_replay.py [--seeds 200] [--landscapes files gpt2] [--strategies tuner stock-tpe]
    python benchmarks/search_replay.py --real-run   # also: the quickstart's first recommendation, timed
    python benchmarks/search_replay.py --real-run-only   # that alone, into the existing JSON

Writes ``benchmarks/out/search_replay.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import optuna

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meta import stamp  # noqa: E402

from tuner import apply, knobs, spec  # noqa: E402
from tuner.hardware import cpu_has_bf16, describe  # noqa: E402
from tuner.measure import median_error, windows_verdict  # noqa: E402
from tuner.records import aggregate, best_of, rank, within_noise  # noqa: E402
from tuner.sampler import GuidedSampler  # noqa: E402
from tuner.screening import Board  # noqa: E402
from tuner.study import Canonical, SearchSpace  # noqa: E402

HERE = Path(__file__).parent
LANDSCAPES = HERE / "landscapes"
BUDGETS = (6, 8, 12, 16, 24)
REPEAT_BAND = 0.9  # configs within this of a landscape's best are measured three times
STRATEGIES = ("tuner", "stock-tpe", "tpe-mv", "gp", "random")


# ---- recording a landscape -------------------------------------------------------------


def record(space_path: Path, repeats: int = 4) -> Path:
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

    def save(partial: bool, repeated: list) -> None:
        out.write_text(json.dumps({
            "space": space_path.name, "measured": previous.get("measured") or time.strftime("%Y-%m-%d %H:%M"),
            "command": " ".join(sys.argv), "hardware": hardware, "measure": settings, "grid": grid,
            "repeats": repeated, **({"partial": True} if partial else {})}, indent=1))

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
                     "trial_wall_s": r.get("trial_wall_s")})
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
    mean of its figures, so every contender for the best needs the same three."""
    path = space_path.with_suffix(".json")
    landscape = json.loads(path.read_text())
    measure = _measurer(spec.load(space_path))
    best = max(g["samples_per_sec"] or 0 for g in landscape["grid"])
    done = {json.dumps(r["config"], sort_keys=True) for r in landscape.get("repeats", [])}
    todo = [g for g in landscape["grid"] if (g["samples_per_sec"] or 0) >= within * best
            and json.dumps(g["config"], sort_keys=True) not in done]
    for g in todo:
        figures = [g["samples_per_sec"]] + [measure(g["config"]).get("samples_per_sec") for _ in range(2)]
        landscape.setdefault("repeats", []).append({"config": g["config"], "samples_per_sec": figures})
        path.write_text(json.dumps(landscape, indent=1))  # kept if the run is cut short
        print(f"  repeat {g['config']}: {[round(f or 0, 1) for f in figures]}", flush=True)
    landscape.setdefault("repeats_added", []).append({
        "date": time.strftime("%Y-%m-%d %H:%M"), "within": within, "configs": len(todo),
        "hardware": {**describe(), "cpu_has_bf16": cpu_has_bf16()}})
    path.write_text(json.dumps(landscape, indent=1))
    print(f"wrote {path} ({len(todo)} configs repeated)")
    return path


def context(space: spec.Space, hardware: dict | None = None) -> knobs.Context:
    """The search's knob context on the machine that measured the landscape (``hardware``
    as recorded; None: this machine), so that a GPU landscape replays here as on its GPU."""
    from tuner.trial import make_request, resolve_config

    resolved = resolve_config(make_request(workload=space.model.workload, workload_args=space.model.workload_args,
                                           base_dir=str(space.base_dir), device="cpu"))
    ctx = apply.context_for(resolved.device, has_groups=resolved.workload.groups is not None)
    hardware = hardware or {}
    gpu = space.model.device == "cuda"
    return dataclasses.replace(ctx, device="cuda" if gpu else "cpu",
                               cpu_count=hardware.get("cpu_count") or ctx.cpu_count,
                               bf16_native=gpu or hardware.get("cpu_has_bf16", ctx.bf16_native))


def repeat_cv(landscape: dict) -> float:
    """The repeat-to-repeat CV of one config's figure, pooled over the repeated configs
    (at least 2%: a trial a minute later meets a machine that drifted)."""
    cvs = [statistics.stdev(f) / statistics.mean(f) for r in landscape.get("repeats", [])
           if len(f := [x for x in r["samples_per_sec"] if x]) >= 2]
    return max(0.02, statistics.median(cvs)) if cvs else 0.03


# ---- the replayed machine ----------------------------------------------------------------


def judged_rates(landscape: dict, canon: Canonical, ss: SearchSpace) -> tuple[dict, str]:
    """Each config's rate as the judge takes it, and how ("means" or "first figures").
    The best config's first figure is the luckiest draw of many (the winner's curse:
    repeated, the best configs of the grids read 0.92-1.01 of it on average), so where
    every config within ``REPEAT_BAND`` of the best has three figures on one host
    (``repeat``), a config's rate is their mean; otherwise every config's is its first
    figure (means for a few and first figures for the rest would judge the two kinds
    differently)."""
    first = {canon(ss.active(g["config"])): g["samples_per_sec"] or 0.0 for g in landscape["grid"]}
    repeated = {canon(ss.active(r["config"])): [x for x in r["samples_per_sec"] if x]
                for r in landscape.get("repeats", [])}
    best = max(first.values())
    if not all(repeated.get(k) for k, v in first.items() if v >= REPEAT_BAND * best):
        return first, "first figures"
    return {k: statistics.mean(repeated[k]) if repeated.get(k) else v for k, v in first.items()}, "means"


class Machine:
    """Measurements drawn from a landscape, for one seed."""

    TRANSIENT = 2  # windows kept in their recorded order: the start-up transient

    def __init__(self, landscape: dict, canon: Canonical, ss: SearchSpace, seed: int):
        self.truth = {}
        for g in landscape["grid"]:
            self.truth[canon(ss.active(g["config"]))] = g
        self.rate, _ = judged_rates(landscape, canon, ss)
        self.optimum = max(self.rate.values())
        self.cv = repeat_cv(landscape)
        self.settings = landscape["measure"]
        self.rng = random.Random(seed)

    def value(self, key: str) -> float:
        return self.rate[key]

    def measure(self, key: str, config: dict, screen: dict | None = None, windows: int | None = None) -> dict:
        g = self.truth[key]
        if not g["samples_per_sec"]:
            return {"key": key, "config": config, "status": "infeasible", "reason": g.get("reason"),
                    "samples_per_sec": None}
        recorded = g["windows"] or [g["samples_per_sec"]]
        least = windows or self.settings.get("min_windows", 5)
        most = windows or self.settings.get("max_windows", 12)
        steady = recorded[self.TRANSIENT:] or recorded
        factor = max(0.5, self.rng.gauss(1.0, self.cv))
        rates, screened = [], False
        while len(rates) < most:  # the stopping rules of ``tuner.measure.measure``
            i = len(rates)
            rates.append((recorded[i] if i < min(self.TRANSIENT, len(recorded)) else self.rng.choice(steady)) * factor)
            done = windows_verdict(rates, screen, min_windows=least,
                                   target_error=self.settings.get("target_error", 0.01),
                                   screen_windows=self.settings.get("screen_windows", 2))
            screened = done == "screened"
            if done:
                break
        # the figure: the recorded one, with this draw's drift and window noise (a screened
        # measurement reports its windows' median, as the trial does)
        body = rates[self.TRANSIENT:]
        figure = (statistics.median(rates) if screened or not body else
                  self.rate[key] * statistics.median(body) / statistics.median(steady))  # body holds the factor
        return {"key": key, "config": config, "status": "ok", "samples_per_sec": figure,
                "samples_per_sec_error": median_error(rates) if len(rates) > 1 else 0.05,
                "screened": screened}


# ---- one replayed search ---------------------------------------------------------------------


def make_sampler(strategy: str, space: spec.Space, ctx: knobs.Context, canon: Canonical, seed: int) -> optuna.samplers.BaseSampler:
    if strategy == "tuner":
        return GuidedSampler(space.searched, space.start_points(ctx), canon,
                             seed=seed, cores=ctx.cpu_count if ctx.device == "cpu" else None)
    if strategy == "stock-tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if strategy == "tpe-mv":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=4)
    if strategy == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=4, warn_independent_sampling=False)
    return optuna.samplers.RandomSampler(seed=seed)


def replay(landscape: dict, space: spec.Space, ctx: knobs.Context, strategy: str, seed: int,
           budgets: tuple[int, ...] = BUDGETS) -> dict:
    """One search of max(budgets) configs; the pick at each budget from its first configs."""
    canon, ss = Canonical(space, ctx), SearchSpace(space, ctx)
    machine = Machine(landscape, canon, ss, seed)
    metric = "samples_per_sec"
    flow = strategy != "stock-tpe"  # the tuner's flow: starts, screening, rechecks, confirm
    sampler = make_sampler(strategy, space, ctx, canon, seed)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    if flow and strategy != "tuner":  # the guided sampler starts there itself
        for point in space.start_points(ctx):
            study.enqueue_trial(ss.active(point), skip_if_exists=True)
    board = Board(screening=flow, recheck_after=space.model.measure.recheck_after)
    records: list[dict] = []
    tried: list[str] = []  # distinct configs, in the order first tried
    screened: set[str] = set()
    prefix: dict[int, int] = {}  # budget -> number of records when that many configs were tried
    guard = 0
    while len(tried) < max(budgets) and guard < 4 * max(budgets):
        guard += 1
        trial = study.ask()
        ss(trial)
        config = ss.active({k: trial.params.get(k, v[0]) for k, v in space.searched.items()})
        key = canon(config)
        if key not in tried and len(tried) == len(machine.truth):
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            break
        retry = key in screened  # measured in full this time (``Board.state(screen=False)``)
        screen = json.loads(board.state(screen=not retry))["screen"]  # once: it may ask a recheck
        if screen and screen.get("recheck"):
            rk = canon(ss.active({k: screen["recheck"].get(k) for k in space.searched}))
            rec = {**machine.measure(rk, screen["recheck"]), "phase": "recheck"}
            records.append(rec)
            board.update(rec)
            if rec["samples_per_sec"]:
                screen = {**screen, "below": rec["samples_per_sec"]}
        rec = {**machine.measure(key, config, screen=screen if flow else None), "phase": "search"}
        if rec.get("screened"):
            screened.add(key)
        records.append(rec)
        board.update({**rec, "config": config})
        if rec.get("screened"):
            study._storage.set_trial_user_attr(trial._trial_id, "screened", True)
        study.tell(trial, rec["samples_per_sec"] if rec["status"] == "ok" else 0.0)
        if key not in tried:
            tried.append(key)
            if len(tried) in budgets:
                prefix[len(tried)] = len(records)
    out = {}
    for b in budgets:
        upto = records[:prefix.get(b, len(records))]
        if flow:
            pick, fn = confirm_and_pick(upto, space, machine, metric)
        else:  # stock Tune: the best single reported figure
            ok = [r for r in upto if r["status"] == "ok"]
            pick, fn = (max(ok, key=lambda r: r[metric])["key"] if ok else None), None
        out[b] = {"pick": machine.value(pick) / machine.optimum if pick else 0.0, "false_negatives": fn,
                  "measurements": len(upto)}
    return out


def confirm_and_pick(records: list[dict], space: spec.Space, machine: Machine, metric: str) -> tuple[str | None, list]:
    """The confirm round as ``tuner.search._confirm`` chooses it, then ``best_of``; and the
    screening false negatives: (screened, within 3% of the pick) per screened config."""
    records = [dict(r) for r in records]
    rows = within_noise(rank(aggregate(records, metric), metric), metric)[: space.model.confirm.top]
    for _ in range(space.model.confirm.repeats):
        for row in rows:
            records.append({**machine.measure(row["key"], row["config"]), "phase": "confirm"})
        rows = within_noise(rank(aggregate(records, metric), metric), metric)[: space.model.confirm.top]
        if len(rows) < 2:
            break
    best = best_of(rank(aggregate(records, metric), metric))
    if best is None:
        return None, []
    pick_value = machine.value(best["key"])
    screened = {r["key"] for r in records if r.get("screened")}
    full = {r["key"] for r in records if r.get("status") == "ok" and not r.get("screened")}
    return best["key"], [machine.value(k) >= 0.97 * pick_value for k in screened - full]


# ---- the benchmark ---------------------------------------------------------------------------


def _job(args: tuple) -> tuple:
    name, strategy, seed = args
    landscape, space, ctx = _load(name)
    return name, strategy, seed, replay(landscape, space, ctx, strategy, seed)


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    rec = sub.add_parser("record", help="measure a landscape's full grid")
    rec.add_argument("space", nargs="+")
    rec.add_argument("--repeats", type=int, default=4, help="configs measured twice more (the best two, then random)")
    rep = sub.add_parser("repeat", help="measure the configs near a landscape's best twice more")
    rep.add_argument("space", nargs="+")
    rep.add_argument("--within", type=float, default=REPEAT_BAND, help="configs within this fraction of the best")
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--gp-seeds", type=int, default=30, help="the GP sampler is slow: fewer seeds")
    ap.add_argument("--landscapes", nargs="*", help="names under benchmarks/landscapes (default: all recorded)")
    ap.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--real-run", action="store_true", help="also time the real quickstart search")
    ap.add_argument("--real-run-only", action="store_true",
                    help="time the real quickstart search into the existing JSON, no replay")
    ap.add_argument("--out", default=str(HERE / "out" / "search_replay.json"))
    a = ap.parse_args()
    if a.cmd == "record":
        for s in a.space:
            record(Path(s), a.repeats)
        return
    if a.cmd == "repeat":
        for s in a.space:
            repeat(Path(s), a.within)
        return
    if a.real_run_only:
        data = json.loads(Path(a.out).read_text())
        data["real_run"] = real = real_run()
        data.setdefault("hardware", describe())
        Path(a.out).write_text(json.dumps(data, indent=1, default=str))
        print(f"quickstart, the real tuner: {real['command_wall_s']:.0f} s to its recommendation; wrote {a.out}")
        return
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = a.landscapes or sorted(p.stem for p in LANDSCAPES.glob("*.json"))
    jobs = [(n, s, seed) for n in names for s in a.strategies
            for seed in range(a.gp_seeds if s == "gp" else a.seeds)]
    t0 = time.time()
    results: dict = {}
    with ProcessPoolExecutor(a.jobs, initializer=optuna.logging.set_verbosity,
                             initargs=(optuna.logging.WARNING,)) as pool:
        for name, strategy, _seed, out in pool.map(_job, jobs, chunksize=8):
            for b, r in out.items():
                results.setdefault(name, {}).setdefault(strategy, {}).setdefault(b, []).append(r)
    table: dict = {}
    for name in names:
        landscape = _load(name)[0]
        ok = [g["samples_per_sec"] for g in landscape["grid"] if g["samples_per_sec"]]
        print(f"\n{name}: {len(landscape['grid'])} configs, best {max(ok):.1f}, median "
              f"{statistics.median(ok):.1f} samples/s; repeat CV {repeat_cv(landscape):.3f} "
              f"({landscape['hardware'].get('cpu')}, {landscape.get('measured', '?')})")
        print(f"  {'strategy':<10}" + "".join(f"{b:>16}" for b in BUDGETS) + "   (pick / best: median, p10)")
        for strategy in a.strategies:
            row = {}
            for b in BUDGETS:
                runs = results[name][strategy][b]
                picks = [r["pick"] for r in runs]
                fns = [x for r in runs for x in (r["false_negatives"] or [])]
                row[b] = {"median": statistics.median(picks), "p10": quantile(picks, 0.1), "seeds": len(runs),
                          "screened": len(fns), "false_negative_rate": (sum(fns) / len(fns)) if fns else None,
                          "measurements": statistics.median(r["measurements"] for r in runs)}
            table.setdefault(name, {})[strategy] = row
            print(f"  {strategy:<10}" + "".join(f"{row[b]['median']:>9.3f} {row[b]['p10']:.3f}" for b in BUDGETS))
        fn = table[name].get("tuner", {}).get(12, {})
        if fn.get("false_negative_rate") is not None:
            print(f"  tuner's screening at 12 configs: {fn['screened']} screened over the seeds, "
                  f"{fn['false_negative_rate']:.1%} within 3% of the pick")
    real = real_run() if a.real_run else None
    if real:
        print(f"quickstart, the real tuner: {real['command_wall_s']:.0f} s to its recommendation "
              f"({real['trials']} configs, {real['measurements']} measurements, "
              f"{real['speedup_vs_baseline']:.2f}x the plain loop)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "real_run": real,
        "benchmark": "search_replay", **stamp(),
        "seeds": a.seeds, "gp_seeds": a.gp_seeds, "budgets": BUDGETS, "wall_s": time.time() - t0,
        "landscapes": {n: {"measured": _load(n)[0].get("measured"), "hardware": _load(n)[0]["hardware"],
                           "configs": len(_load(n)[0]["grid"]), "repeat_cv": repeat_cv(_load(n)[0]),
                           "judge": judge(n)} for n in names},
        "results": table}, indent=1, default=str))
    print(f"\nwrote {a.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
