"""Reading a results folder: trials, best / Pareto picks, export formats.

A results folder (``results/<name>/``) holds ``space.yaml`` (the resolved space
the search ran), ``meta.json`` (where the workload lives), ``trials.jsonl`` (every
measurement, appended as it lands: readable while the search runs and after a
kill), ``optuna.journal`` (the Optuna study), ``summary.json`` (at the end) and
Ray's experiment folders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tuner import spec
from tuner.errors import UserError
from tuner.records import (
    aggregate,
    baseline_of,
    best_of,
    pareto_front,
    rank,
    read_json,
    read_trials,
    speedup,
)


@dataclass
class Results:
    path: Path
    space: spec.SpaceModel
    records: list[dict]
    summary: dict | None
    meta: dict

    @property
    def metric(self) -> str:
        return self.space.objective.metric

    @property
    def baseline(self) -> dict | None:
        return baseline_of(self.records, self.metric)

    def rows(self) -> list[dict]:
        return aggregate(self.records, self.metric)

    def ranked(self) -> list[dict]:
        """Feasible configs best first, by the median of each config's measurements."""
        return rank(self.rows(), self.metric)

    def best(self) -> dict | None:
        return best_of(self.ranked(), finished=self.summary is not None)

    def speedup(self, row: dict) -> float | None:
        base = self.baseline
        if not base or base.get("status") != "ok":
            return None
        return speedup(row.get(self.metric), base.get(self.metric), self.metric)


def open_results(path: str | Path) -> Results:
    """Load a results folder; a folder that is not one is a one-line UserError."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{p}: no such results folder")
    trials = p / "trials.jsonl"
    space_file = p / "space.yaml"
    if not trials.is_file() or not space_file.is_file():
        raise UserError(f"{p}: not a results folder (expected trials.jsonl and space.yaml from `tuner run`)")
    records = read_trials(trials)
    model = read_space(space_file)
    summary_file = p / "summary.json"
    summary = read_json(summary_file) if summary_file.is_file() else None
    meta_file = p / "meta.json"
    meta = read_json(meta_file) if meta_file.is_file() else {}
    return Results(path=p, space=model, records=records, summary=summary, meta=meta)


def read_space(path: Path) -> spec.SpaceModel:
    """The resolved space a search saved (space.yaml of a results folder)."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        raise UserError(f"{path}: not a readable space file (a torn or hand-edited file?)") from None
    try:
        return spec.SpaceModel.model_validate(data)
    except Exception as exc:  # pydantic's ValidationError: one line naming the field
        first = str(exc).splitlines()
        detail = f"{first[1].strip()}: {first[2].strip()}" if len(first) > 2 else (first[0] if first else "")
        raise UserError(f"{path}: not a valid saved space ({detail})") from None


def pick(res: Results, how: str, memory_mb: float | None = None, device_model: str | None = None) -> list[dict]:
    """The rows that ``export --pick`` chooses: best, the Pareto front, or the fastest
    config whose peak memory is under ``memory_mb``; on one device model if given."""
    rows = res.rows()
    models = sorted({r["device_model"] for r in rows})
    if device_model is not None:
        if device_model not in models:
            raise UserError(f"--device-model {device_model!r}: measured on {', '.join(models)}")
        rows = [r for r in rows if r["device_model"] == device_model]
    elif len(models) > 1 and how != "pareto":
        # a mixed cluster: the winner of each model
        return [p for m in models for p in pick(res, how, memory_mb, m)]
    ranked = rank(rows, res.metric)
    if not ranked:
        raise UserError(f"{res.path}: no feasible trial to pick from (see `tuner show {res.path}`)")
    if how == "best":
        return [best_of(ranked, finished=res.summary is not None)]
    if how == "pareto":
        return pareto_front(rows, res.metric)
    if how == "fastest-under-memory":
        if memory_mb is None or memory_mb <= 0:
            raise UserError("--pick fastest-under-memory needs a memory limit in MB > 0")
        fitting = [r for r in ranked if r.get("memory_mb") is not None and r["memory_mb"] <= memory_mb]
        if not fitting:
            smallest = min((r["memory_mb"] for r in ranked if r.get("memory_mb") is not None), default=None)
            raise UserError(f"--pick fastest-under-memory {memory_mb:g}: no feasible trial fits "
                            f"(the smallest peak was {smallest:,.0f} MB)" if smallest else
                            f"--pick fastest-under-memory {memory_mb:g}: no trial recorded its memory")
        return [fitting[0]]
    raise UserError(f"--pick {how!r}: expected best, pareto or fastest-under-memory")


def headroom(row: dict) -> dict:
    """How far the config's peak memory sits below the device's (or host's) capacity."""
    hw = row.get("hardware") or {}
    if row.get("peak_device_memory_mb") is not None and hw.get("gpu_memory_mb"):
        used, cap, what = row["peak_device_memory_mb"], hw["gpu_memory_mb"], f"GPU ({hw.get('gpu')})"
    else:
        used, cap, what = row.get("peak_host_memory_mb"), hw.get("host_memory_mb"), "host RAM"
    if used is None or not cap:
        return {"note": "memory capacity unknown", "fraction_free": None}
    free = 1.0 - used / cap
    note = f"peak {used:,.0f} MB of {cap:,.0f} MB {what}: {free:.0%} headroom"
    if free < 0.10:
        note += " -- WARNING: under 10% headroom; a longer sequence or a bigger batch may not fit"
    return {"note": note, "fraction_free": free, "peak_mb": used, "capacity_mb": cap}


def export_payload(res: Results, row: dict) -> dict:
    """Everything a user needs to trust and reproduce one exported config."""
    figures = {k: row.get(k) for k in ("samples_per_sec", "projected_run_s", "spread", "values", "measurements",
                                        "peak_host_memory_mb", "peak_device_memory_mb", "compile_s",
                                        "data_wait_fraction", "step_time_ms")}
    return {
        "config": row["config"],
        "measured": figures,
        "speedup_vs_baseline": res.speedup(row),
        "objective": res.space.objective.model_dump(),
        "memory_headroom": headroom(row),
        "workload": {"ref": res.space.workload, "args": res.space.workload_args},
        "hardware": row.get("hardware"),
        "search": str(res.path),
    }


def python_snippet(payload: dict) -> str:
    """Code a user pastes into a plain PyTorch training script."""
    from tuner import knobs

    c = {**knobs.defaults(), **payload["config"]}
    hw = payload.get("hardware") or {}
    fig = payload["measured"]
    device = "cuda" if hw.get("gpu") else "cpu"
    lines = [
        f"# tuner export: {payload['workload']['ref']} on {hw.get('gpu') or hw.get('cpu')}",
        f"# measured {fig.get('samples_per_sec') or 0:,.1f} samples/s"
        + (f" ({payload['speedup_vs_baseline']:.2f}x the plain loop)" if payload.get("speedup_vs_baseline") else "")
        + f", torch {hw.get('torch')}",
        "import torch",
        "",
        f'device = torch.device("{device}")',
    ]
    if c.get("torch_threads"):
        lines.append(f"torch.set_num_threads({c['torch_threads']})")
    if device == "cuda":
        lines.append(f"torch.backends.cudnn.benchmark = {c.get('cudnn_benchmark', False)}")
        lines.append(f"torch.backends.cuda.matmul.allow_tf32 = {c.get('tf32', False)}")
        lines.append(f"torch.backends.cudnn.allow_tf32 = {c.get('tf32', False)}")
    loader = [f"batch_size={c['micro_batch_size']}", "shuffle=True", "drop_last=True",
              f"num_workers={c['num_workers']}"]
    if c["num_workers"] > 0:
        loader.append(f"persistent_workers={c['persistent_workers']}")
        if c.get("prefetch_factor"):
            loader.append(f"prefetch_factor={c['prefetch_factor']}")
    if device == "cuda":
        loader.append(f"pin_memory={c.get('pin_memory', False)}")
    if c.get("batch_grouping") == "by_source":
        lines.append("# batch_grouping=by_source: use a batch_sampler whose batches each hold one source")
    lines.append(f"loader = torch.utils.data.DataLoader(dataset, {', '.join(loader)})")
    lines.append("model = build_model().to(device" + (", memory_format=torch.channels_last)" if c.get("channels_last") else ")"))
    if c.get("activation_checkpointing"):
        lines.append("# activation_checkpointing: wrap each block's forward in "
                     "torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)")
    lines.append("optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3"
                 + (", fused=True)" if c.get("fused_optimizer") else ")") + "  # your optimizer")
    if c.get("compile", "off") != "off":
        mode = "" if c["compile"] == "default" else f', mode="{c["compile"]}"'
        lines.append(f"model = torch.compile(model{mode})  # after .to() and checkpointing")
    dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(c["precision"])
    if c["precision"] == "fp16":
        lines.append(f'scaler = torch.amp.GradScaler("{device}")')
    accum = c.get("grad_accum_steps", 1)
    nb = ", non_blocking=True" if c.get("non_blocking") and device == "cuda" else ""
    cl = c.get("channels_last")
    lines += [
        f"accum_steps = {accum}",
        "for step, (x, y) in enumerate(loader):",
        f"    x, y = x.to(device{nb}" + (", memory_format=torch.channels_last" if cl else "") + f"), y.to(device{nb})",
    ]
    if dtype:
        lines.append(f'    with torch.autocast("{device}", dtype={dtype}):')
        lines.append("        loss = loss_fn(model(x), y)" + (" / accum_steps" if accum > 1 else ""))
    else:
        lines.append("    loss = loss_fn(model(x), y)" + (" / accum_steps" if accum > 1 else ""))
    if c["precision"] == "fp16":
        lines.append("    scaler.scale(loss).backward()")
    else:
        lines.append("    loss.backward()")
    step = ["scaler.step(optimizer)", "scaler.update()"] if c["precision"] == "fp16" else ["optimizer.step()"]
    step.append("optimizer.zero_grad(set_to_none=True)")
    if accum > 1:
        lines.append("    if (step + 1) % accum_steps == 0:")
        lines += [f"        {s}" for s in step]
    else:
        lines += [f"    {s}" for s in step]
    lines.append("    # no loss.item() here: log every N steps, it waits for the device")
    return "\n".join(lines) + "\n"


def render(payloads: list[dict], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(payloads[0] if len(payloads) == 1 else payloads, indent=2, default=str) + "\n"
    if fmt == "yaml":
        data: Any = payloads[0] if len(payloads) == 1 else payloads
        return yaml.safe_dump(json.loads(json.dumps(data, default=str)), sort_keys=False)
    if fmt == "python":
        return "\n".join(python_snippet(p) for p in payloads)
    raise UserError(f"--format {fmt!r}: expected yaml, json or python")
