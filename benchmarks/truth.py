"""Does ``tuner bench`` agree with the user's own plain loop on the same config?

For every built-in workload, and two Hugging Face models wrapped as a user wraps them
(``benchmarks/hf_workloads.py``: ``hf_gpt2``, ``hf_resnet``), 3 configs each
(DataLoader workers with persistent on and off among them), and ``conv_long``: conv with
epochs as long as a user's dataset makes them (the plain loop times 1 whole epoch there),
and ``hf_gpt2_long``, ``hf_resnet_long``: the same models with epochs that hold the whole
of ``user_loop.py``'s windows (the default-settings rows, ``--default --loops user``):

- ``bench``: ``python -m tuner bench SPACE --set ... --json``, the real command;
- ``plain``: the training loop written the way a user writes one (``plain_loop``
  below: a DataLoader, autocast, ``for batch in loader``), run in a fresh Python
  process for whole epochs: one epoch untimed (start-up), then ``--epochs`` epochs
  timed end to end, epoch boundaries included; samples/sec = samples / seconds;
- runs interleaved A/B then B/A, ``--rounds`` rounds, medians; beside the ratio of the
  medians, the median of each round's own bench/plain ratio (``paired_ratio``: a drift
  of the machine that lasts a round hits both sides of that round's ratio), and the 90%
  confidence interval of the rounds' ratios (geometric mean, Student's t on the logs)
  with its verdict against ``--tolerance`` (±3%): ``within`` (all of the interval
  inside), ``outside`` (none of it) or ``unresolved`` (the VM's noise is wider than the
  question). ``--max-rounds`` adds rounds to a row while it is unresolved;
- the machine's own speed around every run, recorded (``machine_speed``: 2-thread
  matmuls for 0.3 s in this idle harness, right before and after; on this VM,
  2026-11-23, the rounds whose runs met one speed by it spread as widely as all rounds:
  the noise that moves a run here is not a speed that matmuls feel);
- peak host memory: bench's figure vs the plain process's own (its peak RSS,
  VmHWM, plus the private pages of its DataLoader workers, read every 8 steps by the
  plain loop itself where it has workers, the largest sum kept, in one more epoch after
  the timed ones: read inside them, it slowed the plain loop by 1-3%);
- a trial inside a real Ray Tune search (``tuner.search.run_search``, one config) vs
  ``bench`` on that config, interleaved likewise.

Prints a table and writes JSON (default benchmarks/out/truth.json).

``--concurrent`` runs the two side by side instead of in turn (``run_concurrent``), each
with 1 thread: the plain loop's rate is read over bench's own timed phase, so a drift of
the machine lands on both. With ``--set malloc_retain=true`` this resolves ±3% where
sequential rounds never did: two plain loops of the same config, started together, read
up to 13% apart with glibc's default malloc (each process keeps the speed it drew at its
start) and within 1.5% with the knob (``--twins`` runs a second plain loop in bench's
place). The tuner's own CPU use lands on both sides there, so it is measured apart.
Speed only. bench's threshold of interference is raised there above the other side's
core (``measure_settings``), so that its ``disturbed`` flag, printed per round, still
singles out a round that something else disturbed. The rows' own geometric means are
summed up ``across_rows``: a bias that every config shares. Its Tune-trial rows run, each
round, bench beside a plain loop and a one-config Tune search beside another, and compare
the two through the plain loop: (trial / plain) / (bench / plain), on the first config of
each workload (no DataLoader workers).

``--pin`` puts each side on a core of its own, and swaps the two sides' cores every
``--swap-every`` seconds while they run (``Swapper``). Without it the kernel shares the
two cores among the runnable threads of both sides, not between the sides: when bench's
DataLoader workers idle at the end of one of its short measured epochs, its main thread
gets half a core and the plain loop's three processes the rest. bench's epochs are
shorter than the plain loop's, so it spent more of its time that way, and read low:
conv_long with 2 workers 0.933 unpinned, 0.982 pinned (2026-11-24). Pinned for a whole
round, each side met its own core's speed, and the cores' speeds drift apart here (one
round read 1.43). In the Tune-trial rows the trial's side is everything this harness
started that is not the plain loop: the trial's process, and Ray's own beside it (the
driver, this process, stays free); the swaps pin them, so those rows need
``--swap-every`` above 0.

    python benchmarks/truth.py --concurrent --pin --set malloc_retain=true --set precision='"fp32"' \
        --workloads conv,transformer,multisource,files,hf_gpt2,hf_resnet --rounds 3 --max-rounds 5
    python benchmarks/truth.py --concurrent --pin --no-search --workloads conv_long --set malloc_retain=true
    python benchmarks/truth.py --concurrent --twins --workloads conv --pick 0

    python benchmarks/truth.py [--workloads conv,transformer,multisource,files] [--rounds 3]
    python benchmarks/truth.py --workloads conv --pick 0,1 --rounds 3 --max-rounds 8
    python benchmarks/truth.py --device cuda      # GPU cases: pinning, non_blocking, fp16
    python benchmarks/truth.py --default --loops user --rounds 8 --no-search --workloads conv --pick 0,1,2 --again

``--again`` adds its rows to the out file's ``measured_again``, as a run of their own (its
date, machine, command); ``measured_again_pooled`` pools each config's rounds over every
run, the file's first included (``runs_of``, ``pooled_again``), and the bias across those pooled rows is
``measured_again_across_loops``.

On a GPU the plain loop also moves each batch itself (``.to(device, non_blocking=...)``),
synchronizes before reading the clock and reports ``torch.cuda.max_memory_allocated``,
compared with bench's ``peak_device_memory_mb``.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from common import REFS, on_core, paired_interval, plain_env, run_bench, space_file, stamp

# (workload, its args, configs): sizes give epochs of a few seconds on 2 cores, so that
# the plain loop's whole epochs stay short and epoch boundaries weigh as they do in a run.
CASES = {
    "conv": ({"size": 1024}, [
        {"precision": "bf16", "micro_batch_size": 64, "channels_last": True, "torch_threads": 2},
        {"precision": "bf16", "micro_batch_size": 64, "channels_last": True, "num_workers": 1,
         "persistent_workers": True, "torch_threads": 1},
        {"precision": "bf16", "micro_batch_size": 64, "channels_last": True, "num_workers": 1,
         "persistent_workers": False, "torch_threads": 1},
    ]),
    "transformer": ({"size": 512}, [
        {"precision": "fp32", "micro_batch_size": 8, "torch_threads": 2},
        {"precision": "bf16", "micro_batch_size": 32, "num_workers": 1, "persistent_workers": True,
         "torch_threads": 2},
        {"precision": "bf16", "micro_batch_size": 32, "num_workers": 1, "persistent_workers": False,
         "torch_threads": 2},
    ]),
    "multisource": ({"size": 8192}, [
        {"precision": "fp32", "micro_batch_size": 64},
        {"precision": "bf16", "micro_batch_size": 128, "batch_grouping": "by_source"},
        {"precision": "fp32", "micro_batch_size": 64, "num_workers": 1, "persistent_workers": False},
    ]),
    "files": ({"size": 1024}, [
        {"precision": "bf16", "micro_batch_size": 64, "channels_last": True, "torch_threads": 2},
        {"precision": "bf16", "micro_batch_size": 64, "channels_last": True, "num_workers": 1,
         "persistent_workers": True, "torch_threads": 1},
        {"precision": "bf16", "micro_batch_size": 64, "channels_last": True, "num_workers": 1,
         "persistent_workers": False, "torch_threads": 1},
    ]),
}

# Timed epochs of the plain loop where a case's epochs are long (default: --epochs).
EPOCHS = {"conv_long": 1}
WINDOWED = ("user", "user_warm")  # loops timed in windows inside epochs: against bench's steady figure
CASES.update({
    # Epochs as a user's dataset has them, long beside a window (64 steps, ~25 s here):
    # the measurement shortens them to five windows and extrapolates. The window before
    # each boundary runs fast where workers share the cores (they stop at the epoch's
    # last batch), and counted as steady it read 1.05-1.20x the user's whole epochs.
    "conv_long": ({"size": 8192}, [
        {"precision": "fp32", "micro_batch_size": 128, "channels_last": True, "num_workers": 2,
         "persistent_workers": True, "torch_threads": 2},
        {"precision": "fp32", "micro_batch_size": 128, "channels_last": True, "num_workers": 2,
         "persistent_workers": False, "torch_threads": 2},
        {"precision": "fp32", "micro_batch_size": 128, "channels_last": True, "torch_threads": 2},
    ]),
    "hf_gpt2": ({"size": 512}, [
        {"precision": "fp32", "micro_batch_size": 8, "torch_threads": 2},
        {"precision": "fp32", "micro_batch_size": 16, "num_workers": 1, "persistent_workers": True,
         "torch_threads": 2},
        {"precision": "fp32", "micro_batch_size": 16, "num_workers": 1, "persistent_workers": False,
         "torch_threads": 2},
    ]),
    # An independent check's protocol: its three configs (GPT-2 fp32 and bf16 with a worker,
    # ResNet bf16), epochs long enough that the user's loop (4 warm-up steps, 5 windows of
    # 6) lies inside its first epoch, so no window follows a worker's restart (with
    # 32-step epochs, the last one did).
    "hf_gpt2_long": ({"size": 2048}, [
        {"precision": "fp32", "micro_batch_size": 8, "torch_threads": 2},
        {"precision": "bf16", "micro_batch_size": 32, "num_workers": 1, "persistent_workers": False,
         "torch_threads": 2},
        {"precision": "bf16", "micro_batch_size": 32, "num_workers": 1, "persistent_workers": True,
         "torch_threads": 2},
    ]),
    "hf_resnet_long": ({"size": 2048}, [
        {"precision": "bf16", "micro_batch_size": 32, "torch_threads": 2},
    ]),
    "hf_resnet": ({"size": 1024}, [
        {"precision": "fp32", "micro_batch_size": 32, "torch_threads": 2},
        {"precision": "fp32", "micro_batch_size": 32, "channels_last": True, "num_workers": 1,
         "persistent_workers": True, "torch_threads": 1},
        {"precision": "fp32", "micro_batch_size": 32, "channels_last": True, "num_workers": 1,
         "persistent_workers": False, "torch_threads": 1},
    ]),
    # A table behind a small MLP at large batches (data_workloads.py): the interpreter's
    # full garbage collections weigh on its step (gc_freeze).
    "rows": ({"size": 200_000}, [
        {"precision": "bf16", "micro_batch_size": 4096, "torch_threads": 2},
        {"precision": "fp32", "micro_batch_size": 1024, "torch_threads": 2},
    ]),
})

# Workloads the measurement was not built on (the held-out landscapes' ocr, csvrows, mae),
# each at its landscape's best config and at one that hands batches over from a worker.
CASES.update({
    "ocr": ({"size": 1024}, [
        {"precision": "bf16", "micro_batch_size": 128, "torch_threads": 2, "malloc_retain": True},
        {"precision": "bf16", "micro_batch_size": 32, "num_workers": 1, "persistent_workers": True,
         "torch_threads": 1},
    ]),
    "csvrows": ({"size": 32768}, [
        {"precision": "bf16", "micro_batch_size": 1024, "num_workers": 2, "persistent_workers": True,
         "torch_threads": 1, "malloc_retain": True},
        {"precision": "fp32", "micro_batch_size": 256, "torch_threads": 2},
    ]),
    "mae": ({"size": 1024}, [
        {"precision": "fp32", "micro_batch_size": 128, "torch_threads": 2, "malloc_retain": True},
        {"precision": "bf16", "micro_batch_size": 32, "num_workers": 1, "persistent_workers": True,
         "torch_threads": 1},
    ]),
})

# GPU cases: the knobs that only matter there, sizes that keep an epoch near a second.
GPU_CASES = {
    "conv": ({"size": 4096}, [
        {"precision": "bf16", "micro_batch_size": 256, "channels_last": True},
        {"precision": "bf16", "micro_batch_size": 512, "channels_last": True, "num_workers": 8,
         "persistent_workers": True, "pin_memory": True, "non_blocking": True},
        {"precision": "bf16", "micro_batch_size": 512, "channels_last": True, "num_workers": 8,
         "persistent_workers": False, "pin_memory": True, "non_blocking": True},
        {"precision": "fp16", "micro_batch_size": 128, "num_workers": 4, "cudnn_benchmark": True},
    ]),
    "transformer": ({"size": 8192}, [
        {"precision": "fp32", "micro_batch_size": 32, "tf32": True},
        {"precision": "fp16", "micro_batch_size": 64, "num_workers": 2, "persistent_workers": True},
    ]),
    # the GPU computes an MLP's step in microseconds: the host's collate and its full
    # garbage collections (gc_freeze) are the step
    "rows": ({"size": 200_000}, [
        {"precision": "bf16", "micro_batch_size": 4096},
        {"precision": "bf16", "micro_batch_size": 4096, "num_workers": 4, "persistent_workers": True,
         "pin_memory": True, "non_blocking": True},
    ]),
}


# ---- the plain loop, as a user writes it (runs in its own process: --plain) -----------


def plain_loop(workload: str, args: dict, config: dict, epochs: int, device: str = "cpu",
               stop_file: str | None = None) -> dict:
    """``stop_file``: after the untimed epoch, print ``ready`` and run epochs until that
    file exists (at least ``epochs``), for a bench run beside this loop (``--concurrent``)."""
    import psutil
    import torch
    from torch.utils.data import DataLoader

    from tuner.workloads import load_workload

    if config.get("torch_threads"):
        torch.set_num_threads(config["torch_threads"])
    dev = torch.device(device)
    torch.backends.cudnn.benchmark = bool(config.get("cudnn_benchmark"))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(config.get("tf32"))
    wl = load_workload(workload, args)
    model = wl.model().to(dev)
    if config.get("channels_last"):
        model = model.to(memory_format=torch.channels_last)
    opt = wl.make_optimizer(model.parameters())
    if config.get("fused_optimizer"):
        from user_loop import fused_like  # the same optimizer, fused=True, as a user asks for it

        opt = fused_like(opt, model.parameters())
    ds = wl.dataset()
    bs, workers = config["micro_batch_size"], config.get("num_workers", 0)
    kw = {"num_workers": workers, "pin_memory": bool(config.get("pin_memory"))}
    if workers:
        kw["persistent_workers"] = config.get("persistent_workers", False)
    if config.get("batch_grouping") == "by_source":
        from user_loop import by_source_batches  # the user's own grouped batch sampler

        loader = DataLoader(ds, batch_sampler=by_source_batches(wl.groups(ds), bs), collate_fn=wl.collate, **kw)
    else:
        loader = DataLoader(ds, batch_size=bs, shuffle=True, drop_last=True, collate_fn=wl.collate, **kw)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.get("precision"))
    scaler = torch.amp.GradScaler(dev.type, enabled=config.get("precision") == "fp16")
    if config.get("gc_freeze"):  # as the export says: built, then frozen, before the first batch
        gc.collect()
        gc.freeze()
    nb = bool(config.get("non_blocking"))
    cl = config.get("channels_last")
    me = psutil.Process()
    workers_peak = 0
    # Beside another side (stop_file), the clock at the end of every step of the timed
    # epochs, so that the rate over the other side's timed phase counts this loop's own
    # steps in it (a list append per step: well under a microsecond, against steps of
    # milliseconds). Epochs alone put an epoch's boundary pause anywhere in it, and a
    # timed phase of ~3 s beside epochs of ~1 s read up to 7% off that way.
    stamps: list[float] | None = None

    def to_cl(b):
        if cl and isinstance(b, (list, tuple)) and b[0].dim() == 4:
            return (b[0].contiguous(memory_format=torch.channels_last), *b[1:])
        if cl and isinstance(b, Mapping):  # Hugging Face batches: the images by name
            return {k: v.contiguous(memory_format=torch.channels_last) if v.dim() == 4 else v for k, v in b.items()}
        return b

    def to_dev(b):  # what a user writes for tensors, lists and dicts
        if dev.type == "cpu":
            return b
        if isinstance(b, torch.Tensor):
            return b.to(dev, non_blocking=nb)
        if isinstance(b, Mapping):
            return {k: to_dev(v) for k, v in b.items()}
        if isinstance(b, (list, tuple)):
            return type(b)(to_dev(v) for v in b)
        return b

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def epoch(sample: bool = False) -> int:
        nonlocal workers_peak
        n = 0
        for i, batch in enumerate(loader):
            batch = to_cl(to_dev(batch))
            with torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None):
                loss = wl.loss(model, batch)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            n += bs
            if stamps is not None:
                stamps.append(time.perf_counter())
            if sample and workers and i % 8 == 5:  # workers' private pages grow as they go (a lazily read file)
                workers_peak = max(workers_peak, sum(c.memory_full_info().uss for c in me.children()))
        return n

    epoch()  # start-up: first workers, first allocations
    sync()
    if config.get("gc_freeze"):  # and again after the first steps, as the export does
        gc.collect()
        gc.freeze()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    samples, ends = 0, []
    if stop_file:
        stamps = []
        print("ready", flush=True)
    while len(ends) < epochs or (stop_file and not os.path.exists(stop_file)):
        samples += epoch()
        sync()
        ends.append(time.perf_counter())
    wall = ends[-1] - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    # The workers' memory, read in one more epoch, untimed: reading a worker's private
    # pages (smaps) takes milliseconds, and read inside the timed epochs, every 8 steps,
    # it slowed the plain loop by 1-3% on the rows with workers (bench read that much
    # above it). Not beside bench (``stop_file``): those rows compare speed only.
    if workers and not stop_file:
        epoch(sample=True)
    # The kernel's high-water mark of this process (VmHWM, what /usr/bin/time's max RSS
    # reads for a process it starts); not ru_maxrss, which keeps the peak of whatever
    # process exec'd this one.
    rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) / 1024
    return {"samples_per_sec": samples / wall, "epochs": len(ends), "epoch_s": wall / len(ends),
            "epoch_times_s": [b - a for a, b in zip([t0, *ends], ends, strict=False)],
            "clock_start": t0, "clock_ends": ends,  # CLOCK_MONOTONIC: one clock for every process
            "step_ends": stamps, "batch_size": bs,
            "page_faults_per_step": faults * bs / samples,  # one optimizer step per batch
            "peak_rss_mb": rss, "workers_private_mb": workers_peak / 2**20,
            "peak_host_memory_mb": rss + workers_peak / 2**20,
            "peak_device_memory_mb": torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None}


# ---- the harness ---------------------------------------------------------------------


def plain_cmd(*loop_args: object) -> list[str]:
    """The command that runs ``plain_loop(*loop_args)`` in a fresh process."""
    return [sys.executable, __file__, "--plain", json.dumps(loop_args)]


def run_plain(workload: str, args: dict, config: dict, epochs: int, device: str = "cpu",
              core: int | None = None) -> dict:
    out = subprocess.run(plain_cmd(workload, args, config, epochs, device),
                         capture_output=True, text=True, check=True, env=plain_env(config),
                         preexec_fn=on_core(core))
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_trial(workload: str, args: dict, config: dict, results: Path, tag: str, device: str = "cpu",
              measure: dict | None = None) -> dict:
    """One config as a trial of a real Tune search (Ray already started by the caller)."""
    from tuner import spec
    from tuner.search import run_search

    space = spec.parse({"name": f"truth-{workload}-{tag}", "workload": REFS.get(workload, workload),
                        "workload_args": args,
                        "device": device, "knobs": config, "budget": {"trials": 1},
                        **({"measure": measure} if measure else {}),
                        "confirm": {"top": 0, "repeats": 0}})
    run_search(space, results_root=results, quiet=True)
    records = [json.loads(line) for line in (results / space.name / "trials.jsonl").read_text().splitlines()]
    return next(r for r in records if r.get("phase") == "search")


def run_twin(workload: str, args: dict, config: dict, device: str = "cpu", epochs: int = 3,
             core: int | None = None) -> dict:
    """The plain loop again, as the "bench" side of ``run_concurrent`` (``--twins``: the
    method's own floor, two identical loops side by side)."""
    p = run_plain(workload, args, config, epochs, device, core)
    return {"samples_per_sec": p["samples_per_sec"], "timed_clock_s": [p["clock_start"], p["clock_ends"][-1]]}


class Swapper:
    """Swaps the two sides' cores every ``every_s`` seconds while they run (``--pin``).

    Each side keeps a core of its own at every moment (so that neither side's idle
    workers hand the other side's threads their core), and over the timed phase both sides
    spend the same time on each core. Pinned for a whole round instead, a side stayed on
    the core it started on, and the cores' speeds drift apart here: in one round the
    plain loop on one core read 154 samples/s while bench on the other read 221, and both
    read 170-173 in the next (conv, 1 persistent worker, 2026-11-24 12:25). The plain
    loop's tree is ``plain``'s process and its descendants; the other side is every other
    descendant of this harness. Every thread of every process is moved (Linux pins
    threads, not processes); a process started between two swaps inherits its parent's
    core, which is its own side's.

    ``bystanders``: what to do with the harness's other processes that exist before the
    side starts (Ray's, in the Tune-trial rows): ``"side"`` pins them with the side (a
    trial's round: the tuner's own processes compete with its trial), ``"free"`` lets them
    run on any core and leaves them out of the swaps (bench's round: Ray's daemons are
    nobody's; pinned with bench, they read it 6% low in a first try)."""

    def __init__(self, plain: int, cores: tuple[int, int], every_s: float, bystanders: str = "side"):
        import threading

        self.plain, self.cores, self.every_s, self.bystanders = plain, cores, every_s, bystanders
        self.swaps = 0
        self._free: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Swapper:
        if self.every_s > 0:
            if self.bystanders == "free":
                import psutil

                plain = self._plain_tree() or set()
                self._free = {c.pid for c in psutil.Process().children(recursive=True)} - plain
                for pid in self._free:
                    _pin_threads(pid, os.sched_getaffinity(0))
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(self.every_s):
            self.swaps += 1
            plain_core, side_core = self.cores[self.swaps % 2], self.cores[1 - self.swaps % 2]
            plain = self._plain_tree()
            if plain is None:
                return  # the plain loop has ended
            for proc in psutil.Process().children(recursive=True):
                if proc.pid not in self._free:
                    _pin_threads(proc.pid, {plain_core if proc.pid in plain else side_core})

    def _plain_tree(self) -> set[int] | None:
        import psutil

        try:
            root = psutil.Process(self.plain)
            return {root.pid, *(c.pid for c in root.children(recursive=True))}
        except psutil.Error:
            return None


def _pin_threads(pid: int, cores: set[int]) -> None:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread or process has ended
            pass


def run_concurrent(side, workload: str, args: dict, config: dict, folder: Path, device: str = "cpu",
                   core: int | None = None, swap_s: float = 0.0, bystanders: str = "side") -> dict:
    """``side()`` (bench, a Tune trial, or a second plain loop: a dict with its
    ``samples_per_sec`` and ``timed_clock_s``) and the plain loop at once, each on its
    share of the cores: the plain loop starts first, and once its untimed epoch is done,
    ``side`` runs beside it; the plain loop's rate is read over the side's own timed phase
    (``timed_clock_s``: one monotonic clock for both processes) from its own steps, each
    weighted by how much of it falls in the phase (``plain_by_epoch``: the same from whole
    epochs, as it was read until 2026-11-24 13:15). A drift of the machine, which in sequential rounds lands on
    one side of a ratio and not the other, lands on both. ``core``: the plain loop's
    process tree pinned to that core (``side`` pins itself to the other), and with
    ``swap_s`` the two sides' cores swapped that often (``Swapper``, which is also told
    what to do with the harness's other processes: ``bystanders``)."""
    stop = folder / f"stop-{time.monotonic_ns()}"
    plain = subprocess.Popen(plain_cmd(REFS.get(workload, workload), args, config, 1, device, str(stop)),
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=plain_env(config),
                             preexec_fn=on_core(core))
    try:
        if plain.stdout.readline().strip() != "ready":
            raise RuntimeError("the plain loop failed before its first epoch ended")
        with Swapper(plain.pid, (core, 1 - core) if core is not None else (0, 1),
                     swap_s if core is not None else 0.0, bystanders) as swapper:
            bench = side()
    finally:
        stop.touch()
        tail = plain.communicate()[0]
    p = json.loads(tail.strip().splitlines()[-1])
    s0, s1 = bench["timed_clock_s"]
    edges = [p["clock_start"], *p["clock_ends"]]
    per_epoch = p["samples_per_sec"] * p["epoch_s"]
    by_epoch = sum(per_epoch * max(0.0, min(e1, s1) - max(e0, s0)) / (e1 - e0)
                   for e0, e1 in zip(edges, edges[1:], strict=False))
    samples = by_epoch
    if p.get("step_ends"):  # each step's samples spread over its own time, not its epoch's
        steps = [p["clock_start"], *p["step_ends"]]
        samples = sum(p["batch_size"] * max(0.0, min(e1, s1) - max(e0, s0)) / (e1 - e0)
                      for e0, e1 in zip(steps, steps[1:], strict=False))
    covered = (min(s1, edges[-1]) - max(s0, edges[0])) / (s1 - s0)
    if covered < 0.999:
        raise RuntimeError(f"the plain loop covered {covered:.0%} of the timed phase beside it")
    return {"side": bench["samples_per_sec"], "plain": samples / (s1 - s0), "plain_by_epoch": by_epoch / (s1 - s0),
            "plain_whole": p["samples_per_sec"], "timed_s": s1 - s0, "plain_epochs": len(p["clock_ends"]),
            "bench_windows": bench.get("samples_per_sec_windows"),
            "bench_faults_per_step": bench.get("page_faults_per_step"),
            "plain_faults_per_step": p["page_faults_per_step"],
            "tuner_cpu_cores": bench.get("tuner_cpu_cores"),
            "interference_cores": bench.get("interference_cores"),
            "disturbed": bench.get("disturbed"),
            "disturbed_windows_dropped": bench.get("disturbed_windows_dropped"),
            "core_swaps": swapper.swaps}


def machine_speed(seconds: float = 0.3) -> float:
    """GFLOP/s of 2-thread fp32 matmuls, timed in this (idle) harness process right
    before and after each run. This VM moves between speeds ~35% apart for minutes at a
    time; the probes say which speed each run met."""
    import torch

    torch.set_num_threads(2)
    a = torch.randn(384, 384)
    a @ a
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a
        n += 1
    return n * 2 * 384**3 / 1e9 / (time.perf_counter() - t0)


def probed(fn, *args) -> dict:
    """``fn(*args)``'s result with the machine's speed right before and after it."""
    before = machine_speed()
    result = fn(*args)
    return {**result, "probe_before": before, "probe_after": machine_speed()}


def across_rows(rows: list[dict], tolerance: float) -> dict | None:
    """A bias common to every config: the geometric mean of the rows' own geometric
    means (each row weighs the same, however many rounds it took), with the 90% interval
    over the rows. A row's own interval is wide on this VM (a round strays by ±5%); this
    one says whether bench reads high or low in general."""
    geos = [r["paired_geomean"] for r in rows if r.get("paired_geomean")]
    if len(geos) < 2:
        return None
    geo, lo, hi = paired_interval(geos, [1.0] * len(geos))
    return {"rows": len(geos), "geomean": geo, "interval_90": [lo, hi],
            "within_tolerance": sum(1 - tolerance <= g <= 1 + tolerance for g in geos)}


def across_loops(rows: list[dict], tolerance: float) -> dict:
    """``across_rows`` for each kind of loop apart: a user's loop and a framework's differ
    by the framework's own per-step work (Trainer clips the gradients every step), which
    pooled rows would spread over both."""
    loops = sorted({r.get("loop", "plain") for r in rows})
    return {loop: across_rows([r for r in rows if r.get("loop", "plain") == loop], tolerance) for loop in loops}


def runs_of(data: dict) -> list[dict]:
    """Every run of an out file that measured rows: its first (``rows``), then each of
    ``measured_again``."""
    return [{"date": data["date"], "rows": data["rows"]}, *data.get("measured_again", [])]


def pooled_again(runs: list[dict], tolerance: float) -> list[dict]:
    """Each config of the rows measured again (``--again``), over every round of every run
    that measured it: a round's ratio is paired within the round, so a host that ran
    faster one day moves both of its sides, and rounds of several runs pool. One row per
    (workload, config, loop, and user_warm's warm-up steps), in the order first measured."""
    pooled: dict[str, dict] = {}
    for run in runs:
        for r in run["rows"]:
            warm = r.get("user_warmup")  # user_warm's warm-up steps: another loop for each count
            key = json.dumps([r["workload"], r["config"], r.get("loop"), warm], sort_keys=True)
            row = pooled.setdefault(key, {"workload": r["workload"], "config": r["config"], "loop": r.get("loop"),
                                          **({"user_warmup": warm} if warm else {}),
                                          "bench_runs": [], "plain_runs": [], "dates": []})
            row["bench_runs"] += r["bench_runs"]
            row["plain_runs"] += r["plain_runs"]
            row["dates"].append(run["date"])
    for row in pooled.values():
        geo, lo, hi = paired_interval(row["bench_runs"], row["plain_runs"])
        row.update(rounds=len(row["bench_runs"]), runs=len(row["dates"]),
                   bench_samples_per_sec=statistics.median(row["bench_runs"]),
                   plain_samples_per_sec=statistics.median(row["plain_runs"]), paired_geomean=geo,
                   paired_interval_90=[lo, hi], verdict=verdict(lo, hi, tolerance))
    return list(pooled.values())


def settled(r: int, a: argparse.Namespace, xs: list[float], ys: list[float]) -> bool:
    """Whether a row stops before round ``r``: ``--rounds`` done, and then as soon as the
    interval of the paired ratios is no longer unresolved (``--max-rounds``)."""
    return r >= a.rounds and verdict(*paired_interval(xs, ys)[1:], a.tolerance) != "unresolved"


def measure_settings(a: argparse.Namespace) -> dict:
    """bench's (and the trial's) measure settings: ``--measure``, and side by side
    (``--concurrent``) a threshold of interference above the other side's own core.
    Otherwise every window counts that core as interference (the default threshold is a
    tenth of the machine's cores): each bench redid its first 12 windows, was marked
    disturbed, and the flag could not single out a round that something else disturbed."""
    measure = json.loads(a.measure or "{}")
    if a.concurrent:
        from tuner.hardware import usable_cores

        cpus = usable_cores()
        measure.setdefault("max_interference", min(1.0, (1 + 0.1 * cpus) / cpus))
    return measure


def verdict(lo: float, hi: float, tolerance: float) -> str:
    """``within``: the whole interval inside 1 ± tolerance; ``outside``: none of it;
    ``unresolved``: the noise is wider than the question."""
    if 1 - tolerance <= lo and hi <= 1 + tolerance:
        return "within"
    if hi < 1 - tolerance or lo > 1 + tolerance:
        return "outside"
    return "unresolved"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-rounds", type=int, default=None,
                    help="add rounds, up to this many, while a row's interval is unresolved (default: --rounds)")
    ap.add_argument("--tolerance", type=float, default=0.03, help="the agreement asked for: 0.03 = ±3%%")
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs of the plain loop")
    ap.add_argument("--user-warmup", type=int, default=128,
                    help="the user_warm loop's warm-up steps (user_loop.py's --warmup; the user loop's is 4)")
    ap.add_argument("--configs", type=int, default=None, help="only the first N configs per workload")
    ap.add_argument("--pick", default=None, help="only these configs per workload, by index: 0,2")
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=JSON",
                    help="override a knob in every config: --set precision='\"fp32\"' (a CPU without bf16)")
    ap.add_argument("--no-search", action="store_true", help="skip the Tune-trial comparison")
    ap.add_argument("--only-search", action="store_true", help="only the Tune-trial comparison")
    ap.add_argument("--search-rounds", type=int, default=3, help="rounds of the Tune-trial comparison")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU cases")
    ap.add_argument("--out", default=None, help="default benchmarks/out/truth.json (truth-cuda.json on a GPU)")
    ap.add_argument("--concurrent", action="store_true",
                    help="bench and the plain loop at once, each with 1 thread, instead of in turn "
                         "(speed only; drift lands on both)")
    ap.add_argument("--twins", action="store_true",
                    help="with --concurrent: a second plain loop in bench's place (the comparison's own floor)")
    ap.add_argument("--pin", action="store_true",
                    help="with --concurrent: each side on a core of its own, the two swapped while they run "
                         "(--swap-every)")
    ap.add_argument("--swap-every", type=float, default=0.5, metavar="SECONDS",
                    help="with --pin: swap the two sides' cores this often while they run (0: once per round)")
    ap.add_argument("--measure", default=None, metavar="JSON",
                    help='bench\'s measure settings, as in a space: \'{"min_windows": 15}\'')
    ap.add_argument("--loops", default="plain",
                    help="the loops bench is compared with, in turn: plain (whole epochs), user "
                         "(user_loop.py's windows), user_warm (the same after --user-warmup steps), "
                         "epochs (user_loop.py over --epochs whole epochs), "
                         "hf (a transformers.Trainer with the exported arguments), hf_no_lookahead (the "
                         "same, its loader not reading a batch ahead), hf_no_clip (max_grad_norm=0), "
                         "hf_inputs_cl (channels_last inputs from the data collator too), hf_inputs_cl_forward (made "
                         "in the forward of the module around the model)")
    ap.add_argument("--default", action="store_true",
                    help="at default settings: each config with the threads of the space's defaults (no "
                         "torch_threads), compared with the user's loop and a Trainer "
                         "(--loops user,hf), into benchmarks/out/truth_default.json")
    ap.add_argument("--again", action="store_true",
                    help="rows measured again (more rounds, another day): added to the out file's "
                         "measured_again, with this run's date, machine and command, its other rows kept")
    ap.add_argument("--plain", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.default:
        a.loops = "user,hf" if a.loops == "plain" else a.loops
        a.out = a.out or "benchmarks/out/truth_default.json"
    a.loops = a.loops.split(",")
    if a.plain:
        print(json.dumps(plain_loop(*json.loads(a.plain))))
        return


    cases = GPU_CASES if a.device == "cuda" else CASES
    overrides = {k: json.loads(v) for k, v in (x.split("=", 1) for x in a.set)}
    if a.workloads == ",".join(CASES):
        a.workloads = ",".join(cases)
    a.out = a.out or ("benchmarks/out/truth-cuda.json" if a.device == "cuda" else "benchmarks/out/truth.json")
    tmp = Path(tempfile.mkdtemp(prefix="truth-"))
    atexit.register(shutil.rmtree, tmp, True)  # its spaces and trials' results: scratch
    rows, search_rows, persistence = [], [], []

    kept = json.loads(Path(a.out).read_text()) if a.again and Path(a.out).exists() else None
    if kept is not None:  # this run's entry, filled as its rows come
        kept.setdefault("measured_again", []).append({**stamp(), "rows": rows})

    def save() -> None:  # after every row: an interrupted run keeps what it measured
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        if kept is not None:
            pooled = kept["measured_again_pooled"] = pooled_again(runs_of(kept), a.tolerance)
            kept["measured_again_across_loops"] = across_loops(pooled, a.tolerance)
            Path(a.out).write_text(json.dumps(kept, indent=2, default=str))
            return
        Path(a.out).write_text(json.dumps({**stamp(), "tolerance": a.tolerance, "rounds": a.rounds, "plain_epochs": a.epochs,
                                           "rows": rows, "across_rows": across_rows(rows, a.tolerance),
                                           "across_loops": across_loops(rows, a.tolerance),
                                           "persistence": persistence, "search": search_rows},
                                          indent=2, default=str))

    if a.concurrent:
        a.out = a.out if a.out != "benchmarks/out/truth.json" else "benchmarks/out/truth_concurrent.json"
        overrides["torch_threads"] = 1
    for workload in a.workloads.split(","):
        args, configs = cases[workload]
        space = space_file(tmp, workload, args, device=a.device, measure=measure_settings(a))
        picked = [configs[int(i)] for i in a.pick.split(",")] if a.pick else configs[: a.configs]
        picked = [{**c, **overrides} for c in picked]
        if a.default:  # the threads a user's process has unless it sets them: PyTorch's default
            picked = [{k: v for k, v in c.items() if k != "torch_threads"} for c in picked]
        for config in [] if a.only_search else picked:
            if a.concurrent:
                rows.append(concurrent_row(space, workload, args, config, tmp, a))
                save()
                continue
            bench, loops = [], {k: [] for k in a.loops}
            for r in range(max(a.rounds, a.max_rounds or 0)):
                first = loops[a.loops[0]]
                if settled(r, a, [x["samples_per_sec"] for x in bench], [y["samples_per_sec"] for y in first]):
                    break
                order = ["bench", *a.loops]
                order = order[r % len(order):] + order[:r % len(order)]
                for which in order:
                    if which == "bench":
                        bench.append(probed(run_bench, space, config))
                    elif not which.startswith("hf") or config.get("batch_grouping") != "by_source":  # not expressible there
                        loops[which].append(probed(run_loop, which, workload, args, config, a))
            for loop, plain in loops.items():
                if not plain:
                    continue
                row = loop_row(workload, args, config, bench, plain, loop, a)
                rows.append(row)
                save()
                b, p, paired, (lo, hi) = (row["bench_samples_per_sec"], row["plain_samples_per_sec"],
                                          row["paired_ratio"], row["paired_interval_90"])
                memory = (f"  memory {row['bench_memory_mb']:6.0f} / {row['plain_memory_mb']:6.0f} MB = "
                          f"{row['memory_ratio']:5.3f}" if row["memory_ratio"] else "")
                print(f"{workload:<12} {_short(config):<58} bench {b:8.1f}  {loop:<5} {p:8.1f}  "
                      f"ratio {b / p:5.3f} (paired {paired:5.3f}, 90% {lo:5.3f}-{hi:5.3f} in {len(bench)} rounds: "
                      f"{row['verdict']}){memory}", flush=True)

    if a.concurrent:
        if len(rows) > 1:
            x = across_rows(rows, a.tolerance)
            print(f"across {x['rows']} rows: {x['geomean']:.3f} (90% {x['interval_90'][0]:.3f}-"
                  f"{x['interval_90'][1]:.3f}); {x['within_tolerance']} of them within ±{a.tolerance:.0%} "
                  f"at the geometric mean", flush=True)
        if not a.no_search and not a.twins:
            import ray

            from tuner.localray import start_local_ray

            start_local_ray(log_to_driver=False, logging_level="ERROR")  # as `tuner run` starts it
            try:
                for workload in a.workloads.split(","):
                    args, configs = cases[workload]
                    space = space_file(tmp, workload, args, device=a.device,
                                       measure=measure_settings(a))
                    search_rows.append(concurrent_row(space, workload, args, {**configs[0], **overrides}, tmp, a,
                                                      trial=True))
                    save()
            finally:
                ray.shutdown()
        save()
        print(f"wrote {a.out}")
        return

    # persistent workers on vs off: bench's ratio vs the plain loop's whole epochs
    for workload in a.workloads.split(","):
        mine = [r for r in rows if r["workload"] == workload and r["config"].get("num_workers")
                and r["loop"] == a.loops[0]]
        on = next((r for r in mine if r["config"].get("persistent_workers")), None)
        off = next((r for r in mine if not r["config"].get("persistent_workers")), None)
        if on and off and on["config"].get("precision") == off["config"].get("precision"):
            bench_r = on["bench_samples_per_sec"] / off["bench_samples_per_sec"]
            plain_r = on["plain_samples_per_sec"] / off["plain_samples_per_sec"]
            persistence.append({"workload": workload, "bench_on_over_off": bench_r,
                                "plain_on_over_off": plain_r, "agreement": bench_r / plain_r})

    if not a.no_search:
        import ray

        from tuner.localray import start_local_ray

        start_local_ray(log_to_driver=False, logging_level="ERROR")  # as `tuner run` starts it
        try:
            for workload in a.workloads.split(","):
                args, configs = cases[workload]
                space = space_file(tmp, workload, args, device=a.device)
                config = {**configs[0], **overrides}
                bench, trial = [], []
                for r in range(a.search_rounds):
                    order = ("bench", "trial") if r % 2 == 0 else ("trial", "bench")
                    for which in order:
                        if which == "bench":
                            bench.append(run_bench(space, config)["samples_per_sec"])
                        else:
                            rec = run_trial(workload, args, config, tmp / "results", f"r{r}", a.device)
                            trial.append(rec["samples_per_sec"])
                b, t = statistics.median(bench), statistics.median(trial)
                search_rows.append({"workload": workload, "config": config, "bench_samples_per_sec": b,
                                    "trial_samples_per_sec": t, "trial_over_bench": t / b,
                                    "paired_ratio": statistics.median(x / y for x, y in zip(trial, bench, strict=True)),
                                    "paired_interval_90": list(paired_interval(trial, bench)[1:]),
                                    "bench_runs": bench, "trial_runs": trial,
                                    "trial_tuner_cpu_cores": rec.get("tuner_cpu_cores"),
                                    "trial_interference_cores": rec.get("interference_cores")})
                save()
                print(f"{workload:<12} Tune trial {t:8.1f}  bench {b:8.1f}  trial/bench {t / b:5.3f}  "
                      f"(tuner's own CPU beside the trial: {rec.get('tuner_cpu_cores') or 0:.3f} cores)",
                      flush=True)
        finally:
            ray.shutdown()

    save()
    print(f"\n{'workload':<12} {'config':<58} {'bench':>8} {'plain':>8} {'ratio':>6} {'paired':>6} "
          f"{'90% interval':>13} {'n':>2} {'verdict':>10} {'mem ratio':>9} {'device MB bench/plain':>22}")
    for r in rows:
        dev_mb = (f"{r['bench_device_memory_mb']:8.0f} / {r['plain_device_memory_mb']:8.0f}"
                  if r.get("plain_device_memory_mb") else "")
        print(f"{r['workload']:<12} {_short(r['config']):<58} {r['bench_samples_per_sec']:8.1f} "
              f"{r['plain_samples_per_sec']:8.1f} {r['bench_over_plain']:6.3f} {r['paired_ratio']:6.3f} "
              f"{r['paired_interval_90'][0]:6.3f}-{r['paired_interval_90'][1]:6.3f} {r['rounds']:>2} "
              f"{r['verdict']:>10} {r['memory_ratio'] or 0:9.3f} {dev_mb:>22} {r['loop']}")
    for p in persistence:
        print(f"{p['workload']:<12} persistent on/off: bench {p['bench_on_over_off']:.3f}, "
              f"plain whole epochs {p['plain_on_over_off']:.3f}, agreement {p['agreement']:.3f}")
    for s in search_rows:
        print(f"{s['workload']:<12} Tune trial / bench: {s['trial_over_bench']:.3f} (paired {s['paired_ratio']:.3f})")
    print(f"wrote {a.out}")


def run_loop(loop: str, workload: str, args: dict, config: dict, a: argparse.Namespace) -> dict:
    """One run of the loop that ``bench`` is compared with: ``plain`` (whole epochs, this
    file's ``plain_loop``), ``user`` (``user_loop.py``: windows inside epochs, as the
    issue's independent check wrote it), ``user_warm`` (the same after ``--user-warmup``
    warm-up steps: where batch shapes vary, once every shape has been met), ``epochs``
    (``user_loop.py``'s ``--epochs``: the same loop timed over ``--epochs`` whole epochs,
    boundaries included) or ``hf`` (a
    real ``transformers.Trainer`` with the exported TrainingArguments,
    ``framework_speed.run_hf``)."""
    ref = REFS.get(workload, workload)
    if loop == "plain":
        return run_plain(ref, args, config, EPOCHS.get(workload, a.epochs), a.device)
    if loop in ("user", "user_warm", "epochs"):
        more = (["--epochs", str(a.epochs)] if loop == "epochs"
                else ["--warmup", str(a.user_warmup)] if loop == "user_warm" else [])
        out = subprocess.run([sys.executable, str(Path(__file__).with_name("user_loop.py")), ref,
                              json.dumps(args), json.dumps(config), *more], capture_output=True, text=True,
                             check=True, env=plain_env(config))
        got = json.loads(out.stdout.strip().splitlines()[-1])
        if loop == "epochs":  # the same loop's whole epochs, boundaries in: what a run of them gets
            got = {**got, "windows_samples_per_sec": got["samples_per_sec"],
                   "samples_per_sec": got["epochs_samples_per_sec"]}
        return got
    from framework_speed import in_process, payload_for

    size = args.get("size", 1024)
    steps = a.epochs * size // config["micro_batch_size"]
    return in_process(loop, ref, args, payload_for(ref, args, config), steps, 5)


def loop_row(workload: str, args: dict, config: dict, bench: list[dict], plain: list[dict], loop: str,
             a: argparse.Namespace) -> dict:
    """One row: bench against one loop, over the rounds they shared. The user's loop times
    windows inside epochs: it is compared with bench's steady figure, which leaves epoch
    boundaries out too; the other loops run whole epochs, as bench's figure counts them."""
    fig = "steady_samples_per_sec" if loop in WINDOWED else "samples_per_sec"
    bench = [{**x, "samples_per_sec": x[fig], "with_boundaries": x["samples_per_sec"]} for x in bench]
    b = statistics.median(x["samples_per_sec"] for x in bench)
    p = statistics.median(x["samples_per_sec"] for x in plain)
    mem = all(y.get("peak_host_memory_mb") for y in plain)
    bm = statistics.median(x["peak_host_memory_mb"] for x in bench)
    pm = statistics.median(y["peak_host_memory_mb"] for y in plain) if mem else None
    geo, lo, hi = paired_interval([x["samples_per_sec"] for x in bench], [y["samples_per_sec"] for y in plain])
    row = {"workload": workload, "args": args, "config": config, "loop": loop, "bench_figure": fig,
           "bench_with_boundaries_runs": [x["with_boundaries"] for x in bench],
           "bench_samples_per_sec": b, "plain_samples_per_sec": p, "bench_over_plain": b / p,
           "paired_ratio": statistics.median(x["samples_per_sec"] / y["samples_per_sec"]
                                             for x, y in zip(bench, plain, strict=True)),
           "rounds": len(bench), "paired_geomean": geo, "paired_interval_90": [lo, hi],
           "verdict": verdict(lo, hi, a.tolerance),
           "bench_probes": [[x["probe_before"], x["probe_after"]] for x in bench],
           "plain_probes": [[y["probe_before"], y["probe_after"]] for y in plain],
           "bench_runs": [x["samples_per_sec"] for x in bench], "plain_runs": [y["samples_per_sec"] for y in plain],
           "bench_memory_mb": bm, "plain_memory_mb": pm, "memory_ratio": bm / pm if pm else None,
           "bench_interference_cores": [x.get("interference_cores") for x in bench],
           "bench_disturbed": [x.get("disturbed") for x in bench]}
    if loop == "user_warm":
        row["user_warmup"] = a.user_warmup
    if loop in WINDOWED:  # bench's reported figure (epoch boundaries counted) against the same windows
        reported = paired_interval([x["with_boundaries"] for x in bench], [y["samples_per_sec"] for y in plain])
        row.update(reported_geomean=reported[0], reported_interval_90=list(reported[1:]))
    if loop == "plain":
        row["plain_epoch_s"] = statistics.median(y["epoch_s"] for y in plain)
    if all(y.get("epoch_start_ms") for y in plain):  # a framework's step at an epoch start, and mid-epoch
        row["epoch_start_ms"] = statistics.median(y["epoch_start_ms"] for y in plain)
        row["mid_epoch_ms"] = statistics.median(y["mid_epoch_ms"] for y in plain)
    if a.device == "cuda" and mem:
        row["bench_device_memory_mb"] = statistics.median(x["peak_device_memory_mb"] for x in bench)
        row["plain_device_memory_mb"] = statistics.median(y["peak_device_memory_mb"] for y in plain)
    return row


def concurrent_row(space: Path, workload: str, args: dict, config: dict, tmp: Path, a: argparse.Namespace,
                   trial: bool = False) -> dict:
    """One config's rounds of ``run_concurrent``, with the interval of their ratios.

    ``trial``: each round runs bench beside a plain loop and a one-config Tune search
    beside another (the order alternating), and the row's question is the Tune trial
    against bench: each round's (trial / plain) / (bench / plain), so that the plain loop
    is the common reference of the two (Ray started by the caller)."""
    def bench(core: int | None = None):
        if a.twins:
            return lambda: run_twin(REFS.get(workload, workload), args, config, a.device, core=core)
        return lambda: run_bench(space, config, core)

    def cores(r: int) -> tuple[int | None, int | None]:  # (the plain loop's, bench's): swapped each round
        pinned = a.pin and (not trial or a.swap_every > 0)  # a trial is pinned by the swaps alone
        return (r % 2, 1 - r % 2) if pinned else (None, None)

    def tune(r: int):
        return lambda: run_trial(workload, args, config, tmp / "results", f"c{r}-{time.monotonic_ns()}", a.device,
                                 measure_settings(a))

    name = "twin" if a.twins else "bench"
    runs: list[dict] = []
    trials: list[dict] = []

    def ratios() -> tuple[list[float], list[float]]:
        if trial:
            return ([t["side"] / t["plain"] for t in trials], [x["side"] / x["plain"] for x in runs])
        return [x["side"] for x in runs], [x["plain"] for x in runs]

    for r in range(max(a.rounds, a.max_rounds or 0)):
        if settled(r, a, *ratios()):
            break
        for which in (("bench", "trial") if r % 2 == 0 else ("trial", "bench")) if trial else ("bench",):
            if which == "bench":
                plain_core, bench_core = cores(r)
                runs.append(run_concurrent(bench(bench_core), workload, args, config, tmp, a.device, plain_core,
                                           a.swap_every, "free"))
                print(f"  round {r + 1}: {name} {runs[-1]['side']:.1f}, plain beside it {runs[-1]['plain']:.1f} "
                      f"({runs[-1]['side'] / runs[-1]['plain']:.3f}){_flag(runs[-1])}", flush=True)
            else:
                trials.append(run_concurrent(tune(r), workload, args, config, tmp, a.device, cores(r)[0],
                                             a.swap_every))
                print(f"  round {r + 1}: Tune trial {trials[-1]['side']:.1f}, plain beside it "
                      f"{trials[-1]['plain']:.1f} ({trials[-1]['side'] / trials[-1]['plain']:.3f}; "
                      f"the tuner's own CPU {trials[-1]['tuner_cpu_cores'] or 0:.3f} cores){_flag(trials[-1])}",
                      flush=True)
    geo, lo, hi = paired_interval(*ratios())
    pinned = cores(0)[0] is not None
    row = {"workload": workload, "args": args, "config": config, "concurrent": True, "twins": a.twins,
           "pinned": pinned, "swap_every_s": a.swap_every if pinned else None,
           "rounds": len(runs), "paired_geomean": geo, "paired_interval_90": [lo, hi],
           "verdict": verdict(lo, hi, a.tolerance),
           "paired_ratio": statistics.median(x / y for x, y in zip(*ratios(), strict=True)), "runs": runs}
    if trial:
        bench_geo = paired_interval([x["side"] for x in runs], [x["plain"] for x in runs])
        trial_geo = paired_interval([x["side"] for x in trials], [x["plain"] for x in trials])
        row.update({"question": "Tune trial / bench", "trial_runs": trials,
                    "bench_over_plain": list(bench_geo), "trial_over_plain": list(trial_geo),
                    "trial_tuner_cpu_cores": statistics.median(t["tuner_cpu_cores"] or 0.0 for t in trials)})
        print(f"{workload:<12} {_short(config):<58} concurrent: Tune trial / bench {geo:5.3f} "
              f"(90% {lo:5.3f}-{hi:5.3f} in {len(runs)} rounds: {row['verdict']}); "
              f"trial / plain {trial_geo[0]:5.3f}, bench / plain {bench_geo[0]:5.3f}", flush=True)
        return row
    print(f"{workload:<12} {_short(config):<58} concurrent: {name} / plain {geo:5.3f} "
          f"(90% {lo:5.3f}-{hi:5.3f} in {len(runs)} rounds: {row['verdict']})", flush=True)
    return row


def _flag(run: dict) -> str:
    """What a round's measurement said of its own windows, for the round's line."""
    if run.get("disturbed"):
        return " DISTURBED"
    return f" ({run['disturbed_windows_dropped']} windows redone)" if run.get("disturbed_windows_dropped") else ""


def _short(config: dict) -> str:
    names = {"precision": "", "micro_batch_size": "b", "num_workers": "w", "persistent_workers": "persist=",
             "channels_last": "cl=", "torch_threads": "t", "batch_grouping": ""}
    return " ".join(f"{names.get(k, k + '=')}{v}" for k, v in config.items())


if __name__ == "__main__":
    main()
