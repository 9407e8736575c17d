"""Where a step's time goes: the user's own loop against the frameworks, on real models.

Each way runs in a fresh process, as ``framework_speed.py`` runs it (``user``:
``user_loop.py``; ``hf``: a real ``transformers.Trainer`` with the exported arguments;
``lightning``: a real ``lightning.Trainer``), started through this file (``--wrap``),
which first times every call of

- the model's forward (the outermost ``nn.Module`` call: a wrapper module's, where the
  framework needs one around the model and its loss),
- ``Tensor.backward``,
- the optimizer's step (torch's global optimizer step hooks),
- ``torch.nn.utils.clip_grad_norm_`` (the Trainer's gradient clipping),

each with the process's minor page faults across it, each net of the others it holds
(Lightning runs the forward and backward inside the optimizer's step, in its closure).
The medians of each part's calls after the first 8 (and the mean of its page faults) go
to a JSON file when the way ends.
The step's time comes from the way's own rate; what the parts leave of it is ``rest``:
the batch's fetch and the framework's own bookkeeping (its scheduler, callbacks, loss
logging). Interleaved (the order turns every round), ``--rounds`` rounds; each way's
medians, and each part's difference from the user's loop paired by round (median).

The configs are truth.py's (``--configs``: by index, the first by default: no workers) at
default settings (the threads PyTorch picks), with glibc's default malloc and with
``malloc_retain`` (each process started with glibc's variables set, as the export says),
so that the part of a gap that is the heap's (page faults) stands apart from the
framework's own work.

    python benchmarks/anatomy.py [--workloads hf_resnet,hf_gpt2] [--ways user,hf,lightning] [--rounds 4]
    python benchmarks/anatomy.py --workloads hf_resnet --configs 1 --malloc retain --again

Writes benchmarks/out/anatomy.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
PARTS = ("forward", "backward", "optimizer", "clip")
SKIP = 8  # calls left out at the start: warm-up


# ---- inside the wrapped process ------------------------------------------------------------


class Parts:
    """Each part's calls: wall time and minor page faults, net of the parts they hold."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[float, int]]] = {p: [] for p in PARTS}
        self.stack: list[list] = []  # [part, start, faults at start, held seconds, held faults]

    def begin(self, part: str) -> None:
        self.stack.append([part, time.perf_counter(), _faults(), 0.0, 0])

    def end(self) -> None:
        part, t0, f0, held_s, held_f = self.stack.pop()
        took, faults = time.perf_counter() - t0, _faults() - f0
        self.calls[part].append((took - held_s, faults - held_f))
        if self.stack:
            self.stack[-1][3] += took
            self.stack[-1][4] += faults

    def summary(self) -> dict:
        out = {}
        for part, calls in self.calls.items():
            kept = calls[SKIP:] or calls
            out[part] = {"calls": len(calls),
                         "ms": 1e3 * statistics.median(c[0] for c in kept) if kept else 0.0,
                         "faults": statistics.median(c[1] for c in kept) if kept else 0,
                         "faults_mean": statistics.fmean(c[1] for c in kept) if kept else 0.0}
        return out


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def install(parts: Parts) -> None:
    """The timers, around torch's own entry points (nothing of the way's code changed)."""
    import torch
    import torch.nn.modules.module as mod
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    depth = [0]
    call = mod.Module._wrapped_call_impl

    def timed_call(self, *a, **k):
        if depth[0]:
            return call(self, *a, **k)
        depth[0] += 1
        parts.begin("forward")
        try:
            return call(self, *a, **k)
        finally:
            parts.end()
            depth[0] -= 1

    mod.Module._wrapped_call_impl = mod.Module.__call__ = timed_call

    def around(owner, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*a, **k):
            parts.begin(part)
            try:
                return inner(*a, **k)
            finally:
                parts.end()

        setattr(owner, name, timed)

    around(torch.Tensor, "backward", "backward")
    around(torch.nn.utils, "clip_grad_norm_", "clip")
    register_optimizer_step_pre_hook(lambda *a: parts.begin("optimizer"))
    register_optimizer_step_post_hook(lambda *a: parts.end())


def wrap(out: str, target: list[str]) -> None:
    parts = Parts()
    install(parts)
    sys.argv = target
    try:
        runpy.run_path(target[0], run_name="__main__")
    finally:
        Path(out).write_text(json.dumps(parts.summary()))


# ---- the harness -----------------------------------------------------------------------------


def run_way(way: str, workload: str, args: dict, config: dict, steps: int, warmup: int) -> dict:
    from common import REFS, plain_env
    from framework_speed import in_process, payload_for

    ref = REFS.get(workload, workload)
    with tempfile.TemporaryDirectory(prefix=f"anatomy-{way}-") as tmp:
        got = Path(tmp) / "parts.json"
        wrap = (str(Path(__file__).resolve()), "--wrap", str(got))
        if way == "user":
            p = subprocess.run([sys.executable, *wrap, str(HERE / "user_loop.py"), ref, json.dumps(args),
                                json.dumps(config)], capture_output=True, text=True, env=plain_env(config))
            if p.returncode != 0:
                raise RuntimeError(f"user failed: {p.stderr.strip()[-800:]}")
            rate = json.loads(p.stdout.strip().splitlines()[-1])["samples_per_sec"]
        else:  # framework_speed's run, started through the wrapper
            rate = in_process(way, ref, args, payload_for(ref, args, config), steps, warmup,
                              wrap=wrap)["samples_per_sec"]
        return {"samples_per_sec": rate, "step_ms": 1e3 * config["micro_batch_size"] / rate,
                "parts": json.loads(got.read_text())}


def scored(runs: dict[str, list[dict]]) -> dict:
    """Per way: medians of the step, each part and the rest; beside the user's loop, each
    round's difference, its median over the rounds."""
    def split(run: dict) -> dict:
        ms = {p: run["parts"][p]["ms"] * run["parts"][p]["calls"] / max(1, run["parts"]["forward"]["calls"])
              for p in PARTS}  # per step: a part called on some steps only counts on those
        ms["rest"] = run["step_ms"] - sum(ms.values())
        ms["step"] = run["step_ms"]
        return ms

    ways = {}
    for way, rs in runs.items():
        per = [split(r) for r in rs]
        row = {"samples_per_sec": statistics.median(r["samples_per_sec"] for r in rs),
               "ms": {k: statistics.median(p[k] for p in per) for k in per[0]},
               "faults": {p: statistics.median(r["parts"][p]["faults"] for r in rs) for p in PARTS}}
        if "user" in runs and way != "user":
            user = [split(r) for r in runs["user"]]
            row["beside_user_ms"] = {k: statistics.median(p[k] - u[k] for p, u in zip(per, user, strict=True))
                                     for k in per[0]}
        ways[way] = row
    return ways


def _key(row: dict) -> tuple:
    return row["workload"], json.dumps(row["config"], sort_keys=True), tuple(row["ways"])


def measure_row(workload: str, args: dict, config: dict, ways: list[str], a: argparse.Namespace) -> dict:
    """One config: every way, interleaved, ``a.rounds`` rounds, scored."""
    steps = a.epochs * args.get("size", 1024) // config["micro_batch_size"]
    runs: dict[str, list[dict]] = {w: [] for w in ways}
    for r in range(a.rounds):
        for way in ways[r % len(ways):] + ways[:r % len(ways)]:
            runs[way].append(run_way(way, workload, args, config, steps, a.warmup))
        print(f"{workload} {config} round {r + 1}: " + " ".join(
            f"{w} {runs[w][-1]['step_ms']:.1f} ms" for w in ways), flush=True)
    row = {"workload": workload, "args": args, "config": config, "runs": runs, "ways": scored(runs)}
    for way, s in row["ways"].items():
        print(f"  {way:<10} " + " ".join(f"{k} {v:.2f}" for k, v in s["ms"].items()) + (
            "  beside user: " + " ".join(f"{k} {v:+.2f}" for k, v in s["beside_user_ms"].items())
            if "beside_user_ms" in s else ""), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="hf_resnet,hf_gpt2")
    ap.add_argument("--ways", default="user,hf,lightning")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2, help="epochs the frameworks' timed steps cover")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--configs", default="0", help="truth.py's configs of each workload, by index: 0,1")
    ap.add_argument("--malloc", default="default,retain",
                    help="glibc's default malloc, malloc_retain, or both (default)")
    ap.add_argument("--out", default="benchmarks/out/anatomy.json")
    ap.add_argument("--again", action="store_true",
                    help="add this run's rows to --out's (a row of the same workload, config and ways replaced)")
    a = ap.parse_args()

    from common import stamp
    from truth import CASES

    ways = a.ways.split(",")
    rows = []
    for workload in a.workloads.split(","):
        args, configs = CASES[workload]
        for i in map(int, a.configs.split(",")):
            base = {k: v for k, v in configs[i].items() if k != "torch_threads"}  # default settings
            for config in [{**base, **({"malloc_retain": True} if m == "retain" else {})}
                           for m in a.malloc.split(",")]:
                rows.append(measure_row(workload, args, config, ways, a))
    out = {**stamp(), "rounds": a.rounds, "epochs": a.epochs, "warmup": a.warmup, "rows": rows}
    if a.again:  # this run's rows beside the file's, each with its own date and command
        kept = json.loads(Path(a.out).read_text())
        for row in kept["rows"]:
            row.setdefault("measured", {k: kept[k] for k in ("date", "hardware", "command", "rounds")})
        for row in rows:
            row["measured"] = {k: out[k] for k in ("date", "hardware", "command", "rounds")}
        new = {_key(r) for r in rows}
        out = {**kept, "rows": [r for r in kept["rows"] if _key(r) not in new] + rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--wrap"]:
        wrap(sys.argv[2], sys.argv[3:])
    else:
        main()
