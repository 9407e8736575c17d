"""Every terminal table and the progress line, with one number formatter.

``show``'s table, ``bench``'s, the search's summary and progress line, and the
bottleneck diagnosis all print from here; nothing here computes a figure (that is
``records``) or starts Ray.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from tuner import knobs, spec
from tuner.diagnose import Diagnosis, diagnose, per_item
from tuner.records import baseline_drift, configs_tried, speedup
from tuner.results import Results


def fmt(value: Any, unit: str = "", digits: int = 1) -> str:
    """A figure for a table: ``-`` when missing, floats with thousands separators."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    return f"{value}{unit}"


def _away_from_defaults(config: dict | None) -> list[str]:
    d = knobs.defaults()
    return [f"{k}={v}" for k, v in (config or {}).items() if k not in d or d[k] != v]


def diff_from_default(config: dict) -> str:
    """The knobs a config sets away from PyTorch's defaults (what makes it different)."""
    return ", ".join(_away_from_defaults(config)) or "PyTorch defaults"


def baseline_label(config: dict | None) -> str:
    """The baseline, named: the plain PyTorch loop, and the knobs it sets away from
    PyTorch's defaults (the space's first batch, say)."""
    return ", ".join(["plain PyTorch loop", *_away_from_defaults(config)])


def recompiled(row: dict) -> str:
    """A compiled row whose figure holds recompiles, said beside its config."""
    n = row.get("recompiles_in_windows")
    return f"  (recompiled {n:g}x in its timed windows)" if n else ""


def unconfirmed(row: dict, best: dict | None, metric: str) -> str:
    """A row that reads better than the pick on figures the confirm rounds did not take,
    said beside it: the pick is the best of the configs they measured side by side (a
    lone search figure is the likeliest to be a lucky draw), and they had no place for
    this one."""
    if best is None or row.get("config") == best.get("config") or row.get("screened") or row.get("disturbed") \
            or row.get(metric) is None or best.get(metric) is None:
        return ""
    better = row[metric] > best[metric] if spec.OBJECTIVE_METRICS[metric] == "max" else row[metric] < best[metric]
    if not better:
        return ""
    if best.get("confirm_measurements") and not row.get("confirm_measurements"):
        return "  (not in the confirm rounds: the pick is the best of the configs they measured side by side)"
    if row.get("measurements", 1) <= 1 < best.get("measurements", 1):
        return "  (one measurement, not confirmed: the pick is the best of the configs measured again)"
    return ""


def row_status(row: dict) -> str:
    """A row's status word in the tables: whether it may win, and if not, why."""
    if not row["feasible"]:
        return "not run" if row.get("held") else "infeasible"
    return "screened" if row.get("screened") else "disturbed" if row.get("disturbed") else "ok"


def table_rows(res: Results) -> list[dict]:
    """Every config: feasible ones sorted by the objective, then the infeasible ones."""
    from tuner.records import winner_first

    rows = res.rows()
    ranked = winner_first(res.ranked(), res.best())
    feasible_keys = {r["key"] for r in ranked}
    return ranked + [r for r in rows if r["key"] not in feasible_keys]


def print_show(res: Results, out: Any = None, limit: int | None = None) -> None:
    out = sys.stdout if out is None else out  # at call time: a replaced sys.stdout is honoured
    metric = res.metric
    state = "finished" if res.summary else "running or interrupted"
    print(f"{res.space.name}: {len(configs_tried(res.records))}/{res.space.search_trials()} trials ({state}), "
          f"objective {metric} ({spec.OBJECTIVE_METRICS[metric]})", file=out)
    print(f"{'#':>3}  {'status':<10} {metric:>16} {'spread':>7} {'n':>2} {'speedup':>7} {'memory MB':>9}  "
          f"{'bottleneck':<15}  config / reason", file=out)
    rows = table_rows(res)
    cap = res.space.constraints.max_memory_mb
    pick = res.best()
    for i, r in enumerate(rows[:limit] if limit else rows, 1):
        status = row_status(r)
        spread = f"{r['spread'] * 100:.1f}%" if r.get("spread") is not None else "-"
        sp = res.speedup(r)
        detail = diff_from_default(r["config"])
        if r.get("scaling_efficiency") is not None:
            detail += f"  (scaling: {r['scaling_efficiency']:.0%} of {r['config']['world_size']}x one rank)"
        if r.get("joules_per_sample"):
            detail += f"  ({r['joules_per_sample']:.3g} J/sample)"
        detail += recompiled(r) + unconfirmed(r, pick, metric)
        if not r["feasible"]:
            detail += f"  -- {r['reason']}"
        elif r.get("screened"):
            detail += "  -- screened: its first windows could not reach the leader; never picked"
        elif r.get("disturbed"):
            detail += "  -- measured only while other load disturbed the machine: never picked"
        verdict = diagnose(r, cap).verdict if r["feasible"] else "-"
        print(f"{i:>3}  {status:<10} {fmt(r.get(metric)):>16} {spread:>7} {r['measurements']:>2} "
              f"{(f'{sp:.2f}x' if sp else '-'):>7} {fmt(r.get('memory_mb'), digits=0):>9}  {verdict:<15}  {detail}",
              file=out)
    models = {r["device_model"] for r in rows if r["feasible"]}
    if len(models) > 1:  # a mixed cluster: each GPU model has its own winner
        print("best per device model:", file=out)
        for model in sorted(models):
            r = next(r for r in res.ranked() if r["device_model"] == model)
            print(f"  {model}: {fmt(r.get(metric))} {metric}  {diff_from_default(r['config'])}", file=out)
    base = res.baseline
    if base:
        extra = "" if base.get("status") == "ok" else f"  -- {base.get('reason')}"
        mem = base.get("peak_device_memory_mb") or base.get("peak_host_memory_mb")
        print(f"{'b':>3}  {base.get('status', '-'):<10} {fmt(base.get(metric)):>16} {'':>7} "
              f"{base.get('measurements') or 1:>2} "
              f"{'1.00x':>7} {fmt(mem, digits=0):>9}  {diagnose(base, cap).verdict:<15}  "
              f"baseline: {baseline_label(base['config'])}{extra}", file=out)
    drift = drift_line(baseline_drift(res.records, metric), metric)
    if drift:
        print(drift, file=out)
    for r in (r for r in res.records if r.get("phase") == "lost"):
        print(f"  lost: {diff_from_default(r['config'])}: {r.get('reason')}", file=out)
    best = res.best()
    if best is not None:
        print_diagnosis("best config", diagnose(best, cap).against(best, rows, metric), out)
        for n in best.get("notes") or []:  # what its trial found about the workload or the run
            print(f"  note: {n}", file=out)
    else:
        print(f"no winner: {res.no_winner()}", file=out)
    for line in search_hot_path_lines((res.summary or {}).get("hot_path")):
        print(line, file=out)


def print_diagnosis(what: str, d: Diagnosis, out: Any = None) -> None:
    """The verdict and the recommendations, each with the figure that triggered it."""
    out = sys.stdout if out is None else out  # at call time: a replaced sys.stdout is honoured
    print(f"{what}: {d.verdict} ({d.evidence})", file=out)
    for r in d.recommendations:
        print(f"  try: {r}", file=out)
    for m in d.measured:
        print(f"  measured: {m}", file=out)
    for f in d.flags:
        print(f"  note: {f}", file=out)


def _collate(result: dict) -> str:
    """The collate's time per item, beside a loading process's whole time per item where
    the loading showed."""
    collate, load = result.get("collate_s_per_sample"), result.get("load_samples_per_sec_per_process")
    if collate is None:
        return "-"
    return f"{per_item(collate)} an item" + (f" (of the {per_item(1 / load)} an item costs a loading process)"
                                             if load else "")


def print_bench(result: dict, out: Any = None) -> None:
    """A readable table of one measurement."""
    out = sys.stdout if out is None else out  # at call time: a replaced sys.stdout is honoured
    rows = [
        ("status", result["status"] + (f" ({result['reason']})" if result.get("reason") else "")),
        ("samples/sec (sustained)", fmt(result.get("samples_per_sec"))
         + (" (fitted on the batches' lengths over a whole epoch's)"
            if result.get("steady_from") == "batch lengths" else "")),
        ("  window spread", fmt((result.get("samples_per_sec_spread") or 0) * 100, "%")
         if result.get("samples_per_sec_spread") is not None else "-"),
        ("  steady (in-epoch)", fmt(result.get("steady_samples_per_sec"))),
        ("step time", fmt(result.get("step_time_ms"), " ms", 2)),
        ("data wait", fmt((result.get("data_wait_fraction") or 0) * 100, "% of step")
         if result.get("data_wait_fraction") is not None else "-"),
        ("collate", _collate(result)),
        ("full garbage collections", (fmt(result["gc_share"] * 100, "% of the windows", 1)
                                      if result.get("gc_share") is not None else "-")
         + (f" (the workers': {result['workers_gc_share']:.1%} of theirs)"
            if result.get("workers_gc_share") is not None else "")),
        ("warm-up", fmt(result.get("warmup_s"), " s", 2)),
        ("compile", fmt(result.get("compile_s"), " s", 2)),
        ("epoch start overhead", fmt(result.get("epoch_overhead_s"), " s", 3)),
        ("projected run", fmt(result.get("projected_run_s"), " s")),
        ("peak host memory", fmt(result.get("peak_host_memory_mb"), " MB", 0)
         + (" (peak RSS + workers' private pages)" if result.get("peak_host_memory_mb") else "")),
        ("peak device memory", fmt(result.get("peak_device_memory_mb"), " MB", 0)),
        ("MFU", fmt((result.get("mfu") or 0) * 100, "%", 2) if result.get("mfu") else "-"),
        ("GPU energy", f"{result['joules_per_sample']:.4g} J/sample at {fmt(result.get('gpu_power_w'), ' W', 0)}"
         if result.get("joules_per_sample") else "-"),
        ("loss finite", fmt(result.get("loss_finite"))),
        ("other load beside it", fmt(result.get("interference_cores"), " cores", 3)
         + (f" (tuner's own {result['tuner_cpu_cores']:.3f})" if result.get("tuner_cpu_cores") else "")),
        ("disturbed windows redone", fmt(result.get("disturbed_windows_dropped"))),
    ]
    if (result.get("world_size") or 1) > 1:
        slow = next((r for r in result.get("ranks") or [] if r["rank"] == result.get("slowest_rank")), None)
        rows.append(("data-parallel ranks", f"{result['world_size']}, "
                     f"{fmt(result.get('samples_per_sec_per_rank'))} samples/s each"))
        if slow:
            rows.append(("slowest rank", f"rank {slow['rank']}: step {fmt(slow['step_time_ms'], ' ms', 2)}, "
                         f"data wait {fmt(100 * (slow.get('data_wait_fraction') or 0), '%')}"))
        for node, mb in (result.get("host_memory_per_node_mb") or {}).items():
            rows.append((f"host memory, node {node[:8]}", f"{fmt(mb, ' MB', 0)} (all ranks and workers)"))

    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}", file=out)
    cfg = result.get("config") or {}
    print("config: " + ", ".join(f"{k}={v}" for k, v in cfg.items()), file=out)
    for note in result.get("notes") or []:
        print(f"note: {note}", file=out)
    if result.get("disturbed"):
        print("warning: other load on the machine disturbed over a third of the windows even after re-measuring; "
              "measure again on a quiet machine", file=out)
    if result["status"] == "ok":
        print_diagnosis("bottleneck", diagnose(result), out)


class Progress:
    """One status line: trials done/total, best so far and its speedup, elapsed. On a
    terminal the line is rewritten in place; in a log (a Ray job's, a redirected stderr)
    each line is news: a search trial done, a baseline's figure, a task begun, a failure."""

    def __init__(self, total: int, metric: str, quiet: bool):
        self.total, self.metric, self.quiet = total, metric, quiet
        self.tty = sys.stderr.isatty()
        self.t0 = time.time()
        self.tried: set[str] = set()  # the configs measured (a screened one measured again is one)
        self.done = 0  # those without a key (a record not from a search)
        self.best: float | None = None
        self.best_disturbed = False  # every measurement so far had other load beside it
        self.baseline: float | None = None

    def update(self, record: dict | None = None, msg: str | None = None) -> None:
        """A line for ``record`` (a trial's, landed) or ``msg``; ``best`` and ``baseline``
        are the driver's to set, as the summary takes them."""
        if record is not None and record.get("phase") == "search":
            if "key" in record:
                self.tried |= configs_tried([record])
            else:
                self.done += 1
        if self.quiet:
            return
        if record is not None and record.get("phase") == "baseline" and record.get("status") == "ok" \
                and msg is None and record.get(self.metric) is not None:
            msg = f"baseline {record[self.metric]:,.1f} {self.metric}"
        elif not self.tty and msg is None and record is not None and record.get("phase") != "search" \
                and record.get("status") in (None, "ok"):
            return  # a log gets a line where there is news: the next task's line follows this one
        elapsed = time.time() - self.t0
        parts = [f"[{self.done + len(self.tried)}/{self.total}]"]
        if self.best is not None:
            parts.append(f"best {self.best:,.1f} {self.metric}")
            ratio = speedup(self.best, self.baseline, self.metric)
            if ratio is not None:
                parts.append(f"({ratio:.2f}x baseline)")
            if self.best_disturbed:
                parts.append("(disturbed by other load: it cannot win; `tuner doctor` names the load)")
        parts.append(f"elapsed {int(elapsed // 60)}:{int(elapsed % 60):02d}")
        if msg:
            parts.append(msg)
        # what the trial that landed read, and in a log its config: a line per trial says
        # what the search measured (a terminal's line stays short: it is rewritten in place)
        said = f": {diff_from_default(record.get('config') or {})}" if record is not None and not self.tty else ""
        if record is not None and record.get("status") not in (None, "ok"):
            parts.append(f"trial infeasible: {record.get('reason')}{said}")
        elif record is not None and record.get("phase") == "search" and record.get(self.metric) is not None:
            marks = "".join(f" ({m})" for m in ("screened", "disturbed") if record.get(m))
            parts.append(f"last {record[self.metric]:,.1f}{marks}{said}")
        line = "  ".join(parts)
        if self.tty:
            print("\r\033[K" + line, end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        """A line that stays, on the search as a whole (printed under ``quiet`` too: it is
        about what the search measures, not its progress)."""
        print(("\r\033[K" if self.tty and not self.quiet else "") + f"note: {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty and not self.quiet:
            print(file=sys.stderr)


def print_summary(summary: dict, out: Any = None) -> None:
    out = sys.stdout if out is None else out  # at call time: a replaced sys.stdout is honoured
    metric = summary["objective"]["metric"]
    base = summary["baseline"]
    resumed = " (this run of the resumed search)" if (summary.get("policy") or {}).get("resumed") else ""
    print(f"\n{summary['name']}: {summary['trials']} trials, {summary['measurements']} measurements, "
          f"{summary['search_wall_s']:.0f} s{resumed}", file=out)
    header = f"{'#':>2}  {metric:>16}  {'spread':>7}  {'n':>2}  {'speedup':>7}  {'memory MB':>9}  config"
    print(header, file=out)
    base_v = base.get(metric)

    def speed(row: dict) -> str:
        # a summary written before rows carried their own speed-up: against the pooled baseline
        x = row["speedup"] if "speedup" in row else speedup(row[metric], base_v, metric)
        return "-" if x is None else f"{x:.2f}x"

    for i, r in enumerate(summary["top"], 1):
        spread = f"{r['spread'] * 100:.1f}%" if r.get("spread") is not None else "-"
        mem = r.get("memory_mb")
        diff = diff_from_default(r["config"])  # as show and report name a config
        if r.get("screened"):
            diff += "  (screened: never picked)"
        elif r.get("disturbed"):
            diff += "  (disturbed: never picked)"
        diff += unconfirmed(r, summary["top"][0], metric)
        print(f"{i:>2}  {r[metric]:>16,.1f}  {spread:>7}  {r['measurements']:>2}  {speed(r):>7}  "
              f"{'-' if mem is None else f'{mem:,.0f}':>9}  {diff}", file=out)
    bv = "-" if base_v is None else f"{base_v:,.1f}"
    print(f"{'b':>2}  {bv:>16}  {'':>7}  {base.get('measurements') or 1:>2}  {'1.00x':>7}  {'':>9}  "
          f"baseline ({baseline_label(base.get('config'))})"
          + (f" {base['status']}: {base['reason']}" if base.get("status") != "ok" else ""), file=out)
    for what, rs in (("infeasible", summary["infeasible"]), ("not run", summary.get("held") or [])):
        for r in rs[:10]:
            shown = ", ".join(f"{k}={v}" for k, v in r["config"].items()
                              if k in ("precision", "micro_batch_size", "num_workers", "compile"))
            print(f"{what}: {r['reason']}  ({shown})", file=out)
    drift = drift_line(summary.get("baseline_drift"), metric)
    if drift:
        print(drift, file=out)
    if summary.get("disturbed_measurements"):
        print(f"disturbed: {summary['disturbed_measurements']} measurement(s) stayed disturbed by other load "
              f"on the machine; they are marked (show) and never pick the winner", file=out)
    if summary.get("verdict"):
        print(f"NOTE: {summary['verdict']}", file=out)
    best = summary.get("best")
    # what its trial found about the workload or the run, and what its figures say (memory
    # that grew, windows that disagree)
    for n in [*((best or {}).get("notes") or []), *(diagnose(best).flags if best else [])]:
        print(f"note on the pick: {n}", file=out)
    for line in search_hot_path_lines(summary.get("hot_path")):
        print(line, file=out)
    if summary.get("overhead_ratio"):
        print(f"search overhead: wall {summary['search_wall_s']:.0f} s / in-trial {summary['in_trial_s']:.0f} s"
              f" = {summary['overhead_ratio']:.2f}", file=out)


def drift_line(drift: dict | None, metric: str, floor: float = 0.10) -> str | None:
    """A line where the baseline's figure moved between the search and the confirm rounds
    (``records.baseline_drift``): beyond every figure of the rounds, and by more than
    ``floor`` from their median. Within their range it is the rounds' own noise, not a
    drift. The line says against which of its figures each row is compared."""
    if not drift or not drift.get("before") or not drift.get("rounds"):
        return None
    before, rounds = drift["before"], statistics.median(drift["rounds"])
    change = rounds / before - 1
    if abs(change) < floor or min(drift["rounds"]) <= before <= max(drift["rounds"]):
        return None
    return (f"note: the baseline read {before:,.1f} {metric} before the confirm rounds and {rounds:,.1f} in them "
            f"({change:+.0%}): the machine's speed drifted; a row's speed-up is against the baseline measured "
            f"beside it (in the confirm rounds), or at its time in the search")


def _share(x: float) -> str:
    """A share of a step, to the digits that tell a large one from a negligible one."""
    return f"{x:.0%}" if x >= 0.1 else f"{x:.1%}" if x >= 0.001 else "under 0.1%"


def hot_path_lines(result: dict | None) -> list[str]:
    """The hot-path check's findings (``tuner.hotpath.check``), one line and its fix each."""
    if not result:
        return []
    if result.get("error"):
        return [f"hot path: not checked ({result['error']})"]
    lines = [f"hot path ({result.get('steps')} steps of the workload's own code on {result.get('device')}, "
             f"compile {result.get('compile')}):"]
    found = result.get("findings") or []
    if not found:
        lines.append("  no hot-path defects found")
    step_ms = result.get("step_ms")
    for f in found:
        often = "once, when compiling" if f.get("per_step") is None else f"{f['per_step']:g} per step"
        share = ""
        if f.get("cost_ms_per_step") is not None and step_ms:  # what fixing it can buy, at most
            share = f": {_share(f['cost_ms_per_step'] / step_ms)} of an eager step ({step_ms:,.1f} ms)"
        lines.append(f"  {f['where']} in {f['function']}: {f['what']} ({often}; {f['cost']}{share})")
        lines.append(f"      fix: {f['fix']}")
    lib = result.get("library") or []
    if lib:
        lines.append("  in other libraries (not your lines): " + ", ".join(
            f"{x['package']}: {x['what']} {x['per_step']:g}/step" for x in lib[:6]))
    return lines + [f"  ({n})" for n in result.get("notes") or []]


def search_hot_path_lines(checked: dict | None) -> list[str]:
    """A search's check: the pick's findings, then those only the baseline has."""
    if not checked:
        return []
    if "error" in checked:
        return hot_path_lines(checked)
    pick, base = checked.get("pick"), checked.get("baseline")
    lines = hot_path_lines({**(pick or base), "notes": []})  # what it cannot check: docs/hot-path.md
    if pick and base and not base.get("error"):
        seen = {(f["where"], f["kind"]) for f in pick.get("findings") or []}
        extra = [f for f in base.get("findings") or [] if (f["where"], f["kind"]) not in seen]
        if extra:
            lines.append("the baseline (compile off) also has:")
            lines += hot_path_lines({**base, "findings": extra, "library": [], "notes": []})[1:]
    return lines
