"""The tuner's own CPU and wake-ups beside a trial in a search, process by process, in
three states of the local Ray:

- ``ray_defaults``: Ray's defaults (log monitor, metrics) and an actor beside the trial;
- ``hushed``: ``start_local_ray`` (no log monitor, no metrics), no actor, the driver's
  loop asleep through the windows, but the raylet's timers and the autoscaler monitor as
  Ray has them;
- ``quiet``: a search as it runs: the raylet's timers rarer as well
  (``QUIET_RAY_CONFIG``), no autoscaler monitor (``QUIET_RAY_PARAMS``), and no dashboard
  head process (the trial has one rank).

Each measurement is a fresh driver process that starts a local Ray as the state says and
runs a Tune search of one trial. The trial sleeps (its own CPU is Ray's core worker
alone) and, over ``--window-s`` in the middle, reads the CPU time of every process on
the machine but itself, and how often their threads were woken (context switches).
The states alternate in a random order within every cycle, so that a drift of the
machine hits all alike. Prints, per state, the median cores and wake-ups per second of
each kind of process and of the tuner's total (the driver's process tree); writes JSON.

    python benchmarks/tuner_cpu.py [--cycles 5] [--window-s 20]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

STATES = ("ray_defaults", "hushed", "quiet")
# Ray's own defaults of the raylet timers that QUIET_RAY_CONFIG makes rarer (ray_config_def.h)
RAYLET_TIMER_DEFAULTS = {"raylet_check_gc_period_milliseconds": 100, "object_manager_timer_freq_ms": 100,
                         "local_fs_monitor_interval_ms": 100, "kill_idle_workers_interval_ms": 200}


def wakeups(pid: int) -> int:
    """Context switches of all of ``pid``'s threads so far: how often they were woken."""
    n = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                n += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except OSError:
            pass
    return n


def kind(cmd: str, name: str, driver: int, pid: int) -> str:
    """What a process is, from its command line."""
    if pid == driver:
        return "driver"
    for key, label in (("raylet/raylet", "raylet"), ("gcs_server", "gcs"), ("log_monitor.py", "log monitor"),
                       ("DashboardAgent", "dashboard agent"), ("RuntimeEnvAgent", "runtime env agent"),
                       ("dashboard/dashboard.py", "dashboard head"), ("autoscaler/_private/monitor.py",
                                                                      "autoscaler monitor"),
                       ("ray::Board", "actor"), ("ray::IDLE", "idle workers")):
        if key in cmd or key in name:
            return label
    return "other of the driver's" if name.startswith("ray::") else name


def trainable(config: dict) -> None:
    """A trial that sleeps and reads everyone's CPU but its own."""
    import psutil
    from ray import tune

    from tuner.hostload import HUSH_ENV, hushed

    if config["hush"]:  # as a search hands it to the process that measures
        os.environ[HUSH_ENV] = config["hush"]
    me = os.getpid()
    driver, window_s = config["driver"], config["window_s"]
    time.sleep(3)  # the search's start settles

    tree = {q.pid for q in psutil.Process(driver).children(recursive=True)} | {driver}

    def snap() -> dict[int, tuple[float, int, str]]:
        out = {}
        for p in psutil.process_iter(["pid", "name", "cmdline"]):
            try:
                t = p.cpu_times()
                label = kind(" ".join(p.info["cmdline"] or []), p.info["name"] or "", driver, p.pid)
                out[p.pid] = (t.user + t.system, wakeups(p.pid) if p.pid in tree else 0, label)
            except psutil.Error:
                pass
        return out

    with hushed():
        a, own0, woke0, t0 = snap(), psutil.Process().cpu_times(), wakeups(me), time.perf_counter()
        time.sleep(window_s)
        b, own1, woke1, wall = snap(), psutil.Process().cpu_times(), wakeups(me), time.perf_counter() - t0
    cores: dict[str, float] = {}
    wakes: dict[str, float] = {}
    outside = 0.0
    for pid, (cpu, woke, label) in b.items():
        if pid == me or pid not in a:
            continue
        used = (cpu - a[pid][0]) / wall
        if pid in tree:
            cores[label] = cores.get(label, 0.0) + used
            wakes[label] = wakes.get(label, 0.0) + (woke - a[pid][1]) / wall
        else:
            outside += used
    cores["trial's own process"] = (own1.user + own1.system - own0.user - own0.system) / wall
    wakes["trial's own process"] = (woke1 - woke0) / wall
    tune.report({"cores": json.dumps(cores), "wakes": json.dumps(wakes), "outside": outside})


def one(state: str, window_s: float) -> dict:
    """One measurement in this process: Ray as ``state`` starts it, one Tune trial."""
    import logging

    import ray
    from ray import tune

    from tuner.hardware import usable_cores
    from tuner.hostload import wait_while_timed
    from tuner.localray import start_local_ray, tuner_processes

    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    kwargs = {"logging_level": logging.ERROR, "log_to_driver": False, "configure_logging": True}
    hush = None
    callbacks = []
    if state == "ray_defaults":
        ray.init(address="local", include_dashboard=False, **kwargs)  # never a running head

        class Board:
            def pid(self) -> int:
                return os.getpid()

        actor = ray.remote(Board).options(num_cpus=0).remote()
        ray.get(actor.pid.remote())
    else:
        if state == "hushed":  # Ray's timers, and its autoscaler monitor, as Ray has them
            import tuner.localray

            tuner.localray.QUIET_RAY_PARAMS = {"include_log_monitor": False}
        # quiet: a search whose trials have one rank starts no dashboard head process
        start_local_ray(**kwargs, **({"_system_config": RAYLET_TIMER_DEFAULTS} if state == "hushed"
                                     else {"state_api": False}))
        import tempfile

        hush = tempfile.mkdtemp(prefix="tuner-hush-")

        class Hush(tune.Callback):
            def on_step_end(self, iteration: int, trials: list, **info: object) -> None:
                wait_while_timed(hush)

        callbacks.append(Hush())
    tuner_processes(local=True)  # the daemons at SCHED_IDLE, as in a search
    storage = Path(os.environ.get("TMPDIR", "/tmp")) / f"tuner_cpu_{os.getpid()}"
    trial = tune.with_resources(trainable, {"CPU": usable_cores()})
    res = tune.Tuner(trial, param_space={"driver": os.getpid(), "window_s": window_s, "hush": hush},
                     tune_config=tune.TuneConfig(num_samples=1),
                     run_config=tune.RunConfig(storage_path=str(storage), verbose=0, callbacks=callbacks)).fit()
    metrics = res[0].metrics
    ray.shutdown()
    import shutil

    shutil.rmtree(storage, ignore_errors=True)
    if hush:
        shutil.rmtree(hush, ignore_errors=True)
    return {"state": state, "cores": json.loads(metrics["cores"]), "wakes": json.loads(metrics["wakes"]),
            "outside": metrics["outside"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--one", choices=STATES, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="benchmarks/out/tuner_cpu.json")
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(a.one, a.window_s)), flush=True)
        return

    from common import stamp

    runs: list[dict] = []
    for cycle in range(a.cycles):
        for state in random.sample(STATES, len(STATES)):
            r = subprocess.run([sys.executable, __file__, "--one", state, "--window-s", str(a.window_s)],
                               capture_output=True, text=True, timeout=a.window_s + 180)
            line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"cycle {cycle + 1} {state}: failed\n{r.stderr[-2000:]}", file=sys.stderr)
                continue
            run = json.loads(line[7:])
            run["cycle"] = cycle
            runs.append(run)
            print(f"cycle {cycle + 1} {state:<6}: the tuner's {sum(run['cores'].values()):.4f} cores, "
                  f"{sum(run['wakes'].values()):.0f} wake-ups/s (outside it {run['outside']:.4f} cores)", flush=True)
    kinds = sorted({k for r in runs for k in r["cores"]})
    table, woken = {}, {}
    for state in STATES:
        mine = [r for r in runs if r["state"] == state]
        if not mine:
            continue
        table[state] = {k: statistics.median(r["cores"].get(k, 0.0) for r in mine) for k in kinds}
        table[state]["total"] = statistics.median(sum(r["cores"].values()) for r in mine)
        table[state]["outside"] = statistics.median(r["outside"] for r in mine)
        woken[state] = {k: statistics.median(r["wakes"].get(k, 0.0) for r in mine) for k in kinds}
        woken[state]["total"] = statistics.median(sum(r["wakes"].values()) for r in mine)
    print(f"\n{'process (median)':<24}" + "".join(f"{s + ' cores':>14}{'wakes/s':>9}" for s in table))
    for k in [*kinds, "total", "outside"]:
        print(f"{k:<24}" + "".join(f"{table[s][k]:14.4f}" + (f"{woken[s][k]:9.0f}" if k in woken[s] else " " * 9)
                                   for s in table))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({**stamp(), "window_s": a.window_s, "cycles": a.cycles,
                                       "table": table, "wakeups_per_s": woken, "runs": runs},
                                      indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
