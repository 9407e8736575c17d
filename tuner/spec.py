"""space.yaml: schema, validation with field-level errors (file and line), defaults.

Every section is a typed model; unknown keys and wrong types are errors that
name the field and its line::

    space.yaml:7: knobs.num_workerz: unknown knob 'num_workerz' (did you mean 'num_workers'?); known knobs: ...

See ``search_spaces/quickstart.yaml`` for a commented example.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tuner import knobs
from tuner.errors import UserError, did_you_mean
from tuner.records import OBJECTIVE_METRICS  # also read by callers as spec.OBJECTIVE_METRICS
from tuner.settings import MeasureSettings as Measure
from tuner.settings import RunPlan as Run


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class Objective(_Strict):
    metric: str = "samples_per_sec"
    """What to optimize (``records.OBJECTIVE_METRICS``, which owns the list and each
    metric's direction): throughput (maximize), the planned run's time (minimize),
    throughput per data-parallel rank, i.e. per GPU on GPUs (maximize: for those who
    pay per GPU-hour), or samples per joule of the GPUs' board power (maximize, on GPUs:
    the energy-optimal config is often not the fastest one)."""
    memory: bool = False
    """Also minimize peak memory: a two-objective search with a Pareto front."""

    @field_validator("metric")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in OBJECTIVE_METRICS:
            raise ValueError(f"'{v}' is not one of {', '.join(OBJECTIVE_METRICS)}")
        return v


class Constraints(_Strict):
    max_memory_mb: float | None = Field(None, gt=0)
    """Configs whose peak memory (device on GPU, host on CPU) exceeds this are infeasible."""
    effective_batch_size: int | None = Field(None, gt=0)
    """micro_batch_size x grad_accum_steps held fixed; accumulation is derived."""


class Budget(_Strict):
    trials: int = Field(12, ge=1)
    """Configs the search tries (as Tune's num_samples and Optuna's n_trials count them).
    On top come the baseline, the confirm rounds' re-measurements of the top configs, the
    incumbent's rechecks and the full re-measurement of a screened config the model still
    rates (the summary and ``show`` count them); ``time_s`` caps the wall time."""
    time_s: float | None = Field(None, gt=0)
    """Wall-clock budget of the search; no new trial starts after it."""
    trial_timeout_s: float = Field(300.0, gt=0)
    """A trial running longer is stopped and recorded as hung."""


class Resources(_Strict):
    gpus_per_trial: int = Field(1, ge=0)
    """Whole GPUs per trial when the search runs on GPUs."""
    max_concurrent: int | None = Field(None, ge=1)
    """Trials at once; default one per GPU, or one at a time on a CPU-only cluster."""
    spread_ranks: bool = False
    """Let the ranks of a multi-rank trial (world_size > 1) spread across nodes; by
    default they stay on one node."""


class Confirm(_Strict):
    top: int = Field(3, ge=0)
    """How many of the best configs (those within noise of the leader) are re-measured
    at the end, interleaved with the baseline."""
    repeats: int = Field(4, ge=0)
    """Rounds of re-measurement at most; the winner is chosen on the median of a config's
    confirm-round measurements (its search figure, which made it a contender, left out).
    The rounds come after the budget.trials configs; a round after the first measures
    the contenders the leader has not left behind by the noise of their figures, and runs
    only while 2+ of them are left (and, under a time budget, only if it fits): a close
    race is measured again, a clear one is not."""


class SpaceModel(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    workload: str
    workload_args: dict[str, Any] = {}
    device: Literal["auto", "cpu", "cuda"] = "auto"
    knobs: dict[str, Any] = {}
    baseline: dict[str, Any] = {}
    """Knob values of the baseline beyond PyTorch's defaults (e.g. its micro_batch_size)."""
    objective: Objective = Objective()
    constraints: Constraints = Constraints()
    budget: Budget = Budget()
    resources: Resources = Resources()
    sampler: Literal["guided", "tpe", "random", "grid", "nsga2"] | None = None
    """None: guided (one objective) or nsga2 (two objectives)."""
    seed: int = 0
    confirm: Confirm = Confirm()
    measure: Measure = Measure()
    run: Run = Run()
    hot_path: bool = True
    """Check the baseline's and the pick's step for hot-path defects once, after the
    search (docs/hot-path.md): a fresh process and a few steps each, a compile where the
    pick has one. False (``run --no-hot-path``) skips it; ``profile`` runs it later."""
    log_to: list[Literal["tensorboard", "mlflow"]] = []
    """Also log every trial's figures with Ray Tune's logger callbacks: TensorBoard event
    files under results/<name>/ray/, an MLflow SQLite store in results/<name>/mlflow.db."""

    def confirm_measurements(self) -> int:
        """The confirm rounds' measurements, after the search's ``budget.trials`` configs:
        ``confirm.repeats`` rounds of the top ``confirm.top`` configs and the baseline
        (none with a memory objective: a Pareto front has no single winner to confirm)."""
        if not (self.confirm.top and self.confirm.repeats) or self.objective.memory:
            return 0
        return self.confirm.repeats * (self.confirm.top + 1)

    def search_trials(self) -> int:
        """Configs the search tries: ``budget.trials``."""
        return self.budget.trials

    @field_validator("objective", mode="before")
    @classmethod
    def _objective_shorthand(cls, v: Any) -> Any:
        return {"metric": v} if isinstance(v, str) else v

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if v in (".", ".."):
            raise ValueError("a folder name, not '.' or '..' (it names results/<name>/)")
        return v


@dataclass
class Space:
    """A validated space file."""

    model: SpaceModel
    path: Path | None
    domain: dict[str, list] = field(default_factory=dict)
    """Searched knobs (two or more values) and fixed ones (one value), each a list."""
    where: _Where | None = None
    base: Path | None = None
    """Where relative workload files are found; default: the space file's folder."""

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def base_dir(self) -> Path:
        if self.base is not None:
            return self.base
        return self.path.parent if self.path else Path.cwd()

    @property
    def searched(self) -> dict[str, list]:
        return {k: v for k, v in self.domain.items() if len(v) > 1}

    @property
    def fixed(self) -> dict[str, Any]:
        return {k: v[0] for k, v in self.domain.items() if len(v) == 1}

    def size(self) -> int:
        return math.prod(len(v) for v in self.domain.values()) if self.domain else 1

    def beyond_cores(self, cores: int) -> list[str]:
        """What the space lists beyond the ``cores`` a trial has (``beyond_cores``)."""
        return beyond_cores(self.domain, cores)

    def derive(self, config: dict) -> dict:
        """Apply derived knobs: accumulation from a fixed effective batch size."""
        eff = self.model.constraints.effective_batch_size
        if eff is not None and "micro_batch_size" in config:
            config = dict(config, grad_accum_steps=eff // config["micro_batch_size"])
        return config

    def recommended_config(self, ctx: knobs.Context, given: dict | None = None) -> dict:
        """The guides' pick for each searched or fixed knob, where the space allows it;
        else the default point's value (the guides have no advice there that the space
        holds: the first listed value would be advice nobody gave); with the values
        ``given`` (``bench --set``) in its place, the advice fitted around them."""
        rec, default = knobs.recommended(ctx), self.default_point(ctx)
        config = {k: (rec[k] if rec[k] in values else default[k]) for k, values in self.domain.items()}
        config.update(given or {})
        threads = self.domain.get("torch_threads")
        if ctx.device == "cpu" and threads and len(threads) > 1 and "torch_threads" not in (given or {}):
            # Threads and DataLoader workers share the cores: the threads the workers leave.
            workers = int(config.get("num_workers", self.fixed.get("num_workers", 0)) or 0)
            config["torch_threads"] = threads_left(threads, workers, ctx.cpu_count)
        return self.derive(config)

    def start_points(self, ctx: knobs.Context) -> list[dict]:
        """The guided search's first configs: PyTorch's defaults, the guides' advice, and on
        CPUs where both threads and workers are searched, the advice with the other splits
        of the cores (threads and workers share them, and which side wins depends on the
        workload): the fewest workers listed, then the most (workers tolerate sharing
        cores, and a search starting from one worker rarely reaches many), each with the
        threads the workers leave, as the advice has (``threads_left``): on any number of
        cores each start keeps every core busy and none oversubscribed.

        On a CPU the advice starts at the largest micro-batch listed (the guides: a small
        batch leaves the device underused; a larger one spreads each step's fixed costs
        over more samples; where three or more are listed, the guided sampler measures the
        best start at half the largest too, and lower while each halving wins:
        ``GuidedSampler._halved``). Not on a GPU: the largest listed may not fit, and an
        infeasible start teaches the model that every value it holds is bad; the guided
        sampler grows the batch there once the memory of a measured config says what fits
        (``GuidedSampler._grown``).

        On a CPU where the advice is bf16 and fp32 is listed, the next start is the advice
        in fp32: whether bf16 autocast is faster depends on the host more than the CPU's
        flags say (with AVX512-BF16 and no AMX it was faster on one host and slower on
        another: docs/how-it-searches.md), and the starts after it take whichever of the pair read faster
        (``GuidedSampler``), so that the splits of the cores are measured at the host's
        faster precision."""
        starts = self._first_starts(ctx)
        return starts + self.split_starts(ctx, starts)

    def _first_starts(self, ctx: knobs.Context) -> list[dict]:
        """PyTorch's defaults, the advice, and on a CPU the advice's fp32 partner."""
        default, rec = self.default_point(ctx), self.recommended_config(ctx)
        batches = self.domain.get("micro_batch_size")
        if ctx.device == "cpu" and batches and len(batches) > 1:
            rec = self.derive({**rec, "micro_batch_size": max(batches)})
        starts = [default, rec]
        precisions = self.domain.get("precision", [])
        if ctx.device == "cpu" and "fp32" in precisions and rec["precision"] != "fp32":
            starts.append(self.derive({**rec, "precision": "fp32"}))
        return starts

    def split_starts(self, ctx: knobs.Context, first: list[dict] | None = None) -> list[dict]:
        """The starts that split the cores, after the ``first`` ones (``start_points``): the
        advice at the fewest workers listed and at the most, each with the threads its
        workers leave by their count (``threads_left``), those not among the first starts
        already; none unless both knobs are searched on a CPU. The guided sampler gives
        them the threads the workers leave by the cores they were measured to use, once a
        trial with workers has been measured."""
        threads, workers = self.domain.get("torch_threads"), self.domain.get("num_workers")
        if not (ctx.device == "cpu" and threads and workers and len(threads) > 1 and len(workers) > 1
                and None not in threads):
            return []
        first = self._first_starts(ctx) if first is None else first
        splits: list[dict] = []
        for n in (min(workers), max(workers)):
            split = self.derive({**first[1], "num_workers": n,
                                 "torch_threads": threads_left(threads, n, ctx.cpu_count)})
            if split not in first and split not in splits:
                splits.append(split)
        return splits

    def default_point(self, ctx: knobs.Context) -> dict:
        """PyTorch's defaults projected onto the space: where the search's first trial goes,
        so that the optimized loop at default settings is always among the candidates.
        A knob whose default is not in the space takes the value nearest to what PyTorch
        does (threads: the CPU count), else its first value."""
        base = {**knobs.defaults(), **self.baseline_config()}
        config = {}
        for k, values in self.domain.items():
            want = base[k]
            if want in values:
                config[k] = want
            elif k == "torch_threads":
                config[k] = min(values, key=lambda v: abs(v - ctx.cpu_count))
            else:
                config[k] = values[0]
        return self.derive(config)

    def baseline_config(self) -> dict:
        """PyTorch's defaults, with the space's micro-batch and world size (first values)
        unless set: at world_size N > 1 the baseline is a plain DDP loop with PyTorch's
        defaults."""
        config = {"micro_batch_size": self.domain.get("micro_batch_size", [32])[0]}
        if self.domain.get("world_size", [1])[0] > 1:
            config["world_size"] = self.domain["world_size"][0]
        eff = self.model.constraints.effective_batch_size
        if eff is not None:
            config = {"micro_batch_size": eff, "grad_accum_steps": 1}
        config.update(self.model.baseline)
        return config


def beyond_cores(domain: dict[str, list], cores: int) -> list[str]:
    """Intra-op threads or DataLoader workers in ``domain`` (knob -> values) more than the
    ``cores`` a trial has, one phrase per knob: a space written for a larger machine, or a
    trial node smaller than this one. Such configs are measured as written; they
    oversubscribe the cores, which whoever reads their figures should know."""
    out = []
    for name, what in (("torch_threads", "intra-op threads"), ("num_workers", "DataLoader workers")):
        over = [v for v in domain.get(name, []) if v is not None and v > cores]
        if over:
            out.append(f"knobs.{name}: {', '.join(map(str, over))} {what} (more than the {cores} "
                       f"core{'s' if cores != 1 else ''} a trial has)")
    return out


def beyond_share(domain: dict[str, list], cores: int, trials: int) -> list[str]:
    """DataLoader workers in ``domain`` that take a GPU trial past its share of a node's
    ``cores`` when the node runs ``trials`` trials at once (one per GPU): a trial reserves
    itself and its workers, so with these fewer trials run at once, and a data-parallel run
    with a rank per GPU would not have the cores they were measured with."""
    share = cores // max(1, trials)
    over = [w for w in domain.get("num_workers", []) if trials > 1 and w is not None and 1 + w > share]
    if not over:
        return []
    return [f"knobs.num_workers: {', '.join(map(str, over))} DataLoader workers need more than a trial's share of "
            f"the node's cores ({cores} over {trials} trials at once: {share} each, one for the step)"]


def threads_left(threads: list, workers: int, cores: int) -> int:
    """The most intra-op threads listed that fit beside ``workers`` DataLoader workers on
    ``cores`` (one thread always fits: a worker tolerates sharing its core, a thread
    waiting at an op's barrier does not); the fewest listed where none fits."""
    listed = [t for t in threads if t is not None]
    fits = [t for t in listed if t == 1 or t + workers <= cores]
    return max(fits) if fits else min(listed)


# ---- loading with line numbers -----------------------------------------------------------


def _node_lines(node: yaml.Node, path: tuple = (), out: dict | None = None) -> dict[tuple, int]:
    """Map each key path of a YAML document to its 1-based line."""
    out = {} if out is None else out
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            sub = path + (key.value,)
            out[sub] = key.start_mark.line + 1
            _node_lines(value, sub, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _node_lines(item, path + (i,), out)
    return out


class _Where:
    def __init__(self, source: str, lines: dict[tuple, int]):
        self.source, self.lines = source, lines

    def __call__(self, path: tuple) -> str:
        p = tuple(path)
        while p and p not in self.lines:
            p = p[:-1]
        line = self.lines.get(p)
        return f"{self.source}:{line}" if line else self.source


def _fail(where: _Where, path: tuple, msg: str) -> UserError:
    dotted = ".".join(str(p) for p in path)
    return UserError(f"{where(path)}: {dotted + ': ' if dotted else ''}{msg}")


def _expand_knob(name: str, raw: Any, where: _Where) -> list:
    path = ("knobs", name)
    if name not in knobs.KNOBS:
        raise _fail(where, path, knobs.unknown_knob(name))
    if isinstance(raw, dict):
        allowed = {"min", "max", "step", "log"}
        if set(raw) - allowed or not {"min", "max"} <= set(raw):
            raise _fail(where, path, "a range is {min: A, max: B} with optional step or log: true")
        if knobs.KNOBS[name].type is not int:
            raise _fail(where, path, "a range needs an integer knob")
        for end in ("min", "max"):
            try:
                knobs.check_value(name, raw[end])
            except UserError as exc:
                raise _fail(where, path + (end,), str(exc)) from None
        lo, hi = knobs.check_value(name, raw["min"]), knobs.check_value(name, raw["max"])
        if lo > hi:
            raise _fail(where, path, f"min {lo} is above max {hi}")
        if raw.get("log"):
            values, v = [], lo
            while v <= hi:
                values.append(v)
                v = v * 2 if v > 0 else 1
            if values[-1] != hi:
                values.append(hi)
        else:
            step = raw.get("step", 1)
            if not isinstance(step, int) or isinstance(step, bool) or step < 1:
                raise _fail(where, path, "step must be an integer >= 1")
            values = list(range(lo, hi + 1, step))
        return values
    values = raw if isinstance(raw, list) else [raw]
    if not values:
        raise _fail(where, path, "empty list of values")
    out = []
    for i, v in enumerate(values):
        try:
            cv = knobs.check_value(name, v)
        except UserError as exc:
            raise _fail(where, path + ((i,) if isinstance(raw, list) else ()), str(exc)) from None
        if cv not in out:
            out.append(cv)
    return out


def parse(data: Any, source: str = "<space>", lines: dict | None = None, path: Path | None = None) -> Space:
    """Validate a space given as a dict; raises UserError naming the field."""
    where = _Where(source, lines or {})
    if not isinstance(data, dict):
        raise UserError(f"{source}: a space file is a mapping with at least 'name' and 'workload'")
    try:
        model = SpaceModel.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            parent = SpaceModel
            for p in loc[:-1]:
                ann = parent.model_fields.get(p) if isinstance(p, str) else None
                parent = ann.annotation if ann is not None and isinstance(ann.annotation, type) else parent
            msg = (f"unknown field '{loc[-1]}'{did_you_mean(str(loc[-1]), parent.model_fields)} "
                   f"(allowed: {', '.join(parent.model_fields)})")
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif "input" in err and err["type"] not in ("missing",):
            msg = f"{msg} (got {err['input']!r})"
        raise _fail(where, loc, msg) from None

    domain = {name: _expand_knob(name, raw, where) for name, raw in model.knobs.items()}
    for name, value in model.baseline.items():
        try:
            knobs.check_value(name, value)
        except UserError as exc:
            raise _fail(where, ("baseline", name), str(exc)) from None

    eff = model.constraints.effective_batch_size
    if eff is not None:
        if "grad_accum_steps" in domain:
            raise _fail(where, ("knobs", "grad_accum_steps"),
                        "grad_accum_steps is derived from constraints.effective_batch_size; remove one")
        micro = domain.get("micro_batch_size", [eff])
        fitting = [m for m in micro if eff % m == 0]
        if not fitting:
            raise _fail(where, ("constraints", "effective_batch_size"),
                        f"{eff} is not a multiple of any micro_batch_size {micro}")
        domain["micro_batch_size"] = fitting
    if model.sampler is None:
        model.sampler = "nsga2" if model.objective.memory else "guided"
    elif model.objective.memory and model.sampler == "guided":
        raise _fail(where, ("sampler",), "the guided sampler has one objective; with "
                    "objective.memory use nsga2, tpe, random or grid")
    if model.measure.max_windows < model.measure.min_windows:
        raise _fail(where, ("measure", "max_windows"), "must be >= min_windows")
    return Space(model=model, path=path, domain=domain, where=where)


def load(path: str | Path) -> Space:
    """Read and validate a space file (workload reference not yet imported)."""
    p = Path(path)
    if p.is_dir():
        hint = f" (a results folder: `tuner show {p}`)" if (p / "trials.jsonl").is_file() else ""
        raise UserError(f"space file {p}: a folder, not a space file{hint}")
    if not p.is_file():
        # `init` takes a workload (file.py:make); `run` and `bench` take the space it writes
        ref = ":" in p.name and p.name.split(":")[0].endswith(".py")
        hint = f" (a workload: `python -m tuner init {p}` writes a space file for it)" if ref else ""
        raise UserError(f"space file {p} not found{hint}")
    text = p.read_text()
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{p}{line}: not valid YAML: {problem}") from None
    if node is not None:
        _refuse_duplicate_keys(node, str(p))
    lines = _node_lines(node) if node is not None else {}
    return parse(data, str(p), lines, path=p.resolve())


def _refuse_duplicate_keys(node: yaml.Node, source: str, path: tuple = ()) -> None:
    """A key written twice in one mapping is an error naming both lines (YAML would
    silently keep the last)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key, value in node.value:
            line = key.start_mark.line + 1
            dotted = ".".join(str(p) for p in path + (key.value,))
            if key.value in seen:
                raise UserError(f"{source}:{line}: {dotted}: written twice (lines {seen[key.value]} and {line})")
            seen[key.value] = line
            _refuse_duplicate_keys(value, source, path + (key.value,))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, source, path + (i,))


def check_name(name: str) -> str:
    """A results folder name: plain (no path separators, not . or ..)."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name or "") or name in (".", ".."):
        raise UserError(f"name {name!r}: use letters, digits, '.', '_' and '-' only (it names "
                        f"results/<name>/, inside the results folder)")
    return name


def check_workload(space: Space) -> None:
    """Import the workload function and check its arguments (before anything starts)."""
    from tuner.workloads import check_args, resolve_factory

    where = space.where or _Where(str(space.path or "<space>"), {})
    from tuner.errors import WorkloadError
    from tuner.workloads import load_workload

    try:
        func = resolve_factory(space.model.workload, space.base_dir)
        check_args(space.model.workload, func, space.model.workload_args)
        # The factory itself (it returns a Workload of callables: building the model and
        # the dataset stays a trial's job, where failing is a result).
        load_workload(space.model.workload, space.model.workload_args, space.base_dir)
    except (UserError, WorkloadError) as exc:
        field = ("workload_args",) if str(exc).startswith("workload_args") else ("workload",)
        raise UserError(f"{where(field)}: {exc}") from None


# ---- configs as the search sees them ------------------------------------------------------


def canonical(config: dict, ctx: knobs.Context) -> str:
    """A key of what a config really runs: inactive knobs held at their default."""
    full, _ = knobs.resolve(config, ctx, strict=False)
    return json.dumps(full, sort_keys=True)



class SearchSpace:
    """Optuna's define-by-run space: conditional knobs asked only where they apply.

    A class rather than a closure: Ray pickles the searcher into its experiment folder.
    """

    def __init__(self, space: Space, ctx: knobs.Context):
        self.searched, self.fixed, self.ctx = space.searched, space.fixed, ctx
        # knobs that others depend on (num_workers) are asked first
        self.order = sorted(self.searched, key=lambda k: (knobs.KNOBS[k].inactive is not None, k))

    def _applies(self, name: str, chosen: dict) -> bool:
        inactive = knobs.KNOBS[name].inactive
        return inactive is None or not inactive({**knobs.defaults(), **chosen}, self.ctx)

    def __call__(self, trial: Any) -> None:
        chosen: dict[str, Any] = dict(self.fixed)
        for name in self.order:
            if self._applies(name, chosen):
                chosen[name] = trial.suggest_categorical(name, self.searched[name])

    def active(self, config: dict) -> dict:
        """The searched params that apply to ``config`` (what Optuna would be asked)."""
        chosen: dict[str, Any] = dict(self.fixed)
        out = {}
        for name in self.order:
            if self._applies(name, {**chosen, **config}):
                out[name] = chosen[name] = config[name]
        return out


class Canonical:
    """Picklable ``config -> key`` for the guided sampler (fixed knobs and derivations applied)."""

    def __init__(self, space: Space, ctx: knobs.Context):
        self.space, self.ctx = space, ctx

    def __call__(self, config: dict) -> str:
        return canonical(self.space.derive({**self.space.fixed, **config}), self.ctx)
