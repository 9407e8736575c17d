"""Do the exports run as fast as the tuner said, in the frameworks users paste them into?

For each workload, a search's pick (``tuner.search.run_search`` on a small space) and the
default config (PyTorch's defaults: the tuner's baseline knobs) run five ways, each in a
fresh process, interleaved (the order turns every round), ``--rounds`` rounds, medians:

- ``tuner``: ``python -m tuner bench SPACE --set ... --json``, the tuner's figure;
- ``python``: ``export --format python`` written out and run as a script (``--steps N``);
- ``user``: ``benchmarks/user_loop.py``, a loop written as a user writes one;
- ``hf``: the ``export --format hf`` snippet executed as pasted, then a real
  ``transformers.Trainer(model, args, train_dataset, data_collator)`` over a module that
  returns the workload's loss;
- ``lightning``: the ``export --format lightning`` snippet executed as pasted (it builds
  the Trainer and the DataLoader), then ``trainer.fit`` on a LightningModule around the
  workload;
- ``hf_no_lookahead``, ``hf_no_clip``, ``hf_inputs_cl`` and ``hf_inputs_cl_forward``
  (only when ``--frameworks`` names them): ``hf`` with the Trainer's loader (accelerate's
  ``DataLoaderShard``) iterating its DataLoader as a plain loop does, without reading one
  batch ahead (what that lookahead costs at each epoch start); with ``max_grad_norm=0``
  (what gradient clipping costs each step); with the 4-D inputs made channels_last as
  well as the model (the export converts the model only), in the data collator or in the
  training process (the forward of the module around the model).

Each process starts as the export tells the user to start it: with glibc's variables set
where the config has ``malloc_retain`` (the exported script sets them itself).

The frameworks' rates are read from a callback's clock at the end of every optimizer
step: ``--warmup`` steps, then the rate over the next ``--epochs`` epochs of steps
(epoch boundaries included, as the tuner's figure includes them). Each framework's
rate is reported against the tuner's figure for the same config, and its realized
speed-up (pick over default) against the speed-up the tuner promised.

    python benchmarks/framework_speed.py [--workloads conv,transformer,hf_gpt2] [--rounds 3]

Writes benchmarks/out/framework_speed.json. ``--again`` measures more rounds of the
file's rows (the same pick and default, no search) and scores each row over all its
rounds; each such run's date, machine and command go in the row's ``measured_again``.

    python benchmarks/framework_speed.py --workloads conv --rounds 6 --again

``--overhead`` measures instead what each way of running adds per optimizer step, on a
model whose step costs almost nothing (``hf_workloads.py:tiny``, a linear layer, 1
thread, no workers): each one's time per step, and its time beside the user's loop in
the same round (medians over ``--rounds``). A framework's rate on a real model is below
the user's loop by about that time over the step's. Writes
benchmarks/out/framework_overhead.json.

    python benchmarks/framework_speed.py --overhead --rounds 5
"""

from __future__ import annotations

import argparse
import atexit
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

from common import REFS, paired_interval, plain_env, run_bench, space_file

ARGS = {"conv": {"size": 1024}, "transformer": {"size": 512}, "hf_gpt2": {"size": 1024}}
# The pick comes from a search over the knobs that matter on a CPU, as a user's first
# search would run it (the shipped CPU spaces search malloc_retain too: without it, each
# process draws its own heap behaviour, and its rate with it).
KNOBS = {"precision": ["fp32", "bf16"], "micro_batch_size": [16, 32, 64], "num_workers": [0, 1],
         "torch_threads": [1, 2], "fused_optimizer": [False, True], "malloc_retain": [False, True]}
FRAMEWORKS = ("tuner", "python", "user", "hf", "lightning")


# ---- one framework run, in its own process -------------------------------------------------


def _stamps_rate(stamps: list[float], warmup: int, bs: int, per_epoch: int) -> dict:
    """The rate after ``warmup`` steps, and the median time of a step that starts an epoch
    (the first epoch's left out: it holds the warm-up) against that of a step mid-epoch (its
    3rd step on): where an epoch start costs more in one framework than in another."""
    timed = stamps[warmup:]
    took = {g: b - a for g, (a, b) in enumerate(pairwise(stamps), start=2)}  # step g (1-based) took
    starts = [t for g, t in took.items() if g > per_epoch and (g - 1) % per_epoch == 0]
    mid = [t for g, t in took.items() if g > per_epoch and (g - 1) % per_epoch >= 2]
    return {"samples_per_sec": (len(timed) - 1) * bs / (timed[-1] - timed[0]),
            "epoch_start_ms": 1e3 * statistics.median(starts) if starts else None,
            "mid_epoch_ms": 1e3 * statistics.median(mid) if mid else None}


def _without_lookahead() -> None:
    """accelerate's DataLoaderShard reads one batch ahead to know which batch is the last,
    so each epoch's first step waits for two batches; with DataLoader workers the second
    takes one batch's preparation more. Replaced here by a plain iteration (its
    end-of-epoch flag set after the last batch rather than with it: the Trainer counts its
    own accumulation steps and does not read the flag)."""
    import accelerate.data_loader as adl

    def plain_iter(self):
        self.begin()
        self.set_epoch(self.iteration)
        yield from self.base_dataloader
        self.end_of_dataloader = True
        self.iteration += 1
        self.end()

    adl.DataLoaderShard.__iter__ = plain_iter


def _channels_last_mover():
    """Every 4-D tensor of a batch made channels_last, as the exports tell the user to (the
    tuner's own batch mover, on the CPU: Mappings such as a BatchEncoding included)."""
    import torch

    from tuner.batches import Mover

    return Mover(torch.device("cpu"), channels_last=True)


def run_hf(workload: str, args: dict, payload: dict, steps: int, warmup: int, lookahead: bool = True,
           clip: bool = True, inputs_cl: str | None = None) -> dict:
    import torch
    from torch.utils.data import default_collate
    from transformers import Trainer, TrainerCallback

    from tuner.results import framework_snippet
    from tuner.workloads import load_workload

    cfg = payload["config"]
    if cfg.get("torch_threads"):  # the snippet's "not expressible" line, done as it says
        torch.set_num_threads(cfg["torch_threads"])
    wl = load_workload(workload, args)
    scope: dict = {}
    exec(framework_snippet(payload, "hf"), scope)  # noqa: S102 -- the export, as pasted
    args_hf = scope["args"]
    args_hf.max_steps, args_hf.remove_unused_columns, args_hf.report_to = warmup + steps, False, []
    args_hf.disable_tqdm, args_hf.save_strategy = True, "no"
    if not clip:
        args_hf.max_grad_norm = 0.0

    class WithLoss(torch.nn.Module):  # what a user writes around a model and a loss function
        def __init__(self):
            super().__init__()
            self.inner = wl.model()
            if cfg.get("channels_last"):  # the snippet's "not expressible" line, done as it says
                self.inner = self.inner.to(memory_format=torch.channels_last)

        def forward(self, batch):
            if inputs_cl == "forward":  # in the training process, as a plain loop converts them
                batch = to_cl(batch)
            return {"loss": wl.loss(self.inner, batch)}

    base_collate = wl.collate or default_collate
    inputs_cl = inputs_cl if cfg.get("channels_last") else None  # hf_inputs_cl*: beyond what the export says
    to_cl = _channels_last_mover()

    def collate(samples):
        batch = base_collate(samples)
        return to_cl(batch) if inputs_cl == "collate" else batch

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    if not lookahead:
        _without_lookahead()
    torch.manual_seed(0)
    trainer = Trainer(model=WithLoss(), args=args_hf, train_dataset=wl.dataset(),
                      data_collator=lambda samples: {"batch": collate(samples)}, callbacks=[Clock()])
    trainer.train()
    bs = args_hf.per_device_train_batch_size
    return _stamps_rate(stamps, warmup, bs, len(wl.dataset()) // (bs * args_hf.gradient_accumulation_steps))


def run_lightning(workload: str, args: dict, payload: dict, steps: int, warmup: int) -> float:
    import lightning as L
    import torch

    from tuner.results import framework_snippet
    from tuner.workloads import load_workload

    wl = load_workload(workload, args)
    stamps: list[float] = []
    to_cl = _channels_last_mover()

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.inner = wl.model()

        def training_step(self, batch, i):
            if payload["config"].get("channels_last"):  # the export's comment, done as it says
                batch = to_cl(batch)
            return wl.loss(self.inner, batch)

        def configure_optimizers(self):
            return wl.make_optimizer(self.parameters())

    class Clock(L.Callback):
        def on_train_batch_end(self, *a, **k):
            stamps.append(time.perf_counter())

    torch.manual_seed(0)
    snippet = framework_snippet(payload, "lightning").replace(
        "trainer = L.Trainer(**trainer_kwargs)",
        "trainer = L.Trainer(**trainer_kwargs, max_steps=MAX_STEPS, callbacks=[CLOCK])")
    scope = {"model": Module(), "dataset": wl.dataset(), "MAX_STEPS": warmup + steps, "CLOCK": Clock()}
    if wl.collate:  # the user's collate_fn goes beside the exported DataLoader kwargs
        snippet = snippet.replace("DataLoader(dataset, **dataloader_kwargs)",
                                  "DataLoader(dataset, **dataloader_kwargs, collate_fn=COLLATE)")
        scope["COLLATE"] = wl.collate
    exec(snippet, scope)  # noqa: S102 -- the export, as pasted
    scope["trainer"].fit(scope["model"], scope["train_loader"])
    bs = payload["config"]["micro_batch_size"]
    return _stamps_rate(stamps, warmup, bs, len(scope["dataset"]) // bs)


# ---- the harness ---------------------------------------------------------------------------


def in_process(kind: str, workload: str, args: dict, payload: dict, steps: int, warmup: int,
               wrap: tuple[str, ...] = ()) -> dict:
    """One framework run in a fresh process; ``wrap``: a script that starts it (anatomy.py's
    ``--wrap``, which times the parts of each step)."""
    # The frameworks write checkpoints and logs (out/, lightning_logs/) into the working
    # directory: each run gets its own, removed after it.
    with tempfile.TemporaryDirectory(prefix=f"framework-{kind}-") as cwd:
        out = subprocess.run([sys.executable, *wrap, str(Path(__file__).resolve()), "--one", kind, workload,
                              json.dumps(args), json.dumps(payload), str(steps), str(warmup)],
                             capture_output=True, text=True, cwd=cwd, env=plain_env(payload["config"]))
    if out.returncode != 0:
        raise RuntimeError(f"{kind} failed: {out.stderr.strip()[-800:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def payload_for(workload: str, args: dict, config: dict) -> dict:
    from tuner.hardware import describe

    return {"config": config, "workload": {"ref": workload, "args": args}, "base_dir": str(Path.cwd()),
            "hardware": describe(), "measured": {}, "speedup_vs_baseline": None}


def measure(kind: str, workload: str, args: dict, config: dict, space: Path, tmp: Path, steps: int,
            warmup: int, user_args: tuple[str, ...] = ()) -> dict:
    """One run of ``kind``: its samples/sec (``samples_per_sec``), and a framework's step
    times at an epoch start and mid-epoch. ``user_args``: ``user_loop.py``'s own options."""
    from tuner.results import python_script

    ref = REFS.get(workload, workload)
    if kind == "tuner":
        return {"samples_per_sec": run_bench(space, config)["samples_per_sec"]}
    if kind == "user":
        out = subprocess.run([sys.executable, str(Path(__file__).with_name("user_loop.py")), ref, json.dumps(args),
                              json.dumps(config), *user_args], capture_output=True, text=True, check=True,
                             env=plain_env(config))
        return {"samples_per_sec": json.loads(out.stdout.strip().splitlines()[-1])["samples_per_sec"]}
    if kind == "python":
        script = tmp / f"train_{workload}.py"
        script.write_text(python_script(payload_for(ref, args, config)))
        out = subprocess.run([sys.executable, str(script), "--steps", str(steps)], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"exported script failed: {out.stderr.strip()[-500:]}")
        return {"samples_per_sec": float(re.search(r"samples/sec: ([\d.]+)", out.stdout).group(1))}
    return in_process(kind, ref, args, payload_for(ref, args, config), steps, warmup)


def search_pick(workload: str, args: dict, trials: int, results: Path) -> dict:
    from tuner import spec
    from tuner.search import run_search

    space = spec.parse({"name": f"framework-{workload}", "workload": REFS.get(workload, workload),
                        "workload_args": args, "device": "cpu", "knobs": KNOBS, "budget": {"trials": trials}})
    summary = run_search(space, results_root=results, quiet=True)
    return {k: summary["best"]["config"][k] for k in KNOBS}


def scored(runs: dict) -> dict:
    """The medians, the promised speed-up (the tuner's pick / default) and each framework's
    realized speed-up against it: from the medians, and paired by round (each round's
    pick / default of the framework against the same round's of the tuner, their geometric
    mean and 90% interval), which cancels a drift of the machine that lasts a round. A
    framework measured in some rounds only (None in the others: added by ``--again``) is
    scored over its own rounds, against the tuner's of the same rounds."""
    med = {name: {k: statistics.median(x for x in v if x is not None) for k, v in kinds.items()}
           for name, kinds in runs.items()}
    promised = med["pick"]["tuner"] / med["default"]["tuner"]
    frameworks = {}
    for k in runs["pick"]:
        rounds = [i for i in range(len(runs["pick"]["tuner"]))
                  if runs["pick"][k][i] is not None and runs["default"][k][i] is not None]

        def of(name: str, kind: str, rounds: list[int] = rounds) -> float:
            return statistics.median(runs[name][kind][i] for i in rounds)

        promised_k = of("pick", "tuner") / of("default", "tuner")
        realized = of("pick", k) / of("default", k)
        paired, lo, hi = paired_interval([runs["pick"][k][i] / runs["default"][k][i] for i in rounds],
                                         [runs["pick"]["tuner"][i] / runs["default"]["tuner"][i] for i in rounds])
        frameworks[k] = {"rounds": len(rounds), "realized_speedup": realized,
                         "realized_over_promised": realized / promised_k,
                         "realized_over_promised_paired": paired, "paired_interval_90": [lo, hi],
                         "pick_over_tuner": of("pick", k) / of("pick", "tuner"),
                         "default_over_tuner": of("default", k) / of("default", "tuner")}
    return {"median": med, "promised_speedup": promised, "frameworks": frameworks}


def rescore(path: Path) -> None:
    """Score a written file's runs again (``scored``), without measuring anything."""
    data = json.loads(path.read_text())
    for row in data["rows"]:
        row.update(scored(row["runs"]))
    path.write_text(json.dumps(data, indent=2))
    print(f"rescored {path}")


TINY = ("tiny", {"size": 16384},
        {"precision": "fp32", "micro_batch_size": 32, "torch_threads": 1})


def overhead(a: argparse.Namespace) -> None:
    """Each way of running on the tiny workload: ms per optimizer step, and beside the user's
    loop in the same round. The user's loop times 5 windows of 100 steps here (6-step
    windows of sub-millisecond steps would be read off a clock's jitter)."""
    from common import stamp

    ref, args, config = TINY
    kinds = (a.frameworks or ",".join(FRAMEWORKS)).split(",")
    tmp = Path(tempfile.mkdtemp(prefix="framework-overhead-"))
    atexit.register(shutil.rmtree, tmp, True)
    space = space_file(tmp, ref, args, name="overhead")
    steps, bs = args["size"] // config["micro_batch_size"], config["micro_batch_size"]
    ms: dict = {k: [] for k in kinds}
    for r in range(a.rounds):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            rate = measure(kind, ref, args, config, space, tmp, steps, 20,
                           user_args=("--warmup", "20", "--steps", "100"))["samples_per_sec"]
            ms[kind].append(1000 * bs / rate)
        print(f"round {r + 1}: " + " ".join(f"{k} {ms[k][-1]:.3f} ms" for k in kinds), flush=True)
    rows = []
    for k in kinds:
        beside = sorted(x - u for x, u in zip(ms[k], ms["user"], strict=True)) if "user" in ms else []
        rows.append({"kind": k, "ms_per_step": statistics.median(ms[k]),
                     "over_user_ms": statistics.median(beside) if beside else None,
                     "over_user_min_ms": beside[0] if beside else None,
                     "over_user_max_ms": beside[-1] if beside else None})
        print(f"{k:<10} {rows[-1]['ms_per_step']:7.3f} ms/step" + (
            f"  beside the user's loop {rows[-1]['over_user_ms']:+.3f} ms ({beside[0]:+.3f} to {beside[-1]:+.3f})"
            if beside else ""))
    out = {**stamp(), "workload": f"benchmarks/hf_workloads.py:{ref}", "args": args, "config": config, "rounds": a.rounds, "rows": rows,
           "runs_ms": ms}
    path = Path(a.out if a.out != "benchmarks/out/framework_speed.json" else "benchmarks/out/framework_overhead.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(ARGS))
    ap.add_argument("--frameworks", default=None,
                    help=f"default: {','.join(FRAMEWORKS)} (with --again: the row's); also "
                         "hf_no_lookahead, hf_no_clip, hf_inputs_cl, hf_inputs_cl_forward")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trials", type=int, default=8, help="configs the search for the pick tries")
    ap.add_argument("--epochs", type=int, default=2, help="epochs the frameworks' timed steps cover")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/out/framework_speed.json")
    ap.add_argument("--rescore", action="store_true", help="score --out's runs again; measure nothing")
    ap.add_argument("--overhead", action="store_true", help="what each way of running adds per step (tiny model)")
    ap.add_argument("--again", action="store_true",
                    help="more rounds on --out's rows of --workloads: their pick and default again, no search; "
                         "each run's date, machine and command in the row's measured_again")
    a = ap.parse_args()
    if a.rescore:
        rescore(Path(a.out))
        return
    if a.overhead:
        overhead(a)
        return

    import ray
    from common import stamp

    kinds = (a.frameworks or ",".join(FRAMEWORKS)).split(",")
    tmp = Path(tempfile.mkdtemp(prefix="framework-speed-"))
    atexit.register(shutil.rmtree, tmp, True)  # scratch: what it measured is in --out
    kept = json.loads(Path(a.out).read_text()) if a.again else None
    rows = []
    for workload in a.workloads.split(","):
        args = ARGS[workload]
        if kept is not None:  # the same pick and default, more rounds on the runs already there
            row = next(r for r in kept["rows"] if r["workload"] == workload)
            configs, runs = row["configs"], row["runs"]
            done = len(runs["pick"]["tuner"])
            kinds = a.frameworks.split(",") if a.frameworks else list(runs["pick"])
            kinds = kinds if "tuner" in kinds else ["tuner", *kinds]  # every round pairs with the tuner's
            for name in configs:  # a framework new to the row has no earlier rounds; one not run now, none of these
                for k in [*runs[name], *kinds]:
                    runs[name].setdefault(k, [None] * done)
            row.setdefault("measured_again", []).append({**stamp(), "rounds": a.rounds})
            step_ms = row.setdefault("step_ms", {name: {} for name in configs})
            print(f"{workload}: the pick measured before {configs['pick']}, {done} rounds so far", flush=True)
        else:
            pick = search_pick(workload, args, a.trials, tmp / "results")
            ray.shutdown()
            print(f"{workload}: the search's pick {pick}", flush=True)
            configs = {"default": {"precision": "fp32", "micro_batch_size": 32}, "pick": pick}
            runs = {name: {k: [] for k in kinds} for name in configs}
            step_ms = {name: {} for name in configs}  # per framework, per round: [epoch start, mid-epoch]
            done = 0
        space = space_file(tmp, workload, args, name="framework")
        for r in range(done, done + a.rounds):
            order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
            for name, config in configs.items():
                steps = a.epochs * args["size"] // config["micro_batch_size"]
                for kind in order:
                    m = measure(kind, workload, args, config, space, tmp, steps, a.warmup)
                    runs[name][kind].append(m["samples_per_sec"])
                    if "epoch_start_ms" in m:  # a framework's: where its epoch starts cost more
                        at = step_ms[name].setdefault(kind, [None] * r)
                        at += [None] * (r - len(at))
                        at.append([m["epoch_start_ms"], m["mid_epoch_ms"]])
                for k in set(runs[name]) - set(kinds):
                    runs[name][k].append(None)
            print(f"{workload} round {r + 1}: " + "; ".join(
                f"{name} " + " ".join(f"{k} {runs[name][k][-1]:.0f}" for k in kinds) for name in configs), flush=True)
        if kept is not None:
            row.update(scored(runs))
            rows.append(row)
        else:
            rows.append({"workload": workload, "args": args, "configs": configs, "runs": runs, "step_ms": step_ms,
                         **scored(runs)})
    print(f"\n{'workload':<12} {'framework':<10} {'pick/tuner':>10} {'default/tuner':>13} {'realized':>9} "
          f"{'promised':>9} {'ratio':>6} {'paired (90%)':>20}")
    for row in rows:
        for k, f in row["frameworks"].items():
            print(f"{row['workload']:<12} {k:<10} {f['pick_over_tuner']:>10.3f} {f['default_over_tuner']:>13.3f} "
                  f"{f['realized_speedup']:>9.2f} {row['promised_speedup']:>9.2f} {f['realized_over_promised']:>6.3f} "
                  f"{f['realized_over_promised_paired']:>6.3f} ({f['paired_interval_90'][0]:.3f}-"
                  f"{f['paired_interval_90'][1]:.3f})")
    out = kept or {**stamp(), "rounds": a.rounds, "epochs": a.epochs, "warmup": a.warmup, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        kind, workload, args, payload, steps, warmup = sys.argv[2:8]
        run = {"hf": run_hf, "hf_no_lookahead": lambda *x: run_hf(*x, lookahead=False),
               "hf_no_clip": lambda *x: run_hf(*x, clip=False),
               "hf_inputs_cl": lambda *x: run_hf(*x, inputs_cl="collate"),
               "hf_inputs_cl_forward": lambda *x: run_hf(*x, inputs_cl="forward")}.get(kind, run_lightning)
        print(json.dumps(run(workload, json.loads(args), json.loads(payload), int(steps), int(warmup))))
    else:
        main()
