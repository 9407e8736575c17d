"""``report.md`` and its PNG plots for a results folder (terminal tables: ``tables``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuner import spec
from tuner.diagnose import diagnose
from tuner.errors import UserError
from tuner.records import baseline_drift
from tuner.results import Results
from tuner.tables import (
    baseline_label,
    diff_from_default,
    drift_line,
    fmt,
    recompiled,
    row_status,
    search_hot_path_lines,
    table_rows,
    unconfirmed,
)

# ---- report.md and plots ------------------------------------------------------------------


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("report: plots need matplotlib; install it with `pip install matplotlib` "
                        "(or `pip install -e '.[plots]'`)") from None
    return plt


def plot_best_so_far(res: Results, path: Path) -> None:
    plt = _pyplot()
    metric = res.metric
    better = max if spec.OBJECTIVE_METRICS[metric] == "max" else min
    xs, ys, best = [], [], None
    for i, r in enumerate([r for r in res.records if r.get("phase") == "search"], 1):
        v = r.get(metric) if r.get("status") == "ok" else None
        if v is not None:
            best = v if best is None else better(best, v)
        xs.append(i)
        ys.append(best)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.step(xs, [y if y is not None else float("nan") for y in ys], where="post", label="best so far")
    raw = [r.get(metric) if r.get("status") == "ok" else None
           for r in res.records if r.get("phase") == "search"]
    ax.scatter([x for x, v in zip(xs, raw, strict=True) if v is not None], [v for v in raw if v is not None],
               s=12, alpha=0.6, label="trial")
    base = res.baseline
    if base and base.get(metric):
        ax.axhline(base[metric], color="gray", ls="--", label="baseline")
    ax.set_xlabel("trial")
    ax.set_ylabel(metric)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speed_vs_memory(res: Results, path: Path) -> None:
    from tuner.records import pareto_front

    plt = _pyplot()
    metric = res.metric
    rows = [r for r in res.rows() if r["feasible"] and r.get("memory_mb") is not None]
    front = pareto_front(res.rows(), metric)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([r["memory_mb"] for r in rows], [r[metric] for r in rows], s=18, alpha=0.7, label="config")
    if front:
        ax.plot([r["memory_mb"] for r in front], [r[metric] for r in front], "r-o", ms=5, label="Pareto front")
    base = res.baseline
    if base and base.get(metric):
        mem = base.get("peak_device_memory_mb") or base.get("peak_host_memory_mb")
        ax.scatter([mem], [base[metric]], marker="x", color="black", s=40, label="baseline")
    ax.set_xlabel("peak memory (MB)")
    ax.set_ylabel(metric)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_knob_effects(res: Results, path: Path) -> list[str]:
    """Per searched knob: the objective of every feasible config, by the knob's value."""
    plt = _pyplot()
    metric = res.metric
    rows = [r for r in res.rows() if r["feasible"]]
    names = [k for k, v in res.space.knobs.items() if isinstance(v, (list, dict)) and
             len({str(r["config"].get(k)) for r in rows}) > 1]
    if not names:
        return []
    fig, axes = plt.subplots(1, len(names), figsize=(2.6 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        values = sorted({str(r["config"].get(name)) for r in rows})
        data = [[r[metric] for r in rows if str(r["config"].get(name)) == v] for v in values]
        ax.boxplot(data)
        ax.set_xticks(range(1, len(values) + 1), values, rotation=30, fontsize=7)
        ax.set_title(name, fontsize=9)
    axes[0][0].set_ylabel(metric)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return names


def plot_importance(res: Results, path: Path) -> str | None:
    """Knob importance from Optuna's PED-ANOVA evaluator over the study; None if it cannot."""
    plt = _pyplot()
    import optuna
    from optuna.importance import PedAnovaImportanceEvaluator
    from optuna.visualization.matplotlib import plot_param_importances

    journal = res.path / "optuna.journal"
    if not journal.is_file():
        return "no Optuna study in the results folder"
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    try:
        study = optuna.load_study(study_name=res.space.name, storage=storage)
        complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if len(complete) < 3:
            return f"knob importance needs 3 or more completed trials (have {len(complete)})"
        target = (lambda t: t.values[0]) if len(study.directions) > 1 else None
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ax = plot_param_importances(study, evaluator=PedAnovaImportanceEvaluator(), target=target,
                                        target_name=res.metric)
        ax.figure.set_size_inches(6, 3.5)
        ax.figure.tight_layout()
        ax.figure.savefig(path, dpi=110)
        plt.close(ax.figure)
    except Exception as exc:  # too few distinct values, conditional params...: say why, keep the report
        return f"knob importance unavailable: {type(exc).__name__}: {exc}"
    return None


def write_report(res: Results) -> Path:
    """report.md and its PNGs in the results folder; returns the markdown's path."""
    out = res.path
    metric = res.metric
    notes: list[str] = []
    plot_best_so_far(res, out / "best_so_far.png")
    plot_speed_vs_memory(res, out / "speed_vs_memory.png")
    effects = plot_knob_effects(res, out / "knob_effects.png")
    imp = plot_importance(res, out / "importance.png")
    if imp:
        notes.append(imp)
    best = res.best()
    lines = [f"# tuner report: {res.space.name}", ""]
    hw = (best or res.baseline or {}).get("hardware") or {}
    lines.append(f"Workload `{res.space.workload}`{' ' + str(res.space.workload_args) if res.space.workload_args else ''}, objective **{metric}** "
                 f"({spec.OBJECTIVE_METRICS[metric]}), on {hw.get('gpu') or hw.get('cpu')} "
                 f"({hw.get('cpu_count')} CPUs), torch {hw.get('torch')}.")
    lines.append("")
    if best:
        sp = res.speedup(best)
        lines.append(f"**Best**: {fmt(best[metric])} {metric}"
                     + (f", **{sp:.2f}x** the plain PyTorch loop" if sp else "")
                     + (f" (median of its {best['confirm_measurements']} confirm-round measurement(s), of "
                        f"{best['measurements']} in all" if best.get("confirm_measurements")
                        else f" (median of {best['measurements']} measurement(s)")
                     + (f", spread {best['spread'] * 100:.1f}%" if best.get("spread") is not None else "") + ").")
        lines.append("")
        lines.append(f"`{diff_from_default(best['config'])}`")
        lines.append("")
    cap = res.space.constraints.max_memory_mb
    if best:
        d = diagnose(best, cap).against(best, table_rows(res), metric)
        lines += [f"**Bottleneck of the best config**: {d.verdict} ({d.evidence}).", ""]
        lines += [f"- try: {r}" for r in d.recommendations] + [f"- measured: {m}" for m in d.measured]
        lines += [f"- note: {f}" for f in d.flags] + [""]
    checked = search_hot_path_lines((res.summary or {}).get("hot_path"))
    if checked:
        lines += ["## Hot path", "", "Defects in the workload's own step, checked once for the baseline and "
                  "the pick (`python -m tuner profile` checks any config):", "", "```", *checked, "```", ""]
    lines += ["## Configs", "", f"| # | status | {metric} | spread | n | speedup | memory MB | bottleneck | config |",
              "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(table_rows(res), 1):
        sp = res.speedup(r)
        detail = diff_from_default(r["config"]) + recompiled(r) + unconfirmed(r, best, metric) \
            + ("" if r["feasible"] else f" — {r['reason']}")
        status = row_status(r)
        spread = f"{r['spread'] * 100:.1f}%" if r.get("spread") is not None else "-"
        verdict = diagnose(r, cap).verdict if r["feasible"] else "-"
        lines.append(f"| {i} | {status} | {fmt(r.get(metric))} | {spread} | "
                     f"{r['measurements']} | {f'{sp:.2f}x' if sp else '-'} | {fmt(r.get('memory_mb'), digits=0)} | "
                     f"{verdict} | {detail} |")
    base = res.baseline
    if base:
        lines.append(f"| b | {base.get('status')} | {fmt(base.get(metric))} | - | {base.get('measurements') or 1} | "
                     f"1.00x | {fmt(base.get('peak_device_memory_mb') or base.get('peak_host_memory_mb'), digits=0)} | "
                     f"{diagnose(base, cap).verdict} | baseline: {baseline_label(base.get('config'))} |")
        drift = drift_line(baseline_drift(res.records, metric), metric)
        if drift:
            lines += ["", drift[0].upper() + drift[1:]]
    lines += ["", "## Plots", "", "Best so far over trials:", "", "![best so far](best_so_far.png)", "",
              "Throughput against peak memory, Pareto front in red:", "", "![speed vs memory](speed_vs_memory.png)", ""]
    if effects:
        lines += ["Per-knob effect (each box: the configs with that value):", "", "![knob effects](knob_effects.png)", ""]
    if imp is None:
        lines += ["Knob importance (Optuna, PED-ANOVA):", "", "![importance](importance.png)", ""]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    md = out / "report.md"
    md.write_text("\n".join(lines))
    return md
