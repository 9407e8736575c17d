"""The hot-path check's defects against their fixes: samples/s of the same workload with
the defects the check names (tests/fixtures/hotpath_planted.py) and its clean twin,
measured by ``tuner bench`` in interleaved rounds, with and without ``compile``; and what
the check finds on each side.

    python benchmarks/hotpath_pairs.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import HERE, paired_interval, run_bench, space_file, stamp

FIXTURE = HERE.parent / "tests" / "fixtures" / "hotpath_planted.py"
MEASURE = {"window_s": 0.5, "min_windows": 5, "max_windows": 8}


def findings(clean: bool, compile: str, device: str = "cpu") -> list[dict]:
    from tuner.hotpath import UserCode, check
    from tuner.loop import Trainer
    from tuner.trial import make_request, resolve_config

    req = make_request(workload=f"{FIXTURE}:make", workload_args={"clean": clean}, device=device,
                       config={"compile": compile, "micro_batch_size": 8})
    config, _, workload, device = resolve_config(req)
    result = check(Trainer(workload, config, device), UserCode.of_workload(req.workload))
    return [{"kind": f["kind"], "where": f["where"].rsplit("/", 1)[-1], "per_step": f["per_step"]}
            for f in result["findings"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=str(HERE / "out" / "hotpath_pairs.json"))
    a = ap.parse_args()
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        spaces = {clean: space_file(Path(tmp), f"{FIXTURE}:make", {"clean": clean},
                                    name="clean" if clean else "defects", device=a.device, measure=MEASURE)
                  for clean in (False, True)}
        for compile in ("off", "default"):
            rates: dict[bool, list[float]] = {False: [], True: []}
            for r in range(a.rounds):
                for clean in ((False, True) if r % 2 == 0 else (True, False)):  # interleaved, order alternated
                    rec = run_bench(spaces[clean], {"compile": compile, "micro_batch_size": 8})
                    rates[clean].append(rec["samples_per_sec"])
                    print(f"compile {compile} {'fixed' if clean else 'defects'}: {rec['samples_per_sec']:.1f}",
                          flush=True)
            ratio, lo, hi = paired_interval(rates[True], rates[False])
            pairs.append({"compile": compile, "defects_samples_per_sec": rates[False],
                          "fixed_samples_per_sec": rates[True], "fixed_over_defects": ratio,
                          "interval_90": [lo, hi], "found_with_defects": findings(False, compile, a.device),
                          "found_when_fixed": findings(True, compile, a.device)})
            print(f"compile {compile}: fixed / defects = {ratio:.2f} (90% {lo:.2f}-{hi:.2f})", flush=True)
            # after each pair: a run cut by its time limit keeps the pairs it finished
            out = Path(a.out)
            out.write_text(json.dumps({**stamp(), "workload": "tests/fixtures/hotpath_planted.py", "measure": MEASURE,
                                       "rounds": a.rounds, "pairs": pairs}, indent=1))
            print(f"wrote {out}")


if __name__ == "__main__":
    main()
