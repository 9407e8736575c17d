"""Render ``docs/benchmarks.md`` from ``benchmarks/out/*.json``: one current JSON per
benchmark, one section each, with when, on what and by which command it was measured.
History lives in git, not on the page.

    python benchmarks/render.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
OUT = HERE / "out"
PAGE = HERE.parent / "docs" / "benchmarks.md"

WHAT = {  # what each benchmark answers, in one line
    "gpu": "On a GPU: the GPU tests, bench against a plain loop, and a search on GPT-2 124M and ResNet-50",
    "search_replay": "How good the search's pick is, replayed on recorded landscapes, against stock searches",
    "search_budget": "The search under `--time-budget`, replayed on a landscape's recorded trial walls",
    "many_cores": "The search on 8 to 64 cores: synthetic input pipelines (no machine measured), the same judge",
    "search_cost": "The tuner against stock Ray Tune + OptunaSearch, live",
    "trial_overhead": "What a trial costs beyond its windows: its process's start and its end",
    "loop_vs_naive": "The pick against the plain PyTorch loop and the best config of the grid",
    "truth_default": "bench against a user's own loop and a real Trainer, at default settings",
    "framework_speed": "The exports in the frameworks users paste them into: rates and speed-ups",
    "framework_overhead": "What each way of running a step adds to it: the frameworks' own per-step work",
    "anatomy": "Where a step's time goes: the user's loop against the frameworks, on real models",
    "truth": "bench and trials against a user's plain loop on the same config",
    "truth_epochs": "bench's figure against a user's plain loop over whole epochs (epoch boundaries in on both "
                    "sides), on the same config",
    "truth_heldout": "The same, on the workloads of the held-out landscapes recorded after the measurement's "
                     "rules (ocr, csvrows, mae): none of them was in view when a rule of the measurement was set",
    "tuner_cpu": "The CPU the tuner's own processes use beside a trial",
    "ray_cost": "What Ray's processes cost a trial beside them",
    "hog": "A CPU hog during a measurement: the figure with disturbance detection on and off",
    "knob_ab_malloc_retain": "malloc_retain on and off, side by side: bench and the user's plain loop",
    "knob_ab_fused_optimizer": "fused_optimizer on and off on a CPU, side by side: bench and the user's plain "
                               "loop (PyTorch's default CPU step updates each parameter in turn)",
    "knob_ab_gc_freeze": "gc_freeze on and off, side by side: bench and the user's plain loop (`rows`: a table "
                         "in a TensorDataset at large batches)",
    "knob_ab_gc_freeze_gpu": "gc_freeze on and off on a GPU, side by side: bench and the user's plain loop (`rows`: "
                             "the host's collate is the step)",
    "restart_trace": "What a DataLoader worker started anew each epoch does to the training process",
    "export_speed": "The exported script against the tuner's own figure",
    "hotpath_pairs": "The defects the hot-path check names, against the same workload with them fixed",
    "cache_pairs": "dataset_cache on and off on an input-bound workload (JPEG decode per item)",
    "cache_pairs_tokenized": "dataset_cache on and off on texts tokenized per read into Python lists of ids",
    "augment_pairs": "The per-batch augmentation in the DataLoader's workers against on the device",
    "cache_read": "What a batch read from dataset_cache costs the DataLoader per item: one item at a time against "
                  "a batch at once (`__getitems__`), beside the same items held in a list",
    "length_grouping": "group_by_length on and off, side by side: bench and a user's plain loop over whole epochs, "
                       "on token lists padded per batch (reviews: 16-256 tokens; utterances: long-tailed turns "
                       "whose epoch outlasts a trial, so bench's figure is fitted on the batches its windows ran, "
                       "with the knob on and off)",
}


def _when(path: Path, data: dict) -> str:
    if data.get("date"):
        return str(data["date"])
    try:
        return subprocess.run(["git", "log", "-1", "--format=%cs", "--", str(path)], capture_output=True,
                              text=True, cwd=HERE).stdout.strip() or "?"
    except OSError:
        return "?"


def _machine(data: dict) -> str:
    hw = data.get("hardware") or data.get("machine") or {}
    if isinstance(hw, dict):
        parts = [str(hw[k]) for k in ("cpu", "gpu") if hw.get(k)]
        cores = [f"{hw['cpu_count']} cores"] if hw.get("cpu_count") else []
        # which bf16 the CPU has decides what a CPU landscape looks like
        bf16 = {"amx": ["bf16 by AMX"], "avx512_bf16": ["bf16 by AVX512-BF16, no AMX"]}.get(hw.get("cpu_bf16"), [])
        return ", ".join(parts + cores + bf16) or "?"
    return str(hw)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _table(rows: list[dict], most: int = 11) -> list[str]:
    """A list of flat records as a table: the first ``most`` columns that hold numbers or
    short strings."""
    cols = [k for k in dict.fromkeys(k for r in rows for k in r)
            if all(isinstance(r.get(k), (int, float, str, bool, type(None))) and len(str(r.get(k))) < 40
                   for r in rows)][:most]
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
            *("| " + " | ".join(_fmt(r.get(k, "")) for k in cols) + " |" for r in rows[:20]), ""]


def _generic(data: Any, prefix: str = "", depth: int = 0, lines: list | None = None) -> list[str]:
    """Numbers and short strings, flattened two levels deep; lists of records as tables."""
    lines = [] if lines is None else lines
    if isinstance(data, dict):
        for k, v in data.items():
            if k in ("hardware", "command", "date", "machine") or len(lines) >= 40:
                continue
            if isinstance(v, (int, float, str, bool)) and len(str(v)) < 100:
                lines.append(f"- `{prefix}{k}`: {_fmt(v)}")
            elif isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
                lines += [f"`{prefix}{k}`:", "", *_table(v)]
            elif depth < 2 and isinstance(v, (dict, list)):
                _generic(v, f"{prefix}{k}.", depth + 1, lines)
    elif isinstance(data, list) and depth < 2:
        for i, v in enumerate(data[:6]):
            _generic(v, f"{prefix}{i}.", depth + 1, lines)
    return lines


def _trial_overhead(data: dict) -> list[str]:
    t = data["teardown"]
    out = [f"Trials of the built-in conv workload with a short measure ({data['measure']['min_windows']}-"
           f"{data['measure']['max_windows']} windows of {data['measure']['window_s']} s), one after another as a "
           "search runs them; medians. `start`: the spawn to the process's first message (interpreter, imports, "
           "request); `measure`: to its last window (model and DataLoader built, warm-up, windows); `end`: to "
           "the driver holding an ended process; `fixed`: start and end over the wall.", "",
           "| config | trials | start s | measure s | end s | wall s | fixed |", "|---|---|---|---|---|---|---|"]
    out += [f"| {r['config']} | {r['trials']} | {r['start_s']:.2f} | {r['measure_s']:.2f} | {r['end_s']:.2f} | "
            f"{r['wall_s']:.2f} | {r['fixed_share']:.0%} |" for r in data["rows"]]
    return out + ["", f"The interpreter's teardown with torch imported, which a trial's process skips "
                      f"(`tuner.trial._exit_now`): {t['teardown_s']:.2f} s ({t['with_teardown_s']:.2f} s "
                      f"against {t['with_os_exit_s']:.2f} s ending in `os._exit`, medians of {t['rounds']} "
                      "rounds, interleaved)."]


def _search_replay(data: dict) -> list[str]:
    budgets = data["budgets"]
    out = [f"The replay drives the search policy itself (`tuner.policy.SearchPolicy`), one search per count of "
           f"configs, under the live search's window caps and retry room. A replayed measurement draws the "
           f"config's recorded windows (the first two in order, the rest at random), scaled to its rate and times "
           f"a drift drawn from the landscape's repeats, and reads them as a trial does: all samples over all "
           f"time. A config measured as three whole trials, and one whose recorded figure was fitted on its "
           f"batches' lengths (windows many-fold apart by design), reads its rate times the drift, as its trials "
           f"spread; its windows decide only the screen and the trial's length. {data['seeds']} seeds per landscape "
           f"({data['gp_seeds']} for the GP sampler); each cell is the pick's rate over the landscape's best: "
           f"median / 10th percentile. A config's rate is the mean of its three figures where every config "
           f"within 10% of the landscape's best was measured three times on one host (\"means\"), and its first "
           f"figure otherwise (\"first figures\"): the best config's first figure is the luckiest draw of many. "
           f"Stock TPE tries N configs and reports its best single figure. `oracle` is the same policy with a "
           f"sampler that knows the judge's rates and proposes the best configs first: what it loses is the "
           f"pick's noise alone, where the best configs are all measured (a sampler that measures fewer of "
           f"them can read a higher 10th percentile: fewer near-equal contenders to confuse). "
           f"`tuner: best measured` is the best config the tuner measured in full: below it, the pick lost to "
           f"noise; below 1, the search never measured the best configs in full. A landscape marked \"cores used not "
           f"recorded\" was recorded before trials reported the cores they and their DataLoader workers used: "
           f"replayed, the starts that split the cores keep the threads their worker counts leave, where a "
           f"live search gives them the threads its workers' measured cores leave. A landscape's `runner-up` is "
           f"its second-best repeated config's mean over the best's, with Welch's t-test of their figures: the "
           f"replay takes each mean as the config's exact rate, and where p is large the landscape's own "
           f"figures do not show that its best is the faster of the two.", ""]
    held = {n for n, info in data["landscapes"].items() if info.get("held_out")}
    for title, names in (("Landscapes the search's rules were chosen on", [n for n in data["results"] if n not in held]),
                         ("Held out: recorded after the rules of their commit were frozen, no constant or rule "
                          "chosen from them", [n for n in data["results"] if n in held])):
        if names:
            out += [f"**{title}**, at 12 configs:", "", *_at(data, names, 12), *_against_the_bar(data, names)]
    out += _held_out_provenance(data, [n for n in data["results"] if n in held])
    for added in data.get("added") or []:
        only = f" ({', '.join(added['strategies'])}; the other strategies' rows stand)" if added.get("strategies") else ""
        every = set(added["landscapes"]) >= set(data["landscapes"])
        which = f"Every landscape ({len(added['landscapes'])})" if every else ", ".join(added["landscapes"])
        command = added["command"]
        if every:  # the names left out, the options after them kept
            head, _, tail = command.partition(" --landscapes ")
            after = tail.split(" --", 1)
            command = f"{head} --landscapes <every one>" + (f" --{after[1]}" if len(after) > 1 else "")
        out += [f"{which}: replayed {added['date']} with the rules of commit "
                f"{added.get('rules_at')}{only} (`{command}`) and added to this file.", ""]
    previous = data.get("previous") or {}
    if previous.get("results"):
        out += [f"Where the figures moved from the replay before the policy was one object "
                f"({previous.get('date')}, its own copy of the decisions): {previous.get('why', '')}", "",
                "| landscape | tuner then | tuner now | stock TPE then | stock TPE now |", "|---|---|---|---|---|"]
        for name in data["results"]:
            then = previous["results"].get(name) or {}
            now = data["results"][name]
            out.append(f"| {name} | {_cell(then, 'tuner')} | {_cell(now, 'tuner')} | {_cell(then, 'stock-tpe')} | "
                       f"{_cell(now, 'stock-tpe')} |")
        out.append("")
    for name, strategies in data["results"].items():
        info = data["landscapes"][name]
        judged = f"; judged by {info['judge']}" if info.get("judge") else ""
        tag = "; held out" if info.get("held_out") else ""
        cores = "; cores used not recorded" if info.get("cores_recorded") is False else ""
        second = info.get("runner_up")
        second = (f"; runner-up {second['ratio']:.3f} of the best, Welch p {second['p']:.2f} over their "
                  f"{' and '.join(map(str, second['figures']))} figures") if second else ""
        out += [f"**{name}** ({info['configs']} configs, repeat CV {info['repeat_cv']:.3f}; "
                f"{_machine(info)}, measured {info.get('measured')}{judged}{tag}{cores}{second})", "",
                "| strategy | " + " | ".join(f"{b} configs" for b in budgets) + " |",
                "|---|" + "---|" * len(budgets)]
        for strategy, row in strategies.items():
            out.append(f"| {strategy} | " + " | ".join(
                f"{row[str(b)]['median']:.3f} / {row[str(b)]['p10']:.3f}" for b in budgets) + " |")
        fn = strategies.get("tuner", {}).get("12", {})
        if fn.get("false_negative_rate") is not None:
            out.append(f"\nScreening at 12 configs: {fn['screened']} configs screened over the seeds, "
                       f"{fn['false_negative_rate']:.1%} of them within 3% of the final pick.")
        out.append("")
    if data.get("real_run"):
        r = data["real_run"]
        out.append(f"The real quickstart search: {r['command_wall_s']:.0f} s to its recommendation "
                   f"({r['trials']} configs, {r['measurements']} measurements).")
    return out


def _held_out_provenance(data: dict, names: list[str]) -> list[str]:
    """Under which rules each held-out landscape was recorded, and each rule chosen later with
    held-out figures in view (``held_out_seen``): the landscapes it saw count with the ones
    the rules were chosen on from then on."""
    out = []
    if names:
        by_rules: dict[str, list[str]] = {}
        for n in names:
            by_rules.setdefault(data["landscapes"][n].get("rules_at") or "not recorded", []).append(n)
        out.append("Held out: recorded under the rules of commit "
                   + "; ".join(f"{c} ({', '.join(ns)})" for c, ns in by_rules.items()) + ".")
    for seen in data.get("held_out_seen") or []:
        out.append(f"Commit {seen['commit']} chose a rule with the figures of {', '.join(seen['seen'])} in view, "
                   f"held out until then: {seen['why']} They are counted with the landscapes the rules were "
                   f"chosen on since.")
    return [" ".join(out), ""] if out else []


def _against_the_bar(data: dict, names: list[str], budget: int = 12) -> list[str]:
    """Where the tuner's pick reads below 0.97 of the best (median) or 0.93 (10th
    percentile), and where the oracle does: it measures the best configs by construction,
    so where it reads below, the noise of the pick among the top configs sets the figure,
    not which configs a sampler tries."""
    rows = {n: (data["results"][n].get("tuner", {}).get(str(budget)), data["results"][n].get("oracle", {}).get(str(budget)))
            for n in names}
    rows = {n: (t, o) for n, (t, o) in rows.items() if t and o}
    if not rows:
        return []

    def below(who: int, key: str, bar: float) -> str:
        hits = [n for n, pair in rows.items() if pair[who][key] < bar]
        return f"{len(hits)} of {len(rows)}" + (f" ({', '.join(hits)})" if hits else "")

    # a median pick that is the landscape's runner-up, which the landscape's own repeats do
    # not tell from its best: the replay takes the means as exact, the figures do not
    unsettled = [f"{n} (p {second['p']:.2f})" for n, (t, _) in rows.items()
                 if t["median"] < 0.97 and (second := data["landscapes"].get(n, {}).get("runner_up"))
                 and abs(t["median"] - second["ratio"]) < 1e-9 and second["p"] >= 0.05]
    return [f"At {budget} configs the tuner's median pick reads below 0.97 of the best on {below(0, 'median', 0.97)}, "
            f"its 10th percentile below 0.93 on {below(0, 'p10', 0.93)}. The oracle's median reads below 0.97 on "
            f"{below(1, 'median', 0.97)}, its 10th percentile below 0.93 on {below(1, 'p10', 0.93)}: there the "
            f"noise of the pick among the best configs, which the oracle measures by construction, sets the "
            f"figure." + (" The tuner's medians below 0.97 that are the landscape's runner-up, which the landscape's "
                          "own repeated figures do not tell from its best (Welch's t-test, p 0.05 or more): "
                          f"{', '.join(unsettled)}." if unsettled else ""), ""]


def _cell(results: dict, strategy: str, budget: int = 12) -> str:
    row = results.get(strategy, {}).get(str(budget))
    return f"{row['median']:.3f} / {row['p10']:.3f}" if row else "-"


def _at(data: dict, names: list[str], budget: int) -> list[str]:
    """One row per landscape at ``budget`` configs: each strategy's median / 10th percentile,
    and beside the tuner's, the best config it measured in full (where it was recorded)."""
    strategies = list(dict.fromkeys(s for n in names for s in data["results"][n]))
    explored = any("explored_median" in data["results"][n].get("tuner", {}).get(str(budget), {}) for n in names)
    heads = [h for s in strategies for h in ([s, "tuner: best measured"] if s == "tuner" and explored else [s])]
    # the host beside each: a landscape is one machine's, and the rules were chosen on few
    rows = ["| landscape | host | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    for name in names:
        r, cells = data["results"][name], []
        for s in strategies:
            row = r.get(s, {}).get(str(budget))
            cells.append(f"{row['median']:.3f} / {row['p10']:.3f}" if row else "-")
            if s == "tuner" and explored:
                cells.append(f"{row['explored_median']:.3f} / {row['explored_p10']:.3f}"
                             if row and "explored_median" in row else "-")
        rows.append(f"| {name} | {_machine(data['landscapes'][name])} | " + " | ".join(cells) + " |")
    return rows + [""]


def _search_cost(data: dict) -> list[str]:
    cols = ["workload", "trials", "tuner_configs", "tuner_wall_s", "stock_wall_s", "wall_ratio",
            "tuner_screened", "screened_checked", "screening_false_negatives", "tuner_pick_samples_per_sec",
            "stock_pick_samples_per_sec", "pick_ratio"]
    rows = [{**{k: r.get(k) for k in cols}, "screened_checked": len(r.get("screened_full") or [])}
            for r in data["rows"]]
    return ["Stock: N plain trials, W seconds; the tuner: `--time-budget W`. Both picks re-measured side "
            "by side, interleaved, 3 rounds, medians. `screened_checked`: the configs the tuner screened "
            "out and never measured in full (of `tuner_screened`, which also counts configs measured in "
            "full later), each measured in full beside the pick, paired and in turns, twice (medians); "
            "`screening_false_negatives`: those that came within 3% of the pick.", "",
            *_table(rows, most=len(cols)),
            # each pick and its rounds: a ratio of medians means little where the rounds overlap
            *(f"- {r['workload']}: the tuner's pick {_short(r['tuner_pick'])}, rounds "
              f"{', '.join(f'{x:.0f}' for x in r['tuner_pick_runs'])}; stock's {_short(r['stock_pick'])}, "
              f"rounds {', '.join(f'{x:.0f}' for x in r['stock_pick_runs'])}" for r in data["rows"]
              if r.get("tuner_pick_runs") and r.get("stock_pick_runs")), ""]


def _search_budget(data: dict) -> list[str]:
    out = [f"The search policy itself under `--time-budget`, {data['seeds']} seeds per row (rules of commit "
           f"{data.get('rules_at')}). Its clock is the recorded wall of each trial it measures, from the trial "
           "process's start to its result, half of it fixed and half in proportion to the windows the replayed "
           "measurement takes (a screened one's few windows cost less); Ray's start and "
           "the scheduling between trials, which a live search adds, are not in it. `trials`: the space's "
           "budget.trials (10: the shipped GPU spaces'; 100: more than the grid holds, so the time alone "
           "binds). Configs: distinct configs measured, median (least); pick / best: median (10th percentile).",
           "", "| landscape (walls measured on) | median trial wall, s | budget, s | trials | configs | "
           "measurements | wall used, s: median (most) | pick / best | why it stopped |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        ended = "; ".join(f"{why} ({n})" for why, n in r["ended"].items())
        out.append(f"| {r['landscape']} ({_machine({'hardware': r['landscape_hardware']})}) | "
                   f"{r['trial_wall_s_median']:.0f} | "
                   f"{r['time_s']:.0f} | {r['trials']} | {r['configs_median']:.0f} ({r['configs_min']}) | "
                   f"{r['measurements_median']:.0f} | {r['wall_s_median']:.0f} ({r['wall_s_max']:.0f}) | "
                   f"{r['pick_median']:.3f} ({r['pick_p10']:.3f}) | {ended} |")
    return out


def _many_cores(data: dict) -> list[str]:
    strategies = list(next(iter(data["summary"].values())))
    out = [f"Synthetic landscapes (`benchmarks/many_cores.py`: Amdahl's law for the threads, a loading cost "
           f"per sample, threads and busy workers beyond the cores slowing both stages), each config's windows "
           f"noisy by {data['window_cv']:.0%} and its trials by {data['trial_cv']:.0%}; {data['trials']} configs "
           f"a search, {data['seeds']} seeds a scenario. The pipelines have the shape the sampler's model of "
           "the stages assumes, so this checks that its reasoning holds at any core count, not that the "
           "physics are a real machine's. Pick / best, by core count and whether the space searches the "
           "threads (unset: PyTorch's, every core): the mean over the scenarios of the median and the 10th "
           "percentile over the seeds, and the worst scenario's median.", "",
           "| cores, threads | " + " | ".join(f"{st}: median, p10, worst" for st in strategies) + " |",
           "|---|" + "---|" * len(strategies)]
    for name, figures in data["summary"].items():
        out.append(f"| {name} | " + " | ".join(
            f"{v['mean_median']:.3f}, {v['mean_p10']:.3f}, {v['min_median']:.3f}" for v in figures.values()) + " |")
    weak = [r for r in data["scenarios"] if r["tuner"]["median"] < 0.97 or r["tuner"]["p10"] < 0.9]
    if weak:
        out += ["", "Scenarios where the tuner's median reads below 0.97 or its 10th percentile below 0.90 "
                "(loading: the loading's cores at the fastest step, over the machine's; p: the step's parallel "
                "share):", "", "| cores | threads | loading | p | bf16 factor | barrier | " + " | ".join(
                    f"{st} median (p10)" for st in strategies) + " |", "|---|---|---|---|---|---|" + "---|" *
                len(strategies)]
        out += [f"| {r['cores']} | {r['threads']} | {r['loading_share']} | {r['parallel']} | {r['bf16_factor']} | "
                f"{r['barrier']} | " + " | ".join(f"{r[st]['median']:.3f} ({r[st]['p10']:.3f})" for st in strategies)
                + " |" for r in weak]
    return out


def _short(config: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())


def _framework_overhead(data: dict) -> list[str]:
    out = [f"`{data['workload']}` (a linear layer: its step costs almost nothing), {_short(data['config'])}, "
           f"each way in a fresh process, interleaved, {data['rounds']} rounds, medians. Beside the user's "
           "loop: each round's time per step less the user's loop's in that round (median, and the "
           "rounds' least and most). On a real model a framework reads below the user's loop by about "
           "that time over the step's.", "",
           "| way | ms per step | beside the user's loop, ms | rounds' range, ms |", "|---|---|---|---|"]
    for r in data["rows"]:
        beside = (f"{r['over_user_ms']:+.3f} | {r['over_user_min_ms']:+.3f} to {r['over_user_max_ms']:+.3f}"
                  if r.get("over_user_ms") is not None else " | ")
        out.append(f"| {r['kind']} | {r['ms_per_step']:.3f} | {beside} |")
    return out


def _anatomy(data: dict) -> list[str]:
    out = ["Each way in a fresh process (`user`: `benchmarks/user_loop.py`; `hf`: a real "
           "`transformers.Trainer` with the exported arguments; `lightning`: a real `lightning.Trainer`), "
           f"interleaved, {data['rounds']} rounds, medians, ms per optimizer step. Timed inside each process "
           "around torch's own entry points: the model's forward (its outermost module), `Tensor.backward`, "
           "the optimizer's step, `clip_grad_norm_`, each net of the others it holds; the step from the "
           "way's own rate; `rest`: what the parts leave of it (the batch's fetch, the framework's "
           "bookkeeping). `beside user`: each round's difference from the user's loop, median over the "
           "rounds. Without `malloc_retain` each process's rate also follows its draw of glibc's heap "
           "(how many pages it returns and faults again each step): the rows with it hold the frameworks' "
           "own work.", "",
           "| workload | config | way | step | forward | backward | optimizer | clip | rest | beside user: step "
           "| beside user: rest |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        for way, s in row["ways"].items():
            ms, b = s["ms"], s.get("beside_user_ms") or {}
            beside = (f"{b['step']:+.2f} | {b['rest']:+.2f}" if b else " | ")
            out.append(f"| {row['workload']} | {_short(row['config'])} | {way} | {ms['step']:.2f} | "
                       f"{ms['forward']:.2f} | {ms['backward']:.2f} | {ms['optimizer']:.2f} | {ms['clip']:.2f} | "
                       f"{ms['rest']:.2f} | {beside} |")
    later = [r for r in data["rows"] if r.get("measured") and r["measured"]["date"] != data["date"]]
    if later:
        out += [""] + [f"{r['workload']} {_short(r['config'])}: measured {r['measured']['date']}, "
                       f"{r['measured']['rounds']} rounds (`{r['measured']['command']}`)." for r in later]
    return out


def _loop_rows(rows: list[dict]) -> list[str]:
    """bench against a loop, a row per config: the rates, the paired ratio and its verdict."""
    out = ["| workload | config | loop | bench | loop rate | bench / loop | 90% interval | rounds | verdict |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["paired_interval_90"]
        out.append(f"| {r['workload']} | {_short(r['config'])} | {r.get('loop', 'plain')} | "
                   f"{r['bench_samples_per_sec']:.1f} | {r['plain_samples_per_sec']:.1f} | "
                   f"{r['paired_geomean']:.3f} | {lo:.3f}-{hi:.3f} | {r['rounds']} | {r['verdict']} |")
    return out


def _truth_epochs(data: dict) -> list[str]:
    return ["Each row: `bench` and `plain` (`truth.py`'s own loop: one untimed epoch, then "
            f"{data.get('plain_epochs', 3)} whole epochs end to end), each in a fresh process, interleaved (the order "
            "turns every round), the config's threads set on both sides. bench's figure is its sustained "
            "rate: the steady step over an epoch of the dataset's length plus one boundary. Ratio: "
            "geometric mean of the rounds' bench / plain, with its 90% interval and the verdict against ±"
            f"{data.get('tolerance', 0.03):.0%}.", "", *_loop_rows(data["rows"]), *_pooled(data)]


def _truth_default(data: dict) -> list[str]:
    out = ["Each row: `bench` and the loop, each in a fresh process, interleaved (the order turns every "
           "round), nothing pinned, the threads PyTorch picks by default. `user`: "
           "`benchmarks/user_loop.py` (4 warm-up steps, median of 5 windows of 6 steps inside epochs), "
           "against bench's steady figure (epoch boundaries left out on both sides); `user_warm`: the "
           "same loop with a longer warm-up (its steps beside the loop's name: 128, one epoch of "
           "multisource, so that its windows come after every batch shape has been met once, where a step "
           "that meets a new one costs more the first time; 40, where a worker starts anew each epoch, so "
           "that they come after the first worker restart, as bench's steady windows do); `epochs`: the same "
           "loop over whole epochs after those windows (the command's `--epochs`, default 3), against "
           "bench's figure (boundaries in on both sides); "
           "`hf`: a real `transformers.Trainer` with the exported `TrainingArguments` over 3 epochs, "
           "against bench's figure (boundaries in on both sides); `hf_no_lookahead`: the same with the "
           "Trainer's loader iterating its DataLoader plainly, not a batch ahead (what that costs at "
           "each epoch start; the rows' `epoch_start_ms` and `mid_epoch_ms` in the JSON); `hf_no_clip`: "
           "the Trainer with `max_grad_norm=0` (what its gradient clipping costs); `hf_inputs_cl`: the "
           "Trainer with the 4-D inputs made channels_last in the data collator as well as the model "
           "(the export converts the model only). Ratio: geometric "
           "mean of the rounds' bench / loop, with its 90% interval and the verdict against ±"
           f"{data.get('tolerance', 0.03):.0%}.", "",
           *_loop_rows(data["rows"])]
    x = data.get("across_rows")
    if x:
        out += ["", f"Across the rows: {x['geomean']:.3f} (90% {x['interval_90'][0]:.3f}-{x['interval_90'][1]:.3f})."]
    out += _across_loops(data.get("across_loops"), "rows")
    return out + _pooled(data)


def _pooled(data: dict) -> list[str]:
    """The rows measured again (``truth.py --again``), each config's rounds pooled."""
    out: list[str] = []
    pooled = data.get("measured_again_pooled") or []
    if pooled:
        out += ["", "Rows measured again with more rounds (`truth.py --again`), each config's rounds pooled "
                    "over every run that measured it (the runs, with their dates, machines and commands, are "
                    "the JSON's `measured_again`):", "",
                "| workload | config | loop | bench | loop rate | bench / loop | 90% interval | rounds (runs) | verdict |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in pooled:
            lo, hi = r["paired_interval_90"]
            loop = f"{r['loop']} ({r['user_warmup']} steps)" if r.get("user_warmup") else r["loop"]
            out.append(f"| {r['workload']} | {_short(r['config'])} | {loop} | "
                       f"{r['bench_samples_per_sec']:.1f} | {r['plain_samples_per_sec']:.1f} | "
                       f"{r['paired_geomean']:.3f} | {lo:.3f}-{hi:.3f} | {r['rounds']} ({r['runs']}) | "
                       f"{r['verdict']} |")
        out += _across_loops(data.get("measured_again_across_loops"), "rows measured again",
                             data.get("tolerance", 0.03))
    return out


def _restart_trace(data: dict) -> list[str]:
    out = [f"`{data['workload']}` {_short(data['config'])}, {data['epochs']} epochs, {data['processes']} "
           "processes a side, interleaved; every step timed with its fetch. Steps 2-7: the rate of those "
           "steps of every epoch after the first. Mid-epoch: per epoch, the steps from the 9th on.", "",
           "| workers | first step of an epoch, page faults (min, median, max) | steps 2-7, samples/s | "
           "mid-epoch samples/s | mid-epoch page faults per step | later epochs / first |",
           "|---|---|---|---|---|---|"]
    for setting, x in data["settings"].items():
        mids = [e for proc in x["mid_epoch"] for e in proc]
        rates = [e["samples_per_sec"] for e in mids]
        faults = [e["faults_per_step"] for e in mids]
        out.append(f"| {setting.replace('_', ' ')} | {', '.join(f'{v:,.0f}' for v in x['first_step_faults'])} | "
                   f"{', '.join(f'{v:.0f}' for v in x['after_start_samples_per_sec'])} | "
                   f"{min(rates):.0f}-{max(rates):.0f} | {min(faults):,.0f}-{max(faults):,.0f} | "
                   f"{', '.join(f'{v:.3f}' for v in x['later_over_first'])} |")
    return out


def _across_loops(by_loop: dict | None, what: str, tolerance: float | None = None) -> list[str]:
    """One line per loop: the bias across its rows (``truth.across_loops``)."""
    out = []
    for loop, y in (by_loop or {}).items():
        if y:
            within = f"; {y['within_tolerance']} within ±{tolerance:.0%}" if tolerance else ""
            out += ["", f"Across the `{loop}` {what} ({y['rows']}): {y['geomean']:.3f} "
                        f"(90% {y['interval_90'][0]:.3f}-{y['interval_90'][1]:.3f}){within}."]
    return out


def _framework_speed(data: dict) -> list[str]:
    out = [f"Each framework in a fresh process, interleaved, {data['rounds']} rounds (unless a workload says "
           "otherwise; a framework measured in some rounds only is scored against the tuner's of the same "
           "rounds), medians (realized / "
           "promised also paired by round: each round's pick / default of the framework against the same "
           "round's of the tuner, their geometric mean and 90% interval, which cancels a drift of the "
           "machine that lasts a round); the "
           f"frameworks' rates over {data['epochs']} epochs after {data['warmup']} warm-up steps. "
           "`pick`: the tuner's search's pick; `default`: PyTorch's defaults. Promised: the tuner's "
           "pick / default; realized: the framework's. Each process starts as the export says (glibc's "
           "variables set where the config has `malloc_retain`). Where a framework reads below the "
           "tuner, its own work is the gap the export's comments name: the Trainer's gradient "
           "clipping and scheduler step, Lightning's progress bar and logger (their size per step: "
           "framework_overhead, below), and with DataLoader workers the Trainer's loader reading one "
           "batch ahead, so that each epoch's first step waits for two batches (`hf_no_lookahead`: the "
           "Trainer with its loader iterating plainly). `user` "
           "(`benchmarks/user_loop.py`) is the one rate that leaves epoch boundaries out (the median of "
           "5 windows inside epochs) where the tuner's figure counts them: where a pick starts its "
           "DataLoader workers anew each epoch (`persistent_workers` off) in short epochs, it reads "
           "above the tuner by what the boundaries cost.", ""]
    for row in data["rows"]:
        again, n = row.get("measured_again", []), len(row["runs"]["pick"]["tuner"])
        rounds = (f"; {n} rounds: {n - sum(x['rounds'] for x in again)} on the date above, "
                  + ", ".join(f"{x['rounds']} more on {x['date']} (`{x['command']}`)" for x in again)
                  if again else "")
        out += [f"**{row['workload']}**: pick {_short(row['configs']['pick'])}; promised speed-up "
                f"{row['promised_speedup']:.2f}x{rounds}", "",
                "| framework | default, rate / tuner's | pick, rate / tuner's | realized speed-up | "
                "realized / promised, medians | paired by round (90%) | rounds |", "|---|---|---|---|---|---|---|"]
        for k, f in row["frameworks"].items():
            paired = (f"{f['realized_over_promised_paired']:.3f} ({f['paired_interval_90'][0]:.3f}-"
                      f"{f['paired_interval_90'][1]:.3f})" if "paired_interval_90" in f else "-")
            out.append(f"| {k} | {f['default_over_tuner']:.3f} | {f['pick_over_tuner']:.3f} | "
                       f"{f['realized_speedup']:.2f}x | {f['realized_over_promised']:.3f} | {paired} | "
                       f"{f['rounds']} |")
        out.append("")
        out += _epoch_start_steps(row.get("step_ms") or {})
    return out


def _epoch_start_steps(step_ms: dict) -> list[str]:
    """A framework's step at an epoch start against its steps mid-epoch (medians over the
    rounds that timed them)."""
    parts = []
    for name, kinds in step_ms.items():
        for k, per_round in kinds.items():
            got = [x for x in per_round if x and x[0] is not None]
            if got:
                parts.append(f"{name} {k} {statistics.median(x[0] for x in got):.0f} / "
                             f"{statistics.median(x[1] for x in got):.0f} ({len(got)} rounds)")
    if not parts:
        return []
    return ["Each framework's step that starts an epoch against its steps mid-epoch, ms (medians; "
            "the first epoch left out): " + "; ".join(parts) + ".", ""]


def _gpu(data: dict) -> list[str]:
    hw, t = data["hardware"], data["tests"]

    def on_gpu(part: dict) -> str:  # the parts may come from different lent machines
        return f", on an {part['gpu']}" if part.get("gpu") and part["gpu"] != hw.get("gpu") else ""

    nvml = hw.get("nvml") or f"driver {hw.get('driver')}"  # nvml: "driver X, N device(s)"
    out = [f"{hw.get('gpu')}, {nvml}, torch {hw.get('torch')} (CUDA {hw.get('cuda')}, "
           f"cuDNN {hw.get('cudnn')}), 16 CPU cores; Ray 2.60, Optuna 5.0. Repeat on a lent GPU with the "
           "command above (`benchmarks/gpu_wheels.sh` fetches the wheels that machine lacks).", "",
           f"**Tests** (`tests/test_gpu.py`{on_gpu(t)}): {t['passed']} passed, {t['failed']} failed; "
           f"log in `{t['log']}`."]
    k = t.get("known_rate")
    if k:
        out.append(f"A 50 ms host sleep per step of a tiny model (known rate {k['ideal']:.0f} samples/s): the "
                   f"tuner read {k['tuner']:.2f}, a plain loop in a fresh process {k['plain_loop']:.2f} "
                   f"({k['tuner_over_plain']:.3f}): the gap to {k['ideal']:.0f} is the model's own kernel "
                   "launches and optimizer step, which the plain loop pays too; the tuner's loop adds no "
                   "per-step sync or host allocation.")
    out += ["", f"**bench against a plain loop** (`benchmarks/gpu_truth.py`, on the {hw.get('gpu')}): each side in a fresh process, "
            "interleaved, the order turned each round. `plain`: `benchmarks/user_loop.py --device cuda`; "
            "`windows`: the median of 5 windows of 6 steps inside epochs, `N epochs`: N whole epochs end "
            "to end (what a run gets where a boundary costs). Goal ±3%.", "",
            "| model | config | plain | bench | plain rate | bench / plain | rounds | 90% interval | "
            "peak MB bench / plain | MFU |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["truth"]:
        lo, hi = r["interval90"] or (float("nan"), float("nan"))
        out.append(f"| {r['model']} | {_short(r['config'])} | {r['plain']} | {r['bench']:.1f} | "
                   f"{r['plain_rate']:.1f} | {r['ratio']:.3f} | {', '.join(f'{x:.3f}' for x in r['round_ratios'])} | "
                   f"{lo:.3f}-{hi:.3f} | {r['bench_peak_device_mb']:,.0f} / {r['plain_peak_device_mb']:,.0f} | "
                   f"{r['mfu']:.1%} |")
    by_config: dict = {}
    for r in data["truth"]:
        by_config.setdefault((r["model"], json.dumps(r["config"], sort_keys=True)), []).append(r)
    for (model, _), rows in by_config.items():
        if len({r["plain"] for r in rows}) > 1:
            out.append("\n" + f"{model}, the same config against both plain figures: " + ", ".join(
                f"{r['ratio']:.3f} against {r['plain']}" for r in rows) + ". bench's figure counts the epoch "
                "boundaries a run of whole epochs pays (its DataLoader workers refilling their queues); "
                "windows inside epochs leave them out.")
    out += ["", "**Searches** (`tuner run search_spaces/gpu_<model>.yaml`, one trial at a time on the GPU). "
            "Baseline: a plain PyTorch loop at PyTorch's defaults (fp32, no workers, a `loss.item()` per "
            "step). MFU: model FLOPs (`flops_per_sample`) per second over the dense peak of the pick's "
            "precision (989 TFLOP/s bf16 on an H100 or H200; 67 fp32 without TF32, so the fp32 baseline's MFU is "
            "against that).", "",
            "| model | GPU, date | time budget s | configs | wall s | baseline | pick | speed-up | pick MFU | TFLOP/s | "
            "GPU util | power W | J/sample | peak MB | pick |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in data["searches"].items():
        joules, budget = r.get("pick_joules_per_sample"), r.get("time_budget_s")
        out.append(f"| {name} | {r.get('gpu') or hw.get('gpu')}, {r.get('date', '?')} | "
                   f"{f'{budget:.0f}' if budget else '?'} | {r['configs_measured']} | {r.get('wall_s', '?')} | "
                   f"{r['baseline_samples_per_sec']:.1f} | {r['pick_samples_per_sec']:.1f} | {r['speedup']:.2f}x | "
                   f"{r['pick_mfu']:.1%} | {r['pick_tflops']:.0f} | {r['gpu_util_pct']:.0f}% | {r['gpu_power_w']:.0f} | "
                   f"{f'{joules:.3f}' if joules else '-'} | {r['peak_device_memory_mb']:,.0f} | {_short(r['pick'])} |")
    for name, r in data["searches"].items():
        best = max((t for t in data["truth"] if t["model"] == name), key=lambda t: t["bench"], default=None)
        if best and r.get("gpu", hw.get("gpu")) == hw.get("gpu") and best["bench"] > r["pick_samples_per_sec"]:
            same = sorted(t["bench"] for t in data["truth"] if t["model"] == name and t["config"] == best["config"])
            out.append(f"\n{name}: the pick reads {r['pick_samples_per_sec'] / same[-1]:.2f}-"
                       f"{r['pick_samples_per_sec'] / same[0]:.2f} of a config bench measured in the table above "
                       f"({', '.join(f'{x:.0f}' for x in same)} in {len(same)} runs: {_short(best['config'])}): "
                       f"in {r.get('wall_s', '?')} s the search measured {r['configs_measured']} configs.")
        side = r.get("pick_vs_best")
        if side:
            pj, bj = side.get("pick_joules_per_sample"), side.get("best_joules_per_sample")
            energy = (f"; J/sample {pj:.3f} against {bj:.3f} (NVML board power {side['pick_gpu_power_w']:.0f} W "
                      f"against {side['best_gpu_power_w']:.0f} W)") if pj and bj else ""
            out.append(f"\n{name}: the pick against the best config of the `{side['landscape']}` landscape "
                       f"({_short(side['best'])}; its recorded figures "
                       f"{', '.join(f'{x:.0f}' for x in side['landscape_best_figures'])}), each by `tuner bench` in a "
                       f"fresh process, interleaved (`benchmarks/pick_vs_best.py`, {side['date']}, {side['runs']} runs "
                       f"in {side['rounds']} round{'s' if side['rounds'] > 1 else ''}): {side['pick_samples_per_sec']:.0f} "
                       f"against {side['best_samples_per_sec']:.0f} samples/s, {side['pick_over_best']:.3f} of it{energy}.")
        if r.get("published"):
            out.append(f"\n{name}: the pick's MFU {r['pick_mfu']:.1%}{on_gpu(r)} against {r['published']['mfu']:.0%} "
                       f"published: {r['published']['what']}.")
    return out + _gpu_pairs(data.get("pairs") or {})


def _gpu_pairs(pairs: dict) -> list[str]:
    """The input pipeline's and the hot path's pairs on the GPU (``gpu_check.sh pairs``)."""
    out = []
    a = pairs.get("augment")
    if a:
        lo, hi = a["interval_90"]
        out += ["", f"**The augment on the GPU** (`benchmarks/cache_pairs.py --device cuda --augment`, {a['date']}, "
                f"{a['rounds']} round{'s' if a['rounds'] > 1 else ''}; `{a['workload']}` {_short(a['args'])}, "
                f"{_short(a['config'])}, the dataset cached): the per-batch augment on the host "
                f"{a['host']:,.0f} samples/s (data wait {a['data_wait_host']:.0%}), on the GPU {a['device']:,.0f} "
                f"({a['data_wait_device']:.0%}): {a['device_over_host']:.2f}x"
                + (f" (90% {lo:.2f}-{hi:.2f})." if hi != float("inf") else "; one round gives no interval.")]
    h = pairs.get("hotpath")
    if h and not h.get("complete"):
        rows = "; ".join(f"compile {mode}: " + ", ".join(f"{side} {rate:,.0f}" for side, rate in r.items())
                         + (f" ({r['fixed'] / r['defects']:.2f}x)" if {"fixed", "defects"} <= r.keys() else "")
                         for mode, r in h["rows"].items())
        out += ["", f"**The hot-path pairs on the GPU** (`benchmarks/hotpath_pairs.py --device cuda`, one round, cut "
                f"by its time limit before the compiled pair's fixed side; `{h['log']}`): samples/s, {rows}. One "
                "round gives no interval."]
    elif h:
        out += ["", "**The hot-path pairs on the GPU**", ""] + _hotpath_table(h)
    return out


def _hotpath_pairs(data: dict) -> list[str]:
    return _hotpath_table(data) + [
        "", "On a CPU a host sync waits for nothing (there is no device queue) and the builtins cost "
        "microseconds: the eager pair is a step this small and the rounds' noise; where a ratio's "
        "interval holds 1, the fix's gain is not measured. Under compile the recompile every step "
        "(until dynamo gives up and runs the function eagerly) and the graph break are what the "
        "second row costs. The sync's stall is a GPU's (benchmarks/gpu_check.sh pairs)."]


def _hotpath_table(data: dict) -> list[str]:
    out = [f"`{data['workload']}`, micro-batch 8, {data['rounds']} interleaved rounds of `tuner bench` per side "
           f"(order alternated; windows {data['measure']}).", "",
           "| compile | with the defects, samples/s | fixed, samples/s | fixed / defects (90% interval) | "
           "found with the defects | found when fixed |", "|---|---|---|---|---|---|"]
    for p in data["pairs"]:
        kinds: dict[str, int] = {}
        for f in p["found_with_defects"]:
            kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
        lo, hi = p["interval_90"]
        out.append(f"| {p['compile']} | {statistics.median(p['defects_samples_per_sec']):,.1f} | "
                   f"{statistics.median(p['fixed_samples_per_sec']):,.1f} | {p['fixed_over_defects']:.2f}x "
                   f"({lo:.2f}-{hi:.2f}) | {', '.join(f'{k} {n}' for k, n in kinds.items())} | "
                   f"{len(p['found_when_fixed']) or 'none'} |")
    return out


def _cache_pairs(data: dict) -> list[str]:
    def med(side: str, key: str) -> float:
        vals = [x[key] for x in data[side] if x.get(key) is not None]
        return statistics.median(vals) if vals else float("nan")

    lo, hi = data["interval_90"]
    pair = data.get("pair") or {"off": {"dataset_cache": False}, "on": {"dataset_cache": True}}
    label = {side: ", ".join(f"{k}={v}" for k, v in pair[side].items()) for side in ("off", "on")}
    return [f"`{data['workload']}` {data['args']}, config {data['config']}, {data['rounds']} interleaved rounds "
            f"of `tuner bench` per side (order alternated).", "",
            "| config | samples/s | data wait | peak host MB | fill s | cache MB |", "|---|---|---|---|---|---|",
            f"| {label['off']} | {med('uncached', 'samples_per_sec'):,.1f} | {med('uncached', 'data_wait_fraction'):.0%} | "
            f"{med('uncached', 'peak_host_memory_mb'):,.0f} | - | - |",
            f"| {label['on']} | {med('cached', 'samples_per_sec'):,.1f} | {med('cached', 'data_wait_fraction'):.0%} | "
            f"{med('cached', 'peak_host_memory_mb'):,.0f} | {med('cached', 'cache_fill_s'):.1f} | "
            f"{med('cached', 'cache_mb'):,.0f} |", "",
            f"Second over first: {data['cached_over_uncached']:.2f}x (90% interval {lo:.2f}-{hi:.2f}). The fill is "
            f"paid once, up front (in startup_s and projected_run_s). The twin whose items differ between reads (a random draw in `__getitem__`): "
            f"exit {data['twin']['exit']}, `{data['twin']['stderr']}`."]


def _knob_ab(data: dict) -> list[str]:
    """One row per workload: the knob off and on by bench and by the user's plain loop, and
    the paired on/off ratio of each (geometric mean of the rounds' own ratios, 90% interval)."""
    def ratio(v: Any) -> str:
        return f"{v[0]:.3f} ({v[1]:.3f}-{v[2]:.3f})" if isinstance(v, list) and len(v) == 3 else "-"

    knob = data.get("knob", "?")
    lines = [f"{knob}: {data.get('rounds', '?')} rounds, each run in a shuffled order within its round.", "",
             "| workload | config | bench off | bench on | bench on/off | plain off | plain on | plain on/off |",
             "|---|---|---|---|---|---|---|---|"]
    for r in data.get("rows", []):
        config = " ".join(f"{k}={v}" for k, v in (r.get("config") or {}).items())
        lines.append(f"| {r['workload']} | {config} | {_fmt(r.get('bench_median_off'))} | "
                     f"{_fmt(r.get('bench_median_on'))} | {ratio(r.get('bench_on_off'))} | "
                     f"{_fmt(r.get('plain_median_off'))} | {_fmt(r.get('plain_median_on'))} | "
                     f"{ratio(r.get('plain_on_off'))} |")
    shares = [r for r in data.get("rows", []) if "bench_gc_share_off" in r]
    if shares:
        lines += ["", "bench's `gc_share` (the timed phase's share in full garbage collections), medians, off -> on: "
                  + "; ".join(f"{r['workload']} {r['bench_gc_share_off']:.1%} -> {r['bench_gc_share_on']:.1%}"
                              for r in shares) + "."]
    return lines + [""]


def _length_grouping(data: dict) -> list[str]:
    """One row per workload: the padding's share, the knob off and on by bench and by the
    plain loop over whole epochs, and the paired on/off ratio of each."""
    def ratio(v: Any) -> str:
        return f"{v[0]:.2f} ({v[1]:.2f}-{v[2]:.2f})" if isinstance(v, list) and len(v) == 3 else "-"

    config = " ".join(f"{k}={v}" for k, v in (data.get("config") or {}).items())
    lines = [f"{config}; each run in a shuffled order within its round; medians. Padding: the share of an "
             "epoch's padded batch positions that is padding.", "",
             "| workload | rounds | padding off -> on | bench off | bench on | bench on/off | plain off | plain on | "
             "plain on/off | bench's window spread off / on |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in (data.get("cases") or {}).items():
        m, spread = c.get("medians", {}), c.get("bench_spread", {})
        differs = " ".join(f"{k}={v}" for k, v in (c.get("config") or {}).items() if (data.get("config") or {}).get(k) != v)
        if m_ := c.get("measure"):
            differs += f"; bench's windows: {m_.get('min_windows')}-{m_.get('max_windows')} of {m_.get('window_s')} s"
        lines.append(f"| {name}{f' ({differs})' if differs else ''} | {c.get('rounds', '?')} ({c.get('measured', '?')}) | "
                     f"{c['padding_off']:.0%} -> {c['padding_on']:.0%} | {_fmt(m.get('bench_off'))} | "
                     f"{_fmt(m.get('bench_on'))} | {ratio(c.get('bench_ratio'))} | {_fmt(m.get('plain_off'))} | "
                     f"{_fmt(m.get('plain_on'))} | {ratio(c.get('plain_ratio'))} | "
                     f"{spread.get('off', 0):.0%} / {spread.get('on', 0):.0%} |")
    return lines + [""]


def render() -> str:
    parts = ["# Benchmarks", "", "Generated by `python benchmarks/render.py` from `benchmarks/out/` "
             "(one current JSON per benchmark; earlier runs are in git's history). Every figure says "
             "when, on what and by which command it was measured. This machine is a 2-core VM that moves "
             "between hosts: compare figures within one section, not across sections.", ""]
    for path in sorted(OUT.glob("*.json"), key=lambda p: (p.stem not in WHAT, list(WHAT).index(p.stem)
                                                            if p.stem in WHAT else 0, p.stem)):
        data = json.loads(path.read_text())
        parts += [f"## {path.stem}", "", WHAT.get(path.stem, ""), "",
                  f"Measured {_when(path, data)} on {_machine(data)}; "
                  f"`{data.get('command') or f'python benchmarks/{path.stem}.py'}`.", ""]
        special = {"search_replay": _search_replay, "search_budget": _search_budget, "search_cost": _search_cost, "truth_default": _truth_default, "truth_epochs": _truth_epochs,
                   "truth_heldout": _truth_epochs,
                   "trial_overhead": _trial_overhead,
                   "many_cores": _many_cores,
                   "framework_speed": _framework_speed, "framework_overhead": _framework_overhead,
                   "anatomy": _anatomy, "gpu": _gpu, "restart_trace": _restart_trace,
                   "hotpath_pairs": _hotpath_pairs, "cache_pairs": _cache_pairs, "cache_pairs_tokenized": _cache_pairs,
                   "augment_pairs": _cache_pairs, "length_grouping": _length_grouping}.get(path.stem, _knob_ab if path.stem.startswith("knob_ab_")
                                                      else _generic)
        parts += special(data)
        parts.append("")
    return "\n".join(parts).rstrip() + "\n"


def main() -> None:
    PAGE.parent.mkdir(exist_ok=True)
    PAGE.write_text(render())
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
