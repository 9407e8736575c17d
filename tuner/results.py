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
from tuner.errors import NoWinner, UserError
from tuner.records import (
    aggregate,
    baseline_of,
    best_of,
    contender,
    no_winner_reason,
    pareto_front,
    rank,
    read_json,
    read_trials,
    row_speedup,
    with_speedups,
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
        """One row per config (``records.aggregate``), each with its speed-up over the baseline."""
        return with_speedups(aggregate(self.records, self.metric), self.records, self.metric)

    def ranked(self) -> list[dict]:
        """Feasible configs best first, by the median of each config's measurements (of its
        confirm rounds' alone where it has them: ``records.aggregate``)."""
        return rank(self.rows(), self.metric)

    def best(self) -> dict | None:
        return best_of(self.ranked(), finished=self.summary is not None)

    def no_winner(self) -> str | None:
        """Why no config can be picked (one line with what to do), or None if one can."""
        if self.best() is not None:
            return None
        return no_winner_reason(self.records, self.metric, str(self.path))

    def speedup(self, row: dict) -> float | None:
        return row["speedup"] if "speedup" in row else row_speedup(row, self.records, self.metric)


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
    winner = best_of(ranked, finished=res.summary is not None)
    if winner is None:
        raise NoWinner(f"{res.path}: nothing to export: {res.no_winner()}")
    if how == "best":
        return [winner]
    if how == "pareto":
        return pareto_front(rows, res.metric)
    if how == "fastest-under-memory":
        if memory_mb is None or memory_mb <= 0:
            raise UserError("--pick fastest-under-memory needs a memory limit in MB > 0")
        fitting = [r for r in ranked if contender(r) and r.get("memory_mb") is not None
                   and r["memory_mb"] <= memory_mb]
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
        used, cap, what = row.get("peak_host_memory_mb"), hw.get("host_memory_mb"), "host memory"
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
                                        "data_wait_fraction", "step_time_ms", "samples_per_sec_per_rank",
                                        "scaling_efficiency", "joules_per_sample")}
    return {
        "config": row["config"],
        "measured": figures,
        "speedup_vs_baseline": res.speedup(row),
        "objective": res.space.objective.model_dump(),
        "memory_headroom": headroom(row),
        "workload": {"ref": res.space.workload, "args": res.space.workload_args},
        "base_dir": res.meta.get("base_dir"),
        "hardware": row.get("hardware"),
        "notes": row.get("notes") or [],
        "clip_grad_norm": row.get("clip_grad_norm"),  # the workload's, measured with each step
        "has_after_step": bool(row.get("has_after_step")),
        # how each knob the config sets is set in the user's own loop: a knob set outside
        # the code (malloc_retain's environment) is easy to miss, and its figure is not
        # reached without it
        "in_your_loop": in_your_loop(row["config"], gpu=bool((row.get("hardware") or {}).get("gpu")),
                                     find_unused=any("find_unused_parameters" in n for n in row.get("notes") or [])),
        "search": str(res.path),
    }


# group_by_length in a loop of one's own (the exported script's Batches sampler does it)
GROUP_BY_LENGTH = ("a batch_sampler that takes the items of 50 batches at random, sorts them by length and cuts "
                   "them into batches, which then come in pairs of a long and a short one, the pairs shuffled (the "
                   "first epoch starting on the longest, where its peak memory shows at once; the exported "
                   "script's Batches)")


def _hf_group_by_length() -> dict:
    """The Trainer's own length-grouped sampler, by the name this transformers gives it."""
    try:
        from transformers import TrainingArguments
    except ImportError:  # no transformers here: the current name
        return {"train_sampling_strategy": "group_by_length"}
    fields = getattr(TrainingArguments, "__dataclass_fields__", {})
    if "train_sampling_strategy" in fields or "group_by_length" not in fields:
        return {"train_sampling_strategy": "group_by_length"}
    return {"group_by_length": True}


def in_your_loop(config: dict, *, gpu: bool, find_unused: bool = False) -> list[str]:
    """One line of plain PyTorch per knob the config sets away from PyTorch's defaults:
    where it goes in a training loop of one's own."""
    from tuner import knobs

    c = {**knobs.defaults(), **config}
    away = {k for k, v in config.items() if knobs.defaults().get(k) != v}
    dev = "cuda" if gpu else "cpu"
    lines = []
    if "precision" in away:
        dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(c["precision"])
        if dtype:
            lines.append(f"precision={c['precision']}: with torch.autocast({dev!r}, dtype={dtype}): around the "
                         f"forward and the loss" + ("; scale the loss with torch.amp.GradScaler" if
                                                    c["precision"] == "fp16" else ""))
    loader = {"batch_size": c["micro_batch_size"], **knobs.loader_kwargs(c, dev)}
    if away & {"micro_batch_size", "num_workers", "persistent_workers", "prefetch_factor", "pin_memory"}:
        lines.append("DataLoader(dataset, " + ", ".join(f"{k}={v!r}" for k, v in loader.items())
                     + ", shuffle=True, drop_last=True) (an IterableDataset: without shuffle)")
    if "grad_accum_steps" in away:
        lines.append(f"grad_accum_steps={c['grad_accum_steps']}: backward on loss / {c['grad_accum_steps']} for "
                     f"{c['grad_accum_steps']} micro-batches, then one optimizer step")
    if c["non_blocking"]:
        lines.append("non_blocking=True: batch.to('cuda', non_blocking=True)")
    if c["channels_last"]:
        lines.append("channels_last=True: model.to(memory_format=torch.channels_last), and each 4-D input "
                     "x.contiguous(memory_format=torch.channels_last)")
    if c["fused_optimizer"]:
        lines.append("fused_optimizer=True: fused=True to the optimizer (torch.optim.AdamW(params, fused=True))")
    if c["activation_checkpointing"]:
        lines.append("activation_checkpointing=True: torch.utils.checkpoint.checkpoint(block, x, "
                     "use_reentrant=False) per block")
    if c["compile"] != "off":
        lines.append(f"compile={c['compile']}: model = {_compile_call(c)}, after the steps above")
    if c["torch_threads"]:
        lines.append(f"torch_threads={c['torch_threads']}: torch.set_num_threads({c['torch_threads']}) at start")
    if c["malloc_retain"]:
        lines.append(f"malloc_retain=True: start the run with {_malloc_env()} in the environment (glibc reads "
                     f"them at start; on a CPU this knob can be much of the figure)")
    if c["gc_freeze"]:  # after the build it freezes; before the first batch, where the workers fork
        lines.append("gc_freeze=True: gc.collect(); gc.freeze() (import gc) once the model, optimizer and "
                     "DataLoader are built, just before the training loop's first batch, and again after the "
                     "first optimizer step (its objects: torch.compile's graphs, the optimizer's state)")
    if c["cudnn_benchmark"]:
        lines.append("cudnn_benchmark=True: torch.backends.cudnn.benchmark = True at start")
    if c["tf32"]:
        lines.append('tf32=True: torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True')
    if c["batch_grouping"] == "by_source":
        lines.append("batch_grouping=by_source: a batch_sampler whose batches each hold one source")
    if c["group_by_length"]:
        lines.append(f"group_by_length=True: {GROUP_BY_LENGTH}")
    lines += _data_lines(c)
    if c["world_size"] > 1:
        hook = "" if c["ddp_comm_hook"] == "none" else f"; model.register_comm_hook(None, default_hooks.{c['ddp_comm_hook']}_hook)"
        lines.append(f"world_size={c['world_size']}: torchrun --nproc_per_node {c['world_size']}; "
                     f"DistributedDataParallel(model, bucket_cap_mb={c['ddp_bucket_cap_mb']}, "
                     f"gradient_as_bucket_view={c['ddp_gradient_as_bucket_view']}, static_graph={c['ddp_static_graph']}, "
                     f"find_unused_parameters={find_unused}){hook}"
                     + ("; with model.no_sync() on accumulation micro-steps" if c["ddp_no_sync_accumulation"] else ""))
    return lines


def _header(payload: dict) -> list[str]:
    hw = payload.get("hardware") or {}
    fig = payload["measured"]
    return [f"# tuner export: {payload['workload']['ref']} on {hw.get('gpu') or hw.get('cpu')}, torch {hw.get('torch')}",
            f"# measured {fig.get('samples_per_sec') or 0:,.1f} samples/s"
            + (f" ({payload['speedup_vs_baseline']:.2f}x the plain loop)" if payload.get("speedup_vs_baseline") else "")]


def _full_config(payload: dict) -> dict:
    from tuner import knobs

    return {**knobs.defaults(), **payload["config"]}


def python_script(payload: dict) -> str:
    """A script that trains the user's own workload with the chosen config, as it is
    (``python train.py``; ``--steps N`` prints its samples/sec over N steps)."""
    from pathlib import Path as _Path

    template = (_Path(__file__).parent / "templates" / "train.py").read_text()
    hw = payload.get("hardware") or {}
    fills = {
        "WORKLOAD = None": f"WORKLOAD = {payload['workload']['ref']!r}",
        "WORKLOAD_ARGS = {}": f"WORKLOAD_ARGS = {payload['workload']['args']!r}",
        "BASE_DIR = None": f"BASE_DIR = {payload.get('base_dir')!r}",
        'DEVICE = "cpu"': f"DEVICE = {'cuda' if hw.get('gpu') else 'cpu'!r}",
        "CONFIG = {}": "CONFIG = " + _dict_literal(_full_config(payload)),
        "FIND_UNUSED = False": f"FIND_UNUSED = {any('find_unused_parameters' in n for n in payload.get('notes') or [])}",
    }
    for old, new in fills.items():
        template = template.replace(old, new, 1)
    return "\n".join(_header(payload)) + "\n" + template


def _dict_literal(d: dict) -> str:
    return "{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in d.items()) + "}"


def hf_kwargs(payload: dict) -> tuple[dict, list[str]]:
    """Hugging Face ``TrainingArguments`` kwargs, and the knobs it cannot express."""
    c = _full_config(payload)
    gpu = bool((payload.get("hardware") or {}).get("gpu"))
    kw: dict[str, Any] = {"per_device_train_batch_size": c["micro_batch_size"],
                          "gradient_accumulation_steps": c["grad_accum_steps"],
                          "dataloader_num_workers": c["num_workers"]}
    if c["precision"] == "bf16":
        kw["bf16"] = True
    elif c["precision"] == "fp16":
        kw["fp16"] = True
    if not gpu:
        kw["use_cpu"] = True
    if c["num_workers"] > 0:
        kw["dataloader_persistent_workers"] = c["persistent_workers"]
        if c["prefetch_factor"]:
            kw["dataloader_prefetch_factor"] = c["prefetch_factor"]
    if gpu:
        kw["dataloader_pin_memory"] = c["pin_memory"]
    else:
        kw["dataloader_pin_memory"] = False
    if c["compile"] != "off":
        kw["torch_compile"] = True
        if c["compile"] != "default":
            kw["torch_compile_mode"] = c["compile"]
    # Named either way: the Trainer's own default is the fused AdamW, which is not what a
    # config without fused_optimizer was measured with.
    kw["optim"] = "adamw_torch_fused" if c["fused_optimizer"] else "adamw_torch"
    if c["activation_checkpointing"]:
        kw["gradient_checkpointing"] = True
    if c["tf32"]:
        kw["tf32"] = True
    if payload.get("clip_grad_norm"):  # measured with it; the Trainer's own default is 1.0
        kw["max_grad_norm"] = payload["clip_grad_norm"]
    unsaid = []
    if payload.get("has_after_step"):
        unsaid.append("the workload's after_step (measured after each optimizer step): call it from a "
                      "TrainerCallback's on_step_end")
    if c["channels_last"]:
        unsaid.append("channels_last=True: model.to(memory_format=torch.channels_last) before Trainer(model=...)")
    if c["torch_threads"]:
        unsaid.append(f"torch_threads={c['torch_threads']}: torch.set_num_threads({c['torch_threads']}) at start")
    if c["malloc_retain"]:
        unsaid.append(f"malloc_retain=True: {_malloc_env()} in the environment")
    if c["gc_freeze"]:
        unsaid.append("gc_freeze=True: gc.collect(); gc.freeze() (import gc) just before trainer.train(), and "
                      "again after the first step (a TrainerCallback's on_step_end)")
    if c["cudnn_benchmark"]:
        unsaid.append("cudnn_benchmark=True: torch.backends.cudnn.benchmark = True at start")
    if c["non_blocking"]:
        unsaid.append("non_blocking=True: the Trainer moves batches itself (not settable)")
    if c["batch_grouping"] == "by_source":
        unsaid.append("batch_grouping=by_source: a batch sampler of one source per batch (override get_train_dataloader)")
    if c["group_by_length"]:
        kw.update(_hf_group_by_length())
        unsaid.append("group_by_length=True: the Trainer reads each item's input_ids for its length, once, at the "
                      "start (a datasets.Dataset with a 'length' column is read for it instead)")
    if c["fused_optimizer"]:
        unsaid.append("fused_optimizer: optim='adamw_torch_fused' is AdamW; with another optimizer pass fused=True to it")
    unsaid += _data_lines(c)
    if c["world_size"] > 1:
        kw["ddp_bucket_cap_mb"] = c["ddp_bucket_cap_mb"]
        kw["ddp_static_graph"] = c["ddp_static_graph"]
        kw["ddp_find_unused_parameters"] = _find_unused(payload)
        unsaid.append(f"world_size={c['world_size']}: launch with torchrun --nproc_per_node {c['world_size']}")
        if c["ddp_gradient_as_bucket_view"]:
            unsaid.append("ddp_gradient_as_bucket_view=True: no TrainingArguments field")
        if c["ddp_comm_hook"] != "none":
            unsaid.append(f"ddp_comm_hook={c['ddp_comm_hook']}: register it on the wrapped model "
                          "(model.register_comm_hook) in a Trainer subclass")
        if not c["ddp_no_sync_accumulation"]:
            unsaid.append("ddp_no_sync_accumulation=False: the HF Trainer always skips the all-reduce "
                          "on accumulation micro-steps")
    return kw, unsaid


def _data_lines(c: dict) -> list[str]:
    """The input pipeline's knobs, as lines a user pastes (tuner.data is usable alone)."""
    lines = []
    if c.get("dataset_cache"):
        lines.append(f"dataset_cache=True: train_dataset = tuner.data.cached(train_dataset, workers={c['num_workers']}) "
                     "(from tuner.data import cached): items read once, shared by the DataLoader's workers")
    if c.get("augment_on") == "device":
        lines.append("augment_on=device: apply the random per-batch augmentation to the batch after it is on the "
                     "device (in training_step / compute_loss), not in the dataset or collate")
    return lines


def _compile_call(c: dict) -> str:
    """The torch.compile call of the config's mode, as a user writes it."""
    mode = "" if c["compile"] == "default" else f", mode={c['compile']!r}"
    return f"torch.compile(model{mode})"


def _malloc_env() -> str:
    from tuner import knobs

    return " ".join(f"{k}={v}" for k, v in knobs.MALLOC_RETAIN_ENV.items())


def _find_unused(payload: dict) -> bool:
    """Whether the tuner found parameters the loss does not reach (DDP's find_unused_parameters)."""
    return any("find_unused_parameters" in n for n in payload.get("notes") or [])


def lightning_kwargs(payload: dict) -> tuple[dict, dict, list[str]]:
    """Lightning ``Trainer`` kwargs, the DataLoader kwargs, and the rest as code lines."""
    c = _full_config(payload)
    gpu = bool((payload.get("hardware") or {}).get("gpu"))
    trainer: dict[str, Any] = {
        "accelerator": "gpu" if gpu else "cpu", "devices": 1,
        "precision": {"bf16": "bf16-mixed", "fp16": "16-mixed"}.get(c["precision"], "32-true"),
        "accumulate_grad_batches": c["grad_accum_steps"],
    }
    if gpu:
        trainer["benchmark"] = c["cudnn_benchmark"]
    if payload.get("clip_grad_norm"):  # measured with the workload's clipping
        trainer["gradient_clip_val"] = payload["clip_grad_norm"]
    from tuner import knobs

    loader: dict[str, Any] = {"batch_size": c["micro_batch_size"], "shuffle": True, "drop_last": True,
                              **knobs.loader_kwargs(c, "cuda" if gpu else "cpu")}
    code = []
    if c["torch_threads"]:
        code.append(f"torch.set_num_threads({c['torch_threads']})")
    if c["malloc_retain"]:
        code.append(f"# malloc_retain: start the run with {_malloc_env()} in the environment")
    if c["tf32"]:
        code.append('torch.set_float32_matmul_precision("high")  # tf32')
    if c["gc_freeze"]:
        code.append("# gc_freeze: gc.collect(); gc.freeze() (import gc) just before trainer.fit, and again after "
                    "the first step (a Callback's on_train_batch_end)")
    if c["channels_last"]:
        code.append("model = model.to(memory_format=torch.channels_last)  # and every 4-D input in training_step: "
                    "x = x.contiguous(memory_format=torch.channels_last)")
    if c["activation_checkpointing"]:
        code.append("# activation_checkpointing: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) per block")
    if c["fused_optimizer"]:
        code.append("# fused_optimizer: pass fused=True to the optimizer in configure_optimizers()")
    if c["compile"] != "off":
        code.append(f"model = {_compile_call(c)}  # the LightningModule, before trainer.fit")
    if c["batch_grouping"] == "by_source":
        code.append("# batch_grouping=by_source: a batch_sampler whose batches each hold one source")
    if c["group_by_length"]:
        code.append(f"# group_by_length: {GROUP_BY_LENGTH}")
    if payload.get("has_after_step"):
        code.append("# the workload's after_step (measured after each optimizer step): call it from a Callback's "
                    "on_train_batch_end")
    code += [f"# {line}" for line in _data_lines(c)]
    if c["non_blocking"]:
        code.append("# non_blocking: Lightning moves batches itself (not settable)")
    if c["world_size"] > 1:
        trainer["devices"] = c["world_size"]
        hook = "" if c["ddp_comm_hook"] == "none" else f", ddp_comm_hook=default_hooks.{c['ddp_comm_hook']}_hook"
        if hook:
            code.append("from torch.distributed.algorithms.ddp_comm_hooks import default_hooks")
        code.append(f"trainer_kwargs['strategy'] = L.pytorch.strategies.DDPStrategy(bucket_cap_mb={c['ddp_bucket_cap_mb']}, "
                    f"gradient_as_bucket_view={c['ddp_gradient_as_bucket_view']}, static_graph={c['ddp_static_graph']}, "
                    f"find_unused_parameters={_find_unused(payload)}{hook})")
        if not c["ddp_no_sync_accumulation"]:
            code.append("# ddp_no_sync_accumulation=False: Lightning always skips the all-reduce on accumulation micro-steps")
    return trainer, loader, code


def framework_snippet(payload: dict, fmt: str) -> str:
    lines = _header(payload)
    if fmt == "hf":
        kw, unsaid = hf_kwargs(payload)
        lines += ["from transformers import TrainingArguments", "",
                  "training_args = " + _dict_literal(kw),
                  'args = TrainingArguments(output_dir="out", **training_args)']
        lines += [f"# not expressible in TrainingArguments: {u}" for u in unsaid]
        # Sizes from benchmarks/anatomy.py (each part of a step timed inside the Trainer's
        # process and a plain loop's) and framework_speed.py --overhead (a linear layer).
        clipping = ("a learning-rate scheduler step (the figure holds the workload's clipping)"
                    if payload.get("clip_grad_norm") else
                    "gradient clipping (max_grad_norm=1.0: a norm over every gradient;\n"
                    "#   max_grad_norm=0 turns it off), a learning-rate scheduler step")
        lines += ["# the Trainer adds work of its own that the tuner's figure does not hold:",
                  f"# - each step: {clipping}, its loss checks",
                  "#   and callbacks: milliseconds a step on small models, timed on the results page",
                  "#   (docs/benchmarks.md, anatomy)"]
        if payload["config"].get("num_workers"):
            # The Trainer's loader looks a batch ahead to know the last one: with short epochs
            # and a worker, most of the Trainer's gap to the tuner (docs/benchmarks.md).
            lines += ["# - each epoch: its loader (accelerate's DataLoaderShard) reads one batch ahead, so",
                      "#   an epoch's first step waits for two batches: with DataLoader workers, one batch's",
                      "#   preparation more per epoch (persistent_workers does not avoid it; small where an",
                      "#   epoch holds hundreds of steps)"]
    else:
        trainer, loader, code = lightning_kwargs(payload)
        lines += ["import lightning as L", "import torch", "",
                  "trainer_kwargs = " + _dict_literal(trainer),
                  "dataloader_kwargs = " + _dict_literal(loader),
                  "# (an IterableDataset orders its own items: drop shuffle for one)"]
        lines += code
        lines += ["# Lightning adds per-step work of its own that the tuner's figure does not hold: its",
                  "# loop, the optimizer step's closure, progress bar and logger: milliseconds a step on",
                  "# small models, timed on the results page (docs/benchmarks.md, anatomy);",
                  "# enable_progress_bar=False and logger=False turn the bar and the logger off",
                  "trainer = L.Trainer(**trainer_kwargs)",
                  "train_loader = torch.utils.data.DataLoader(dataset, **dataloader_kwargs)"]
    return "\n".join(lines) + "\n"


def render(payloads: list[dict], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(payloads[0] if len(payloads) == 1 else payloads, indent=2, default=str) + "\n"
    if fmt == "yaml":
        data: Any = payloads[0] if len(payloads) == 1 else payloads
        return yaml.safe_dump(json.loads(json.dumps(data, default=str)), sort_keys=False, width=10_000)
    if fmt == "python":
        if len(payloads) > 1:
            raise UserError("--format python writes one script: pick one config (--device-model, or --pick best)")
        return python_script(payloads[0])
    if fmt in ("hf", "lightning"):
        return "\n".join(framework_snippet(p, fmt) for p in payloads)
    raise UserError(f"--format {fmt!r}: expected yaml, json, python, hf or lightning")
