"""Trial records: reading a results folder's files defensively, the folder's one-writer
lock, and the arithmetic over records (which memory figure counts, speed-up,
constraints, aggregation per config, ranking, the winner, the Pareto front).

Pure: no Ray, no torch. Every parse or shape failure is a one-line ``UserError``
naming the file (and, for ``trials.jsonl``, the line). A torn *last* line of
``trials.jsonl`` is what a kill mid-write leaves: it is skipped with a one-line
warning, every complete record kept.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any, TypedDict

from tuner.errors import UserError


class Phase(str, Enum):
    """Why a measurement was made (a record's ``phase``); compares equal to its string,
    as old results folders hold it."""

    BASELINE = "baseline"  # the plain PyTorch loop
    SEARCH = "search"  # a config the sampler chose
    RECHECK = "recheck"  # the incumbent again, after screened trials in a row
    CONFIRM = "confirm"  # a contender again, in a confirm round
    LOST = "lost"  # Ray lost the trial with its node or worker: no result

    def __str__(self) -> str:
        return self.value


class Status(str, Enum):
    """How a measurement ended (a record's ``status``)."""

    OK = "ok"
    INFEASIBLE = "infeasible"  # out of memory, non-finite loss, hung, crashed, over a constraint
    LOST = "lost"

    def __str__(self) -> str:
        return self.value

class Figures(TypedDict, total=False):
    """What a measurement measured (``tuner.measure``), in the trial's own process."""

    samples_per_sec: float | None  # sustained: the steady rate over an epoch of the planned size, boundary included
    samples_per_sec_spread: float  # (max - min) / median of the windows' rates
    samples_per_sec_error: float  # the relative standard error of the windows' median
    samples_per_sec_windows: list[float]  # each kept window's rate, at the sustained scale
    steady_samples_per_sec: float  # the rate clear of epoch boundaries
    samples_per_sec_per_rank: float
    step_time_ms: float
    data_wait_fraction: float  # of the timed time, waiting for the next batch
    compute_samples_per_sec: float | None  # the step's rate with the data wait taken out
    load_samples_per_sec_per_process: float | None  # one loading process's rate, where it was the bottleneck
    collate_s_per_sample: float | None  # of it: the collate's seconds per item (the cache cannot save them)
    windows: int
    window_steps: int
    timed_s: float
    warmup_s: float
    startup_s: float  # building the trainer (model, optimizer, loader; the dataset cache's fill)
    cache_fill_s: float  # dataset_cache: reading every item once, up front (part of startup_s)
    cache_mb: float  # dataset_cache: what the cache holds (in peak_host_memory_mb)
    compile_s: float  # the warm-up beyond steady steps that is not worker start-up
    recompiles_in_windows: int  # frames torch.compile traced in the windows kept: recompiles every window
    recompile_windows_redone: int  # windows measured again for a recompile in them (its time is in compile_s)
    worker_start_s: float
    one_time_s: float
    epoch_overhead_s: float | None  # what one epoch boundary costs beyond an ordinary fetch
    epoch_starts_measured: int
    epoch_overhead_from: str  # "windows" or "pauses"
    # "steady windows" (those clear of epoch boundaries), "all windows", or "batch lengths"
    # (group_by_length, an epoch measured in part: the windows' time fitted on their
    # batches' longest items, over a whole epoch's batches)
    steady_from: str
    between_windows_s: float
    timed_clock_s: list[float]  # CLOCK_MONOTONIC at the first window's start and the last one's end
    epoch_size: int | None
    epoch_s: float | None
    projected_run_s: float | None  # the planned run: epochs x epoch time + one-time costs
    loss_finite: bool | None
    own_autocast: list[str] | None  # where the workload turns autocast on itself (None: not watched, compile on)
    mfu: float | None
    achieved_tflops: float | None
    peak_device_memory_mb: float | None  # the allocator's peak
    peak_device_reserved_mb: float | None
    peak_host_memory_mb: float  # peak RSS of the trial's process + its DataLoader workers' private pages
    page_faults_per_step: float | None
    # what memory grew over the timed phase's steps (measure.memory_growth), of each of
    # MEMORY_READ: the trial process's resident set, the GPU memory its tensors hold, the
    # DataLoader workers' heaps
    host_memory_growth_mb: float
    host_memory_growth_steps: int
    host_memory_grew_steadily: bool
    device_memory_growth_mb: float
    device_memory_growth_steps: int
    device_memory_grew_steadily: bool
    workers_memory_growth_mb: float
    workers_memory_growth_steps: int
    workers_memory_grew_steadily: bool
    gc_share: float  # of the timed phase's wall time: the interpreter's full garbage collections
    workers_gc_share: float | None  # the DataLoader workers' own, of their wall time (None: no workers)
    host_memory_measure: str
    interference_cores: float | None  # median over the kept windows: CPU used outside the trial
    tuner_cpu_cores: float | None  # the part of it that was the tuner's own
    steal_cores: float | None
    trial_cpu_cores: float | None  # median over the kept windows: CPU the trial's processes used
    loader_cpu_cores: float | None  # the part of it its DataLoader workers used
    interference_cores_windows: list[float | None]
    disturbed_windows_dropped: int
    disturbed_windows_left_out: int
    disturbed: bool  # more than a third of the kept windows disturbed: never picks the winner
    screened: bool  # stopped after a few windows as out of the running
    below_incumbent: bool
    screened_below: float | None
    driver_asleep: bool
    gpu_util_pct: float | None  # NVML, during the timed windows
    gpu_memory_used_mb: float | None
    gpu_power_w: float | None
    gpu_sm_clock_mhz: float | None
    joules_per_sample: float | None  # the trial's GPUs' board power over its rate (NVML; no CPU or host power)
    samples_per_joule: float | None
    nvml_note: str | None
    world_size: int
    ranks: list[dict]  # several ranks: each rank's own figures
    slowest_rank: int
    host_memory_per_node_mb: dict[str, float]


class Outcome(TypedDict, total=False):
    """How the trial's process ended and what it ran (``tuner.trial``)."""

    status: Status
    reason: str | None  # one line, for a status other than ok
    error_kind: str  # oom, invalid, workload, compile, error, timeout, died
    config: dict  # every knob, resolved on the trial's device
    notes: list[str]  # knobs held at their default, and why
    nice: int
    intra_op_threads: int  # torch.get_num_threads() in the trial: the knob's, or the user's default
    has_groups: bool
    has_augment: bool  # the workload has a per-batch augment (augment_on)
    has_lengths: bool  # the workload gives its items' lengths (group_by_length)
    map_style: bool  # the dataset reads items by index (dataset_cache can apply)
    has_conv2d: bool  # the model has Conv2d layers (channels_last can matter)
    clip_grad_norm: float | None  # the workload's gradient clipping (Workload.clip_grad_norm)
    has_after_step: bool  # the workload has the rest of an optimizer step (Workload.after_step)
    half_params: str | None  # bfloat16 or float16: the model as built holds only 16-bit parameters
    fused_step: bool | None  # the optimizer takes a fused step here (fused_optimizer can apply)
    baseline: bool  # the plain PyTorch loop
    device: str
    hardware: dict
    compile_cache: str | None  # cold or warm: the compile group's inductor cache
    trial_wall_s: float  # the whole trial: process start to result
    attempts: int
    traceback: str
    hung_phase: str  # a hung trial: the last phase it reached (``settings.PHASES``)
    hung_wait_s: float  # and how long it waited there
    refused: dict  # a knob value refused whatever the other knobs: {"knob", "values" or "at_least"}
    skipped: bool  # not run: a config like one that hung, one with a refused value, or held back


class Where(TypedDict, total=False):
    """Where Ray ran the trial (``tuner.remote.measure_config``)."""

    started_at: float
    ended_at: float
    node: str | None
    node_ip: str
    gpu_ids: list[str]
    gpu_model: str | None
    cpus_reserved: float
    compile_group: str | None
    workload: dict
    trial_id: str


class Decided(TypedDict, total=False):
    """Why the search made the measurement (``tuner.policy.SearchPolicy.on_result``)."""

    phase: Phase
    key: str  # what the config really runs (inactive knobs at their default)
    task: int  # the order in which the policy decided it
    decided_at: float  # the policy's clock: seconds since the search started
    screen: dict  # the threshold it was held to: {"below": samples/sec, "margin": fraction}
    trial_number: int  # the search's configs, in order
    confirm_round: int
    compile_s_cold: float | None  # the compile its group's first (cold) trial paid
    time: float  # when it was written to trials.jsonl


class Record(Figures, Outcome, Where, Decided, total=False):
    """One line of ``trials.jsonl``: a measurement, whole. Each part is written by the
    room its docstring names, in that order; ``SearchPolicy.on_result`` completes it.
    Old folders hold the same keys (``phase`` and ``status`` as plain strings, which the
    enums compare equal to)."""


# Data wait below this share of the timed time: the loader kept up, and its own rate is not
# seen.
LOADER_BOUND = 0.05


def stage_rates(rate: float, wait: float, workers: int, cores: int | None = None) -> tuple[float | None, float | None]:
    """The input pipeline's two stages apart, from a rate and its data wait (the share of
    the time spent waiting for the next batch): the step's rate with the wait taken out
    (what the training process consumes), and one loading process's rate where the loading
    showed (None where the loader kept up: a wait under ``LOADER_BOUND``). Without workers
    the training process loads between its steps: the rate over the wait's share. With
    workers, a worker's share of the rate (at most ``cores`` of them loading at once). The
    trial's record and the search's model of the pipeline read a trial alike."""
    wait = min(1.0, max(0.0, wait))
    step = rate / (1 - wait) if wait < 1 else None
    if wait < LOADER_BOUND:
        return step, None
    return step, rate / wait if workers == 0 else rate / min(workers, cores or workers)


OBJECTIVE_METRICS = {"samples_per_sec": "max", "projected_run_s": "min", "samples_per_sec_per_rank": "max",
                     "samples_per_joule": "max"}
PENALTY = {"max": 0.0, "min": 1e18}  # what Optuna is told for an infeasible trial
LOCK = ".lock"
LOCK_INFO = ".lock.json"


def read_trials(path: Path, warn: Any = sys.stderr) -> list[Record]:
    """Every record of ``trials.jsonl``; a torn last line is skipped with a warning."""
    try:
        lines = path.read_text().split("\n")
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file") from None
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == last and not path.read_text().endswith("\n"):
                print(f"warning: {path}:{i + 1}: skipped a torn last line (a search killed mid-write)",
                      file=warn)
                continue
            raise UserError(f"{path}:{i + 1}: not a JSON record ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("config"), dict) \
                or not isinstance(record.get("phase", "search"), str):
            raise UserError(f"{path}:{i + 1}: not a trial record (expected an object with a 'config' mapping)")
        records.append(record)
    return records


def read_json(path: Path) -> dict:
    """A JSON object file (summary.json, meta.json)."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f":{exc.lineno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise UserError(f"{path}{where}: not valid JSON (a torn or hand-edited file?)") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


@contextmanager
def writer_lock(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s one-writer lock (an OS-level lock: it dies with its process,
    so a kill -9 leaves nothing to clean up). A second writer gets a one-line
    UserError naming the holder (pid, host, start time)."""
    from filelock import FileLock, Timeout

    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder / LOCK), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise UserError(f"{folder}: another search is writing here ({holder(folder)}); "
                        f"wait for it, or use another --name") from None
    try:
        (folder / LOCK_INFO).write_text(json.dumps(
            {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}))
        yield
    finally:
        lock.release()


def holder(folder: Path) -> str:
    """Who holds the lock, in words (from the info its holder wrote)."""
    try:
        info = json.loads((folder / LOCK_INFO).read_text())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
        return f"pid {info['pid']} on {info['host']}, started {started}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


# ---- the arithmetic over records ---------------------------------------------------------


def speedup(value: float | None, base: float | None, metric: str) -> float | None:
    """How many times better ``value`` is than the baseline's ``base`` (the one place)."""
    if value is None or not base:
        return None
    return value / base if OBJECTIVE_METRICS[metric] == "max" else base / value


def memory_mb(record: dict) -> float | None:
    """The memory a constraint or objective speaks of: device peak on a GPU, else host peak."""
    dev = record.get("peak_device_memory_mb")
    return dev if dev is not None else record.get("peak_host_memory_mb")


def apply_constraints(record: dict, constraints: Any) -> dict:
    """Mark a measured record infeasible when it breaks a constraint."""
    cap = constraints.max_memory_mb
    mem = memory_mb(record)
    if record.get("status") == "ok" and cap is not None and mem is not None and mem > cap:
        record["status"] = "infeasible"
        record["reason"] = f"peak memory {mem:.0f} MB exceeds max_memory_mb {cap:.0f}"
    return record


def objective_values(record: dict, objective: Any) -> dict[str, float]:
    """What Optuna is told: the metric, or a penalty for an infeasible trial."""
    metric = objective.metric
    mode = OBJECTIVE_METRICS[metric]
    ok = record.get("status") == "ok" and record.get(metric) is not None
    out = {"objective": float(record[metric]) if ok else PENALTY[mode]}
    if objective.memory:
        mem = memory_mb(record)
        out["memory"] = float(mem) if ok and mem is not None else 1e18
    return out


LOGGED_METRICS = ("samples_per_sec", "steady_samples_per_sec", "samples_per_sec_spread", "step_time_ms",
                  "data_wait_fraction", "peak_host_memory_mb", "peak_device_memory_mb", "compile_s",
                  "epoch_overhead_s", "projected_run_s", "mfu", "gpu_util_pct", "gpu_power_w", "joules_per_sample",
                  "trial_cpu_cores", "loader_cpu_cores", "intra_op_threads")


def logged_metrics(record: dict) -> dict[str, float]:
    """The figures a trial reports to Ray Tune (and so to TensorBoard, MLflow, Optuna's
    user attributes): the numeric ones it has."""
    return {k: float(record[k]) for k in LOGGED_METRICS
            if isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool)}


def sampler_attrs(record: dict) -> dict:
    """What Optuna's trial keeps of a search record as user attributes: its figures
    (``logged_metrics``), whether it was screened (the guided sampler weighs a screening
    figure less) and the device memory it had (the guided sampler sizes the micro-batch
    from the peak it measured against it)."""
    total = (record.get("hardware") or {}).get("gpu_memory_mb")
    return {**logged_metrics(record), **({"screened": True} if record.get("screened") else {}),
            **({"gpu_memory_mb": float(total)} if isinstance(total, (int, float)) else {})}


def device_model(record: dict) -> str:
    """The GPU model a record was measured on, or "cpu"."""
    return (record.get("hardware") or {}).get("gpu") or record.get("gpu_model") or "cpu"


def aggregate(records: list[Record], metric: str) -> list[dict]:
    """One row per distinct config: the median of its measurements (of its confirm
    rounds' alone where it has them: ``_pooled_median``), their spread (and, for several
    ranks, the scaling efficiency)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        if r.get("phase") in ("baseline", "lost"):  # a lost trial ran again: it is no result
            continue
        # the same config on two GPU models is two results (mixed clusters)
        groups.setdefault((r["key"], device_model(r)), []).append(r)
    rows = []
    for (key, model), rs in groups.items():
        if any(not r.get("skipped") for r in rs):  # not run once, measured later: the measurements
            rs = [r for r in rs if not r.get("skipped")]
        measured = [r for r in rs if r.get("status") == "ok" and r.get(metric) is not None]
        # A screening figure (a few windows, stopped as out of the running) and a
        # measurement that stayed disturbed (other load on the machine) count only when
        # nothing better exists, and then the row is marked: it never wins.
        full = [r for r in measured if not r.get("screened")]
        quiet = [r for r in full if not r.get("disturbed")]
        ok = quiet or full or measured
        values = [r[metric] for r in ok]
        row = {
            "key": key, "device_model": model, "config": rs[0]["config"],
            "measurements": sum(not r.get("skipped") for r in rs),  # a config not run measured nothing
            "feasible": bool(measured) and len(measured) == len(rs),
            "disturbed": bool(full) and not quiet,
            "screened": bool(measured) and not full,
            "error": _row_error(ok, values),
            "confirm_measurements": sum(1 for r in ok if r.get("confirm_round")),  # the figure is their median if any
            "reason": next((r.get("reason") for r in rs if r.get("status") != "ok"), None),
            # held back unrun (a compiled config under a GPU time budget): not known infeasible
            "held": all(r.get("error_kind") == "held" for r in rs),
            metric: _pooled_median(ok, metric) if values else None,
            "values": values,
            "spread": (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else None,
            "trial_numbers": [r.get("trial_number") for r in rs],
            "measured_at": _measured_at(ok),
        }
        for m in ("samples_per_sec", "projected_run_s", "peak_host_memory_mb", "peak_device_memory_mb",
                  "compile_s", "data_wait_fraction", "samples_per_sec_spread", "step_time_ms",
                  "gpu_util_pct", "samples_per_sec_per_rank", "joules_per_sample", "samples_per_joule",
                  "load_samples_per_sec_per_process", "collate_s_per_sample", "cache_fill_s", "cache_mb", "trial_cpu_cores",
                  "loader_cpu_cores", "interference_cores", "recompiles_in_windows", "gc_share",
                  "workers_gc_share"):
            # the row's other figures from the same measurements as its objective's: a
            # samples/s shown beside a samples/J pick is not the lucky search figure that
            # made the config a contender
            having = [r for r in ok if r.get(m) is not None]
            if m != metric:
                row[m] = _pooled_median(having, m) if having else None
        row["memory_mb"] = memory_mb(row) if ok else None
        row.update(_memory_growth(ok))
        row["hardware"] = rs[0].get("hardware")
        row["notes"] = rs[0].get("notes") or []
        for fact in ("has_groups", "has_augment", "has_lengths", "map_style", "has_conv2d", "clip_grad_norm",
                     "has_after_step", "half_params"):
            row[fact] = rs[0].get(fact)
        row["own_autocast"] = next((r["own_autocast"] for r in ok if r.get("own_autocast")), None)
        rows.append(row)
    scaling_efficiency(rows)
    return rows


# The memories a trial reads at each window's edge, in the order of ``Timed.memory``'s
# columns after the step count; the record's ``<name>_memory_*`` figures.
MEMORY_READ = ("host", "device", "workers")


def _memory_growth(records: list[dict]) -> dict:
    """A config's memory growth (``measure.memory_growth``) for each memory read: a
    measurement's where it grew steadily in one (a leak is the loop's, and a measurement
    that missed it held fewer or noisier windows), else the first measurement's."""
    out: dict = {}
    for name in MEMORY_READ:
        keys = [f"{name}_memory_{k}" for k in ("growth_mb", "growth_steps", "grew_steadily")]
        having = [r for r in records if r.get(keys[0]) is not None]
        seen = next((r for r in having if r.get(keys[2])), having[0] if having else None)
        if seen is not None:
            out.update({k: seen.get(k) for k in keys})
    return out


def _row_error(records: list[dict], values: list[float]) -> float | None:
    """A row's relative error: its measurements' window error (median), or, once it was
    measured more than once, half the spread of its figures if that is larger: repeats
    far apart in time (the machine drifted between them) are noise too, and a leader
    whose figures disagree has not beaten the rows behind it."""
    windows = [r.get("samples_per_sec_error") for r in records]
    error = statistics.median(windows) if windows and None not in windows else None
    if len(values) > 1 and statistics.median(values) > 0:
        repeats = (max(values) - min(values)) / (2 * statistics.median(values))
        error = max(error or 0.0, repeats)
    return error


def _pooled_median(records: list[dict], metric: str) -> float:
    """A config's figure over several measurements: the median of the measurements'
    figures (each is all its samples over all its time), of its confirm rounds' alone
    where it has them. A config enters the confirm rounds because its search figure led,
    so that figure is the likeliest to be a lucky draw or a fast moment of a drifting
    machine, and more so the more configs were measured (the winner's curse). The confirm
    rounds measure the contenders and the baseline interleaved: figures taken under the
    same conditions, and none of them used to choose who is measured."""
    confirmed = [r for r in records if r.get("confirm_round")]
    return statistics.median(r[metric] for r in confirmed or records)


def rank(rows: list[dict], metric: str) -> list[dict]:
    """Feasible rows best first; rows only screened or measured only on a disturbed
    machine last."""
    sign = -1.0 if OBJECTIVE_METRICS[metric] == "max" else 1.0
    return sorted((r for r in rows if r["feasible"]), key=lambda r: (not contender(r), sign * r[metric]))


def contender(row: dict) -> bool:
    """Whether a row may win: fully measured, on a quiet machine."""
    return not row.get("disturbed") and not row.get("screened")


def configs_tried(records: list[Record]) -> set[str]:
    """The distinct configs a search measured, which ``budget.trials`` counts: a screened
    config measured again in full is one config, one not run (``skipped``) none."""
    return {r["key"] for r in records if r.get("phase") == "search" and not r.get("skipped") and "key" in r}


def best_of(ranked: list[dict], finished: bool = True) -> dict | None:
    """The winner: once the search has finished, the best of the configs its confirm rounds
    measured (of those measured more than once, where none ran); before that, the best so
    far. A config measured only on a disturbed machine never wins."""
    quiet = [r for r in ranked if contender(r)]
    # Where confirm rounds ran, the configs they measured: their figures were taken side by
    # side and chose no one. A config measured twice outside them (screened, then measured
    # again in full) holds one full figure, the kind of figure the rounds are there to
    # doubt; it would win on that alone once the contenders' confirm figures fell back.
    confirmed = [r for r in quiet if r.get("confirm_measurements")] or [r for r in quiet if r["measurements"] > 1]
    if confirmed and finished:
        return confirmed[0]
    return quiet[0] if quiet else None


def no_winner_reason(records: list[dict], metric: str, folder: str) -> str:
    """Why no config of ``records`` can win, and the command that helps, in one line."""
    searched = [r for r in records if r.get("phase") in ("search", "confirm")]
    if not searched:
        return f"no trial has finished yet: continue the search with `tuner resume {folder}`"
    ok = [r for r in searched if r.get("status") == "ok" and r.get(metric) is not None]
    if not ok:
        reasons = sorted({str(r.get("reason") or r.get("status")).splitlines()[0][:80] for r in searched})
        return (f"all {len(searched)} measurements were infeasible ({'; '.join(reasons[:2])}): see "
                f"`tuner show {folder}`, then widen the space or relax its constraints")
    disturbed = sum(1 for r in ok if r.get("disturbed"))
    screened = sum(1 for r in ok if r.get("screened") and not r.get("disturbed"))
    return (f"{disturbed} of {len(ok)} measurements stayed disturbed by other load on the machine"
            + (f" and {screened} were screened out" if screened else "")
            + f": stop that load (`tuner doctor` names the busiest processes), then "
            f"`tuner resume {folder} --trials {len(searched) + 4}`")


def _mid_time(record: dict) -> float | None:
    start, end = record.get("started_at"), record.get("ended_at")
    if isinstance(start, (int, float)) and isinstance(end, (int, float)):
        return (start + end) / 2
    return None


def _measured_at(records: list[dict]) -> float | None:
    """When a row's figure was taken: the median time of the measurements it comes from."""
    times = [t for t in map(_mid_time, records) if t is not None]
    return statistics.median(times) if times else None


def _quiet_baselines(records: list[Record], metric: str) -> list[Record]:
    bases = [r for r in records if r.get("phase") == "baseline"]
    measured = [r for r in bases if r.get("status") == "ok" and r.get(metric) is not None]
    return [r for r in measured if not r.get("disturbed")] or measured


def _baseline_points(records: list[Record], metric: str) -> list[tuple[float, float]]:
    """The baseline's quiet measurements as (time, figure), in time order."""
    return sorted((t, r[metric]) for r in _quiet_baselines(records, metric) if (t := _mid_time(r)) is not None)


def baseline_at(records: list[Record], metric: str, when: float,
                points: list[tuple[float, float]] | None = None) -> float | None:
    """The baseline's figure at time ``when``: interpolated between its measurements just
    before and just after (the first before the search, the others in the confirm rounds),
    the nearest one's beyond them. ``points``: ``_baseline_points``, where already known."""
    points = _baseline_points(records, metric) if points is None else points
    if not points:
        return None
    before = [p for p in points if p[0] <= when]
    after = [p for p in points if p[0] > when]
    if not before or not after:
        return (before or after)[-1 if before else 0][1]
    (t0, v0), (t1, v1) = before[-1], after[0]
    return v0 + (v1 - v0) * (when - t0) / (t1 - t0)


def with_speedups(rows: list[dict], records: list[Record], metric: str) -> list[dict]:
    """Each row's ``speedup`` over the baseline, against the baseline's figure taken as the
    row's was. A row with confirm rounds: the baseline's confirm rounds, measured
    interleaved with it. A row measured only in the search: the baseline at the time it was
    measured (``baseline_at``). A machine that drifts during a search (a VM's neighbours, a
    warming CPU) then moves both figures alike, and a config that is the baseline in all
    but name reads 1.00x, not the drift. Returns ``rows``."""
    base = baseline_of(records, metric)
    ok = bool(base) and base.get("status") == "ok"
    points = _baseline_points(records, metric) if ok else []
    for row in rows:
        ref = base.get(metric) if ok else None
        if ok and not row.get("confirm_measurements") and row.get("measured_at") is not None:
            ref = baseline_at(records, metric, row["measured_at"], points) or ref
        row["speedup"] = speedup(row.get(metric), ref, metric) if ok else None
    return rows


def row_speedup(row: dict, records: list[Record], metric: str) -> float | None:
    """One row's speed-up (``with_speedups``), the row left as it is."""
    return with_speedups([dict(row)], records, metric)[0]["speedup"]


def baseline_drift(records: list[Record], metric: str) -> dict | None:
    """The baseline's figure before the confirm rounds (``before``) and each of its
    figures in them (``rounds``), where both exist."""
    quiet = _quiet_baselines(records, metric)
    before = [r[metric] for r in quiet if not r.get("confirm_round")]
    rounds = [r[metric] for r in quiet if r.get("confirm_round")]
    if not before or not rounds:
        return None
    return {"before": statistics.median(before), "rounds": rounds}


def baseline_of(records: list[Record], metric: str) -> Record | None:
    """The baseline: its first record, with the figures pooled over all of its
    measurements (the confirm rounds re-measure it beside the contenders)."""
    bases = [r for r in records if r.get("phase") == "baseline"]
    if not bases:
        return None
    out = dict(bases[0])
    quiet = _quiet_baselines(bases, metric)
    out["measurements"] = len(bases)
    if quiet:
        out.update(status="ok", reason=None, disturbed=all(r.get("disturbed") for r in quiet))
        out[metric] = _pooled_median(quiet, metric)
        for m in ("samples_per_sec", "projected_run_s", "peak_host_memory_mb", "peak_device_memory_mb",
                  "samples_per_sec_spread", "interference_cores"):
            vals = [r[m] for r in quiet if r.get(m) is not None]
            if m != metric:
                out[m] = statistics.median(vals) if vals else None
    return out


def scaling_efficiency(rows: list[dict]) -> None:
    """Adds ``scaling_efficiency`` to each multi-rank row: its samples/sec over
    world_size x the samples/sec of the one-rank row whose other knobs are equal (the
    ddp_* knobs apart), where both were measured."""
    def others(config: dict) -> str:
        return json.dumps({k: v for k, v in config.items() if k != "world_size" and not k.startswith("ddp_")},
                          sort_keys=True, default=str)

    single = {others(r["config"]): r["samples_per_sec"] for r in rows
              if r.get("feasible") and r["config"].get("world_size", 1) == 1 and r.get("samples_per_sec")}
    for r in rows:
        n = r["config"].get("world_size", 1)
        one = single.get(others(r["config"]))
        if n > 1 and one and r.get("samples_per_sec"):
            r["scaling_efficiency"] = r["samples_per_sec"] / (n * one)


def pareto_front(rows: list[dict], metric: str) -> list[dict]:
    """Feasible rows not dominated in (metric, memory), of those that may win: a screened
    row's figure is its first windows', a disturbed one's was taken beside other load, and
    either would push a config measured in full off the front."""
    better = (lambda a, b: a >= b) if OBJECTIVE_METRICS[metric] == "max" else (lambda a, b: a <= b)
    feas = [r for r in rows if r["feasible"] and contender(r) and r.get("memory_mb") is not None]
    front = []
    for r in feas:
        dominated = any(
            better(o[metric], r[metric]) and o["memory_mb"] <= r["memory_mb"]
            and (o[metric] != r[metric] or o["memory_mb"] != r["memory_mb"])
            for o in feas)
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: r["memory_mb"])


def with_cold_compile(record: dict, cold_s: float | None) -> dict:
    """A trial that compiled with its group's warm cache: its projection keeps the cold
    compile cost (``compile_s_cold``), because the user's first run pays it. A record that
    has it already is left as it is."""
    if "compile_s_cold" in record:
        return record
    if record.get("compile_cache") == "cold":
        record["compile_s_cold"] = record.get("compile_s")
    elif record.get("compile_cache") == "warm" and cold_s is not None:
        record["compile_s_cold"] = cold_s
        if record.get("projected_run_s") is not None:
            record["projected_run_s"] += max(0.0, cold_s - (record.get("compile_s") or 0.0))
    return record


def cold_compile_of(records: list[dict], group: str | None) -> float | None:
    """The compile seconds the first (cold) trial of a compile group paid."""
    return next((r["compile_s"] for r in records if group and r.get("compile_group") == group
                 and r.get("compile_cache") == "cold" and r.get("compile_s") is not None), None)


def within_noise(rows: list[dict], metric: str, floor: float = 0.03) -> list[dict]:
    """The ranked contenders that the leader has not beaten beyond noise: a row whose
    figure is within 2 x (leader's error + its own, each at least ``floor``) of the
    leader's. ``floor``: run-to-run drift on a shared machine exceeds a single
    measurement's window error."""
    rows = [r for r in rows if contender(r)]
    if not rows:
        return []
    lead = rows[0]
    better = OBJECTIVE_METRICS[metric] == "max"
    out = [lead]
    for r in rows[1:]:
        allowance = 2 * (max(floor, lead.get("error") or floor) + max(floor, r.get("error") or floor))
        if (r[metric] >= lead[metric] * (1 - allowance)) if better else (r[metric] <= lead[metric] * (1 + allowance)):
            out.append(r)
    return out


# A contender leaves the confirm rounds once the leader's figure is ahead of its own by
# this many standard errors of their difference (a one-sided test at about 84%). Chosen by
# replay (``benchmarks/search_replay.py``) on the landscapes the rules were tuned on: a
# stricter test measured more for picks no better, a looser one dropped the best config
# on noisy hosts.
ELIMINATE_AT = 1.0

# The least noise one figure is held to: a trial a minute later meets a machine that
# drifted, however well a few repeats agreed.
MIN_REPEAT_NOISE = 0.02


def repeat_noise(records: list[Record], metric: str) -> float | None:
    """How far one full measurement of a config lies from another of the same config:
    the standard deviation of the log of their figures, pooled over every config measured
    in full more than once (search, recheck, retry and confirm figures; quiet ones only).
    None before any config was measured twice. The figures that made a contender are high
    draws, so the pooled figure leans high: the rounds then run longer, never shorter."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in records:
        value = r.get(metric)
        if (r.get("phase") in ("baseline", "lost") or r.get("status") != "ok" or r.get("screened")
                or r.get("disturbed") or not value or value <= 0):
            continue
        # one config as ``aggregate`` has it: on two GPU models, two configs
        groups.setdefault((r["key"], device_model(r)), []).append(math.log(value))
    squares, df = 0.0, 0
    for logs in groups.values():
        if len(logs) > 1:
            mean = sum(logs) / len(logs)
            squares += sum((x - mean) ** 2 for x in logs)
            df += len(logs) - 1
    return math.sqrt(squares / df) if df else None


def still_racing(ranked: list[dict], records: list[Record], metric: str) -> list[dict]:
    """The configs a confirm round measured that the leader of the rounds has not left
    behind: the race of F-Race and successive elimination. A config stays while the
    leader's figure (the median of its confirm rounds') is ahead of its own by less than
    ``ELIMINATE_AT`` standard errors of the difference, each figure's error the noise
    between two measurements of one config (``repeat_noise``) over the root of its confirm
    measurements. Every round narrows the error of those left, so a close pair is measured
    again where a clear one is not: on a quiet machine the rounds end early, on a noisy one
    they go on up to ``confirm.repeats``."""
    raced = [r for r in ranked if contender(r) and r.get("confirm_measurements")]
    if len(raced) < 2:
        return raced
    noise = max(MIN_REPEAT_NOISE, repeat_noise(records, metric) or MIN_REPEAT_NOISE)
    lead = raced[0]
    sign = 1.0 if OBJECTIVE_METRICS[metric] == "max" else -1.0

    def behind(row: dict) -> float:
        return sign * math.log(lead[metric] / row[metric])

    return [lead] + [r for r in raced[1:] if behind(r) < ELIMINATE_AT * noise * math.sqrt(
        1 / lead["confirm_measurements"] + 1 / r["confirm_measurements"])]


def winner_first(ranked: list[dict], best: dict | None) -> list[dict]:
    """The ranked rows with the winner (``best_of``) first: the first row of every table
    is the config ``export --pick best`` gives."""
    if best is None:
        return ranked
    same = (best["key"], best.get("device_model"))
    return [best] + [r for r in ranked if (r["key"], r.get("device_model")) != same]
