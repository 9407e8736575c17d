"""The worked examples in examples/, each measured by ``bench`` in a fresh process as a
user types it: a search runs the same loop on the same workload, and the search, its
export and the exported script are tested on other workloads (test_search, test_export)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

EXAMPLES = Path(__file__).parent.parent / "examples"


def _space(tmp_path: Path, name: str) -> Path:
    """The example's space, its workload by absolute path, and no window counted as
    disturbed by the load beside it (under ``pytest -n 2``: another test's)."""
    data = yaml.safe_load((EXAMPLES / name / "space.yaml").read_text())
    data["workload"] = str(EXAMPLES / name / data["workload"])
    data.setdefault("measure", {})["max_interference"] = 1.0
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "hf", "lightning"])
def test_each_example_trains_under_bench(tmp_path, name):
    r = subprocess.run([sys.executable, "-m", "tuner", "bench", str(_space(tmp_path, name)), "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    record = json.loads(r.stdout.strip().splitlines()[-1])
    assert record["samples_per_sec"] > 0 and record["loss_finite"]
