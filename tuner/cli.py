"""``python -m tuner ...``: the command line.

Heavy imports (torch, ray, optuna) happen inside the commands, so ``--help``
is instant. Bad input is one line on stderr and exit status 2 (``--debug``
shows the traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn
from wsgiref.simple_server import WSGIRequestHandler, make_server

from tuner.errors import ClusterFault, NoWinner, Stopped, UserError, WorkloadError


def _parse_sets(items: list[str]) -> dict[str, Any]:
    import yaml

    from tuner import knobs

    out = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected knob=value")
        name, raw = item.split("=", 1)
        name = name.strip()
        value = yaml.safe_load(raw) if raw.strip() else raw
        out[name] = knobs.check_value(name, value)
    return out


def _bench_request(space: Any, args: argparse.Namespace, extra: dict | None = None) -> Any:
    """The measurement request of ``bench``/``profile`` (``trial.bench_request``): an
    exported config, then --set overrides."""
    from tuner.trial import bench_request

    overrides: dict[str, Any] = dict(extra or {})
    if getattr(args, "config", None):
        overrides.update(load_exported_config(args.config))
    overrides.update(_parse_sets(args.set))
    return bench_request(space, overrides, baseline=args.baseline)


def cmd_bench(args: argparse.Namespace) -> int:
    from tuner import spec
    from tuner.trial import run_isolated

    space = spec.load(args.space)
    spec.check_workload(space)
    request = _bench_request(space, args)
    _check_cache(space, request.config)
    from tuner.hardware import usable_cores

    for over in spec.beyond_cores({k: [v] for k, v in request.config.items()}, usable_cores()):
        print(f"note: {over}: this config oversubscribes the cores", file=sys.stderr)
    progress = None if args.json or not sys.stderr.isatty() else _progress_line
    timeout_s = args.timeout or space.model.budget.trial_timeout_s
    if request.config.get("world_size", 1) > 1:
        # several data-parallel ranks run through Ray Train, on a local Ray
        import ray

        from tuner.distributed import run_ranks
        from tuner.localray import start_local_ray

        start_local_ray(configure_logging=False, log_to_driver=False)
        try:
            result = run_ranks(request, timeout_s=timeout_s, spread=space.model.resources.spread_ranks)
        finally:
            ray.shutdown()
    else:
        result = run_isolated(request, timeout_s=timeout_s, progress=progress)
    if progress:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    elif result.get("error_kind") in ("timeout", "died"):
        # its processes, which share this stderr, were ended or died mid-line (a worker's
        # traceback half written): what this command prints starts on a line of its own
        print(file=sys.stderr, flush=True)
    result["workload"] = {"ref": space.model.workload, "args": space.model.workload_args}
    result.setdefault("hardware", _hardware())
    if result.get("error_kind") in ("workload", "invalid"):
        if args.debug and result.get("traceback"):
            print(result["traceback"], file=sys.stderr)
        print(f"error: {result['reason']}", file=sys.stderr)
        return 2
    if args.json:
        result.pop("traceback", None)
        if result["status"] == "ok":
            from tuner.diagnose import diagnose

            result["diagnosis"] = diagnose(result).as_dict()
        print(json.dumps(result, default=str))
    else:
        from tuner.tables import print_bench

        print_bench(result)
    if result["status"] != "ok":
        # infeasible (OOM, NaN, a hang, a crash): the reason was printed; status 3
        if not args.json:
            print(f"infeasible: {result.get('reason')}", file=sys.stderr)
        return 3
    return 0


def _progress_line(msg: str) -> None:
    print(f"\r\033[K  {msg}", end="", file=sys.stderr, flush=True)


def _hardware() -> dict:
    from tuner.hardware import describe

    return describe()


def load_exported_config(path: str) -> dict:
    """The knob config of an exported YAML/JSON file (``tuner export``), or a plain mapping."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path}: file not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"--config {path}: not valid YAML/JSON: {str(exc).splitlines()[0]}") from None
    if isinstance(data, dict) and isinstance(data.get("config"), dict):
        data = data["config"]
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of knob: value (or a 'config:' section)")
    from tuner import knobs

    return {k: knobs.check_value(k, v) for k, v in data.items()}


def cmd_profile(args: argparse.Namespace) -> int:
    from tuner import spec
    from tuner.profile import print_profile, profile_config

    target = Path(args.target)
    extra: dict[str, Any] = {}
    if target.is_dir():  # a trial of a results folder
        from tuner.results import open_results

        res = open_results(target)
        space = spec.load(res.path / "space.yaml")
        if res.meta.get("base_dir"):
            space.base = Path(res.meta["base_dir"])
        if args.trial is None:
            row = res.best()
            if row is None:
                raise UserError(f"{target}: no feasible trial to profile; pick one with --trial N")
            extra = dict(row["config"])
        else:
            rec = next((r for r in res.records if r.get("trial_number") == args.trial), None)
            if rec is None:
                raise UserError(f"--trial {args.trial}: no such trial in {target}")
            extra = dict(rec["config"])
        out = Path(args.out or target / "profile")
    else:
        space = spec.load(target)
        out = Path(args.out or Path("results") / space.model.name / "profile")
    spec.check_workload(space)
    request = _bench_request(space, args, extra)
    _check_cache(space, request.config)
    from tuner.profile import Infeasible
    from tuner.trial import classify

    try:
        summary = profile_config(request, out, steps=args.steps, hot_path=not args.no_hot_path)
    except (UserError, WorkloadError):
        raise
    except Infeasible as exc:
        print(f"infeasible: {exc}", file=sys.stderr)
        return 3
    except Exception as exc:  # an OOM, a compile failure, the user's dataset raising
        kind, reason = classify(exc)
        if kind == "error" and not _from_user_code(exc):
            raise
        print(f"infeasible: {reason}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(summary, default=str))
    else:
        print_profile(summary, sys.stdout)
    return 0


def _check_cache(space: Any, config: dict | None = None) -> None:
    """``dataset_cache`` where a cache would be wrong (items that differ between reads, an
    iterable dataset): an error where a config or the space holds it on, a note and the
    knob held off where a search would try it."""
    on = bool(config.get("dataset_cache")) if config is not None else True in space.domain.get("dataset_cache", [])
    if not on:
        return
    from tuner.data import refusal

    why = refusal(space)
    if why is None:
        return
    if config is not None or space.domain["dataset_cache"] == [True]:
        raise UserError(why)
    space.domain["dataset_cache"] = [False]
    space.model.knobs["dataset_cache"] = False
    print(f"note: {why}; the search holds dataset_cache off", file=sys.stderr)


def _check_workers(space: Any, address: str | None) -> None:
    """What DataLoader workers and NCCL's ranks need of this machine, before Ray starts. A
    local search's trials inherit this process's environment; a cluster's nodes have their
    own, and their trials refuse or fail by themselves (``doctor --address`` checks them).

    - workers that cannot run here (``tuner.data.workers_refused``: a TMPDIR too long for
      multiprocessing's sockets): an error where the space runs workers, rather than a
      search whose every config with workers is refused;
    - a /dev/shm too small for what the space runs there (``hardware.shm_short``: a
      container's default): a warning, since small batches may fit."""
    if address:
        return
    import torch

    from tuner.hardware import shm_short

    workers = max(space.domain.get("num_workers", [0])) >= 1
    nccl = max(space.domain.get("world_size", [1])) > 1 and space.model.device != "cpu" and torch.cuda.is_available()
    if why := shm_short(["workers"] * workers + ["nccl"] * nccl):
        print(f"warning: {why}", file=sys.stderr)
    if not workers:
        return
    from tuner.data import workers_refused

    why = workers_refused()
    if why is not None:
        raise UserError(f"num_workers: {why}")


def _from_user_code(exc: BaseException) -> bool:
    """Whether an exception was raised outside tuner's own code (the user's workload,
    torch): the deepest frame of its traceback is not in the tuner package."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and f"{Path(__file__).parent}" not in frames[-1].filename


def knobs_markdown() -> str:
    """The knob table as markdown (docs/knobs.md embeds it; a test keeps the two equal)."""
    from tuner.knobs import KNOBS, applies

    lines = ["| knob | values | default (baseline) | applies | what it does | cost |", "|---|---|---|---|---|---|"]
    for k in KNOBS.values():
        values = " / ".join(k.choices) if k.choices else (
            "true / false" if k.type is bool else f"int >= {k.minimum}" + (" or null" if k.nullable else ""))
        default = "null" if k.default is None else str(k.default).lower() if k.type is bool else str(k.default)
        lines.append(f"| `{k.name}` | {values} | {default} | {applies(k)} | {k.doc} | {k.cost or '-'} |")
    return "\n".join(lines) + "\n"


def cmd_knobs(args: argparse.Namespace) -> int:
    from tuner.knobs import KNOBS

    if args.markdown:
        sys.stdout.write(knobs_markdown())
        return 0
    for k in KNOBS.values():
        domain = "|".join(k.choices) if k.choices else (k.type.__name__ + (f" >= {k.minimum}" if k.minimum is not None else ""))
        flags = " [GPU only]" if k.gpu_only else ""
        print(f"{k.name:<26} {domain:<40} default {k.default!s:<6}{flags}  {k.doc}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from tuner import spec
    from tuner.localray import check_address
    from tuner.search import run_search
    from tuner.tables import print_summary

    space = spec.load(args.space)
    check_address(args.address)
    if args.resume:
        name = args.name or space.model.name
        args.results = str(Path(args.results_dir) / name)
        return cmd_resume(args)
    if args.trials is not None:
        space.model.budget.trials = args.trials
    if args.time_budget is not None:
        space.model.budget.time_s = args.time_budget
    if args.name:
        space.model.name = args.name
    else:  # the space's own name, taken by an earlier search: this one goes beside it
        space.model.name = _free_name(Path(args.results_dir), space.model.name)
    if args.log_to:
        space.model.log_to = sorted(set(space.model.log_to) | set(args.log_to))
    if args.no_hot_path:
        space.model.hot_path = False
    spec.check_workload(space)
    _check_cache(space)
    _check_workers(space, args.address)
    summary = run_search(space, results_root=Path(args.results_dir), address=args.address,
                         resume=args.resume, quiet=args.quiet)
    print_summary(summary)
    out = Path(args.results_dir) / space.model.name
    print(f"results: {out}/ (summary.json, trials.jsonl, optuna.journal, ray/)")
    _next_steps(summary, out)
    return _winner_status(summary)


def _free_name(root: Path, name: str) -> str:
    """``name``, or ``name-2``, ``name-3``... where results of that name already exist, so that
    the same command run again searches again (``--name`` picks the folder itself, and
    ``--resume`` continues one)."""
    def taken(n: str) -> bool:
        trials = root / n / "trials.jsonl"
        return trials.is_file() and trials.stat().st_size > 0  # empty: nothing ran

    if not taken(name):
        return name
    k = 2
    while taken(f"{name}-{k}"):
        k += 1
    print(f"{root / name}/ holds an earlier search (continue it with `python -m tuner resume {root / name}`); "
          f"this one writes {root / f'{name}-{k}'}/")
    return f"{name}-{k}"


def _next_steps(summary: dict, out: Path) -> None:
    """What to do with a finished search: export its pick, look closer."""
    if summary.get("best"):
        print(f"next: python -m tuner export {out} -o best.yaml   (or --format python|hf|lightning; "
              f"show, report)")


def cmd_show(args: argparse.Namespace) -> int:
    from tuner.results import open_results
    from tuner.tables import print_show

    print_show(open_results(args.results), limit=args.limit)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tuner.results import export_payload, open_results, pick, render

    res = open_results(args.results)
    how, mb = args.pick[0], None
    if how == "fastest-under-memory":
        if len(args.pick) != 2:
            raise UserError("--pick fastest-under-memory takes a memory limit in MB, e.g. "
                            "--pick fastest-under-memory 8000")
        try:
            mb = float(args.pick[1])
        except ValueError:
            raise UserError(f"--pick fastest-under-memory {args.pick[1]!r}: not a number of MB") from None
        import math

        if not math.isfinite(mb) or mb <= 0:
            raise UserError(f"--pick fastest-under-memory {args.pick[1]}: must be a number of MB > 0")
    elif len(args.pick) != 1:
        raise UserError(f"--pick {how} takes no value")
    payloads = [export_payload(res, row) for row in pick(res, how, mb, args.device_model)]
    text = render(payloads, args.format)
    for p in payloads:
        if p["memory_headroom"].get("fraction_free") is not None and p["memory_headroom"]["fraction_free"] < 0.10:
            print(f"warning: {p['memory_headroom']['note']}", file=sys.stderr)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from tuner.report import write_report
    from tuner.results import open_results

    res = open_results(args.results)
    md = write_report(res)
    print(f"wrote {md} and its plots")
    if res.no_winner():
        print(f"no winner: {res.no_winner()}", file=sys.stderr)
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    from tuner import spec
    from tuner.records import configs_tried
    from tuner.results import open_results
    from tuner.search import run_search
    from tuner.tables import print_summary

    res = open_results(args.results)
    space = spec.load(res.path / "space.yaml")
    if res.meta.get("base_dir"):
        space.base = Path(res.meta["base_dir"])
    if args.trials:
        space.model.budget.trials = args.trials
    if args.no_hot_path:  # not written back: the folder's space.yaml stays as the search began
        space.model.hot_path = False
    spec.check_workload(space)
    _check_workers(space, args.address)
    done = len(configs_tried(res.records))
    print(f"resuming {space.model.name}: {done}/{space.model.search_trials()} trials done", file=sys.stderr)
    summary = run_search(space, results_root=res.path.resolve().parent, address=args.address,
                         resume=True, quiet=args.quiet)
    print_summary(summary)
    _next_steps(summary, res.path)
    return _winner_status(summary)


def _winner_status(summary: dict) -> int:
    """0, or 4 with the reason on stderr when the search ended with no config to pick."""
    if summary.get("no_winner"):
        print(f"no winner: {summary['no_winner']}", file=sys.stderr)
        return 4
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    import yaml

    from tuner.scaffold import init_space

    out = Path(args.output)
    if out.exists() and not args.force:
        raise UserError(f"-o {out}: exists; pass --force to overwrite it")
    try:
        workload_args = yaml.safe_load(args.workload_args) if args.workload_args else {}
    except yaml.YAMLError as e:
        raise UserError(f"--workload-args: not YAML/JSON: {e}") from e
    if not isinstance(workload_args, dict):
        raise UserError(f"--workload-args {args.workload_args}: must be a mapping, e.g. '{{size: 1024}}'")
    text = init_space(args.workload, workload_args, out, device=args.device, max_memory_mb=args.max_memory_mb,
                      max_step_s=args.max_step_s, upper=args.upper, trials=args.trials or 12, name=args.name,
                      say=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(text, end="")
    print(f"wrote {out}; search it with: python -m tuner run {out}", file=sys.stderr)
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    """optuna-dashboard on the search's own study (its journal), on loopback."""
    import optuna

    from tuner.results import open_results

    res = open_results(args.results)
    journal = res.path / "optuna.journal"
    if not journal.exists():
        raise UserError(f"{res.path}: no optuna.journal (no search trial has run there yet)")
    try:
        import optuna_dashboard
    except ImportError as e:
        raise UserError("dashboard needs optuna-dashboard: pip install optuna-dashboard (or the [dashboard] extra)") from e
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    server = make_server(args.host, args.port, optuna_dashboard.wsgi(storage), handler_class=_QuietHandler)
    print(f"optuna-dashboard for {res.path.name}: http://{args.host}:{args.port}/dashboard/  (Ctrl-C stops it)",
          flush=True)
    # Ctrl-C or SIGTERM ends the serving loop between requests. The command's usual stop
    # raises from the signal handler, which can land inside a finaliser or a library's
    # ``except`` and be swallowed, leaving the server up; asking the loop to stop cannot.
    stopping = threading.Event()

    def stop(signum: int, frame: Any) -> None:
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, stop)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


class _QuietHandler(WSGIRequestHandler):
    """wsgiref's handler without a log line per request on stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def cmd_submit(args: argparse.Namespace) -> int:
    from tuner import spec
    from tuner.cluster import submit

    space = spec.load(args.space)
    if args.name:
        space.model.name = args.name
    if args.trials:
        space.model.budget.trials = args.trials
    spec.check_workload(space)
    _check_cache(space)
    return submit(space, args.address, args.results_dir, follow=args.follow, wait=args.wait)


def cmd_doctor(args: argparse.Namespace) -> int:
    from tuner.cluster import doctor

    return doctor(args.address)


class _Parser(argparse.ArgumentParser):
    """argparse with a bad flag in one line naming it, as every other input error is (not
    the whole usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m tuner", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    _search_commands(sub)
    _measure_commands(sub)
    _result_commands(sub)
    return parser


def _search_commands(sub: Any) -> None:
    """The commands of the search and its cluster."""
    p = sub.add_parser("run", help="search a space with Ray Tune + Optuna")
    p.add_argument("space", help="space.yaml")
    p.add_argument("--trials", type=int, help="override budget.trials (configs tried; the baseline and confirm rounds come on top)")
    p.add_argument("--time-budget", type=float, help="override budget.time_s (seconds)")
    p.add_argument("--name", help="the results folder's name (default: the space's name; NAME-2, NAME-3... "
                   "where an earlier search has it)")
    p.add_argument("--results-dir", default="results", help="where results/<name>/ goes")
    p.add_argument("--address", help="attach to a running Ray cluster (HEAD:6379 or auto, from a node of "
                   "it) instead of a local one; from elsewhere, `submit`")
    p.add_argument("--resume", action="store_true", help="continue an interrupted search of this name")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-hot-path", action="store_true",
                   help="skip the hot-path check of the baseline and the pick after the search "
                        "(space: hot_path: false; `profile` runs it later)")
    p.add_argument("--log-to", action="append", choices=["tensorboard", "mlflow"],
                   help="also log each trial with Ray Tune's logger callbacks (repeatable): TensorBoard "
                   "events under results/<name>/ray/, an MLflow SQLite store, results/<name>/mlflow.db")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("resume", help="continue an interrupted search")
    p.add_argument("results", help="results/<name>")
    p.add_argument("--trials", type=int, help="raise the trial budget")
    p.add_argument("--address", help="a running Ray cluster")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-hot-path", action="store_true", help="skip the hot-path check after the search")
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("submit", help="submit the search to a running Ray cluster as a Ray Job")
    p.add_argument("space", help="space.yaml")
    p.add_argument("--address", required=True, help="the cluster's dashboard, e.g. http://HEAD:8265")
    p.add_argument("--results-dir", default="/tmp/tuner-results",
                   help="where results/<name>/ goes on the cluster (a shared filesystem is easiest)")
    p.add_argument("--name", help="override the space's name")
    p.add_argument("--trials", type=int, help="override budget.trials (configs tried; the baseline and confirm rounds come on top)")
    p.add_argument("--follow", action="store_true", help="stream the job's logs")
    p.add_argument("--wait", action="store_true", help="wait for the job to end; exit 0 only if it succeeded")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("show", help="the trials of a results folder (also while the search runs)")
    p.add_argument("results", help="results/<name>")
    p.add_argument("--limit", type=int, help="show only the first N configs")
    p.set_defaults(func=cmd_show)


def _measure_commands(sub: Any) -> None:
    """The commands of measuring one config, and the machine."""
    p = sub.add_parser("bench", help="measure one config of a space: its recommended config for this machine, "
                       "with --set overrides (Ray only for world_size > 1)",
                       description="Measure one config of a space (the space's recommended config for this "
                       "machine, with --set overrides; Ray starts only for world_size > 1): warm-up, timed windows, "
                       "epoch boundaries measured apart. Peak host memory is the trial process's peak "
                       "resident set (VmHWM, torch's shared pages counted as your own process holds "
                       "them) plus the private pages of its DataLoader workers. Windows disturbed by "
                       "other load on the machine are measured again.")
    p.add_argument("space", help="space.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                   help="override a knob (the advice fits around it: threads the workers leave, "
                        "persistent workers off without workers)")
    p.add_argument("--config", help="an exported config (tuner export) to re-measure")
    p.add_argument("--baseline", action="store_true", help="measure the plain PyTorch loop instead")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, help="seconds before the trial counts as hung")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("profile", help="a config under torch.profiler: Chrome trace, summary and the hot-path check")
    p.add_argument("target", help="space.yaml, or a results folder (its best, or --trial N)")
    p.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE", help="override a knob")
    p.add_argument("--trial", type=int, help="with a results folder: the trial number to profile")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps under the profiler")
    p.add_argument("--no-hot-path", action="store_true",
                   help="skip the hot-path check (defects in the workload's own step, by file:line)")
    p.add_argument("--out", help="folder for trace.json and summary.json")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=cmd_profile, baseline=False, config=None)

    p = sub.add_parser("init", help="write a space.yaml fitted to this machine (probes the micro-batch)")
    p.add_argument("workload", help="built-in name, my_workload.py:make or my_pkg.mod:make")
    p.add_argument("--workload-args", help="the factory's arguments, e.g. '{size: 1024}'")
    p.add_argument("-o", "--output", default="space.yaml", help="the file to write (default space.yaml)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-memory-mb", type=float,
                   help="a micro-batch whose peak memory is above this does not fit (default: 90%% of the "
                   "GPU's memory; none on CPUs)")
    p.add_argument("--max-step-s", type=float, default=2.0, help="nor one whose step takes longer (default 2)")
    p.add_argument("--upper", type=int, default=4096, help="the largest micro-batch probed")
    p.add_argument("--trials", type=int, help="budget.trials of the written file (default 12)")
    p.add_argument("--name", help="the space's name (default: the workload's)")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("doctor", help="check torch, CUDA, GPUs, compile, DataLoader workers (TMPDIR, /dev/shm), Ray: OK or what to fix")
    p.add_argument("--address", help="also check a running Ray cluster (HEAD:6379), and each of its nodes where "
                   "trials would run: cores, GPUs, /dev/shm, TMPDIR, torch")
    p.set_defaults(func=cmd_doctor)


def _result_commands(sub: Any) -> None:
    """The commands of reading the results."""
    p = sub.add_parser("export", help="export the best (or Pareto-optimal) config")
    p.add_argument("results", help="results/<name>")
    p.add_argument("--pick", nargs="+", default=["best"], metavar="HOW",
                   help="best | pareto | fastest-under-memory MB")
    p.add_argument("--format", default="yaml", choices=["yaml", "json", "python", "hf", "lightning"],
                   help="yaml/json: the config and its figures; python: a script that trains your "
                   "workload with it; hf: TrainingArguments kwargs; lightning: Trainer + DataLoader kwargs")
    p.add_argument("--device-model", help="on a mixed cluster: the GPU model to export for (default: each)")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("report", help="write report.md with plots into the results folder")
    p.add_argument("results", help="results/<name>")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("dashboard", help="the study in optuna-dashboard (on loopback)")
    p.add_argument("results", help="results/<name>")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--host", default="127.0.0.1", help="127.0.0.1: this machine only")
    p.set_defaults(func=cmd_dashboard)

    p = sub.add_parser("knobs", help="list the knobs, their values and defaults")
    p.add_argument("--markdown", action="store_true", help="as markdown (the table of docs/knobs.md)")
    p.set_defaults(func=cmd_knobs)


def check_flags(args: argparse.Namespace) -> None:
    """Every subcommand's flags, checked in one place before anything runs: counts are
    >= 1, times > 0, numbers finite, names plain, -o needs an existing folder."""
    import math

    from tuner import spec

    for name in ("trials", "steps", "limit", "trial"):
        v = getattr(args, name, None)
        if v is not None and name != "trial" and v < 1:
            raise UserError(f"--{name} {v}: must be >= 1")
        if v is not None and name == "trial" and v < 0:
            raise UserError(f"--trial {v}: trial numbers start at 0")
    for name in ("time_budget", "timeout"):
        v = getattr(args, name, None)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise UserError(f"--{name.replace('_', '-')} {v}: must be a number of seconds > 0")
    if getattr(args, "name", None) is not None:
        spec.check_name(args.name)
    out = getattr(args, "output", None)
    if out is not None and not Path(out).resolve().parent.is_dir():
        raise UserError(f"-o {out}: folder {Path(out).resolve().parent} does not exist")
    if out is not None and Path(out).is_dir():
        raise UserError(f"-o {out}: a folder; give a file name")


def _stop_on_signals() -> Callable[[], None]:
    """SIGTERM (a scheduler, ``kill``, a CI timeout) stops the command as Ctrl-C does, so
    that cleanup runs: trials ended, the results folder's lock released. Ray Tune's own
    Ctrl-C handler is turned off: it would end the Tune loop quietly and let the search
    go on to its confirm rounds."""
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"

    def stop(signum: int, frame: Any) -> None:
        Stopped.received = signum
        # The stop unwinds through whatever the main thread was doing; an import it cuts
        # short warns as it fails (Cython's modules do), and that is the stop's echo, not
        # news: the command ends on its one line saying what is kept.
        warnings.simplefilter("ignore")
        raise Stopped(signum)

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    Stopped.received = None  # a stop of an earlier command in this process is no stop of this one
    before = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    hook_before = sys.unraisablehook

    def redeliver(unraisable: Any) -> None:
        # The handler runs wherever the main thread is, and where an exception cannot
        # propagate (a finaliser, logging's lock release after a fork) Python prints it
        # and goes on: the stop would be lost and the search run to its end. The signal is
        # sent again a moment later, from another thread (sent here, its handler would run
        # inside this hook, which swallows too), to land where it can unwind.
        if isinstance(unraisable.exc_value, Stopped):
            again = threading.Timer(0.05, os.kill, (os.getpid(), unraisable.exc_value.signum))
            again.daemon = True
            again.start()
            return
        hook_before(unraisable)

    sys.unraisablehook = redeliver

    def restore() -> None:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        sys.unraisablehook = hook_before

    return restore


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere on the line
    args = parser.parse_args([a for a in argv if a != "--debug"])
    args.debug = debug
    restore = _stop_on_signals()
    try:
        check_flags(args)
        return args.func(args)
    except Stopped as exc:
        name = signal.Signals(exc.signum).name
        where = f"; what was measured is kept in {exc.folder}; continue with: python -m tuner resume " \
                f"{exc.folder}" if exc.folder else ""
        print(f"stopped ({name}){where}", file=sys.stderr)
        return 128 + exc.signum
    except (UserError, WorkloadError) as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except NoWinner as exc:
        print(f"no winner: {exc}", file=sys.stderr)
        return 4
    except ClusterFault as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 5
    except KeyboardInterrupt as exc:
        signum = Stopped.signal_of(exc)
        print(f"stopped ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # `tuner show ... | head`
        return 0
    except Exception as exc:  # a bug in tuner itself
        if args.debug:
            raise
        import tempfile
        import traceback

        fd, path = tempfile.mkstemp(prefix="tuner-traceback-", suffix=".txt")
        with open(fd, "w") as f:
            f.write(traceback.format_exc())
        print(f"error: internal error in tuner ({type(exc).__name__}: {exc}); please report it, "
              f"with the traceback in {path}", file=sys.stderr)
        return 1
    finally:
        restore()
