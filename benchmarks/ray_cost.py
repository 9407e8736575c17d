"""What do the tuner's own Ray processes cost the training loop beside them?

A local Ray as a search starts it (``tuner.localray.start_local_ray``: its daemons, an
idle worker; no actor, no log monitor, no metrics), and in the
same process a plain training loop on every core (2 threads on 2 cores: the case where
a process that takes a core for a moment stalls both threads). The loop's windows are
timed with Ray's processes in each of three states, in a random order within every
cycle, so that the VM's drift hits every state alike (the ratios are paired per cycle):

- ``tuner``: as a search leaves them (``tuner.localray.tuner_processes``): the daemons
  (GCS, agents) at SCHED_IDLE (they run on a core nothing else wants, and do
  not preempt the loop when they wake), the raylet and the workers as Ray starts them;
- ``nice10``: the daemons at nice 10 instead, as searches left them
  before (a thread cannot leave SCHED_IDLE without privilege: root only);
- ``all_idle``: every Ray process at SCHED_IDLE, the raylet and the idle workers too
  (what a search could do where a trial may put itself back: root or RLIMIT_NICE >= 20);
- ``stopped``: every Ray process stopped (SIGSTOP): the loop as it runs without Ray, the
  reference.

A few unmeasured steps follow every change of state (what a stopped process catches up
on lands there). Prints the geometric mean of the paired ratios with a 90% interval,
and the CPU Ray's processes used during the windows; writes JSON.

    python benchmarks/ray_cost.py [--workload transformer] [--cycles 40] [--window-s 1.5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="transformer")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cycles", type=int, default=40)
    ap.add_argument("--window-s", type=float, default=1.5)
    ap.add_argument("--out", default="benchmarks/out/ray_cost.json")
    a = ap.parse_args()

    import psutil
    import ray
    import torch
    from common import stamp
    from torch.utils.data import DataLoader

    from tuner.hardware import usable_cores
    from tuner.localray import is_ray_worker, start_local_ray, tuner_processes
    from tuner.workloads import load_workload

    cores = usable_cores()
    # as a search whose trials have one rank starts it: no dashboard head process
    start_local_ray(log_to_driver=False, logging_level="ERROR", num_cpus=cores, state_api=False)
    time.sleep(3)  # the raylet starts its agents and an idle worker in the background
    tuner_processes(local=True)  # the daemons, as in a search
    procs = psutil.Process().children(recursive=True)
    daemons = [p for p in procs if not is_ray_worker(p.name()) and p.name() != "raylet"]
    states = ["tuner", "stopped"] + (["nice10", "all_idle"] if os.geteuid() == 0 else [])
    print(f"Ray's processes: {', '.join(p.name() for p in procs)}; states {states}", flush=True)

    def tids(p: psutil.Process) -> list[int]:
        try:
            return [int(t) for t in os.listdir(f"/proc/{p.pid}/task")]
        except OSError:
            return []

    def set_state(state: str) -> None:
        for p in procs:
            try:
                if state == "stopped":
                    p.suspend()
                    continue
                p.resume()
            except psutil.Error:
                continue
            if p in daemons or state == "all_idle":
                for t in tids(p):
                    try:
                        if state in ("tuner", "all_idle"):
                            os.sched_setscheduler(t, os.SCHED_IDLE, os.sched_param(0))
                        else:  # nice10
                            os.sched_setscheduler(t, os.SCHED_OTHER, os.sched_param(0))
                            os.setpriority(os.PRIO_PROCESS, t, 10)
                    except OSError:
                        pass
            else:  # the raylet and the workers, as Ray starts them
                for t in tids(p):
                    try:
                        os.sched_setscheduler(t, os.SCHED_OTHER, os.sched_param(0))
                    except OSError:
                        pass

    def ray_cpu_s() -> float:
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    torch.set_num_threads(cores)
    wl = load_workload(a.workload, {"size": a.size})
    model, loader = wl.model(), DataLoader(wl.dataset(), batch_size=a.batch, shuffle=True, drop_last=True,
                                           collate_fn=wl.collate)
    opt = wl.make_optimizer(model.parameters())

    def batches():
        while True:
            yield from loader

    it = batches()

    def steps(n: int) -> None:
        for _ in range(n):
            batch = next(it)
            loss = wl.loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    steps(20)
    t0 = time.perf_counter()
    steps(10)
    n = max(5, int(a.window_s / ((time.perf_counter() - t0) / 10)))
    rates: dict[str, list[float]] = {s: [] for s in states}
    ray_cores: dict[str, list[float]] = {s: [] for s in states}
    try:
        for _ in range(a.cycles):
            order = random.sample(states, len(states))
            for state in order:
                set_state(state)
                steps(3)  # settle
                c0, w0 = ray_cpu_s(), time.perf_counter()
                steps(n)
                wall = time.perf_counter() - w0
                rates[state].append(n * a.batch / wall)
                ray_cores[state].append((ray_cpu_s() - c0) / wall)
    finally:
        set_state("tuner")
        ray.shutdown()

    rows = []
    for state in states:
        logs = [math.log(x / y) for x, y in zip(rates[state], rates["stopped"], strict=True)]
        mean = statistics.fmean(logs)
        half = 1.685 * statistics.stdev(logs) / math.sqrt(len(logs)) if state != "stopped" else 0.0
        rows.append({"state": state, "samples_per_sec": statistics.median(rates[state]),
                     "over_stopped": math.exp(mean), "interval_90": [math.exp(mean - half), math.exp(mean + half)],
                     "ray_cores": statistics.median(ray_cores[state]), "windows": rates[state]})
        print(f"{state:<11} {statistics.median(rates[state]):8.1f} samples/s  / stopped {math.exp(mean):.3f} "
              f"(90% {math.exp(mean - half):.3f}-{math.exp(mean + half):.3f})  Ray's processes used "
              f"{statistics.median(ray_cores[state]):.3f} cores", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({**stamp(), "workload": a.workload, "size": a.size,
                                       "batch": a.batch, "cycles": a.cycles, "window_steps": n,
                                       "threads": cores, "states": rows}, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
