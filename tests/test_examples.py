"""The worked examples in examples/, as the README runs them, each command in a fresh
process as a user types it: the plain one searched, exported and its export trained; the
Hugging Face and Lightning ones measured by ``bench`` (their searches run the same loop)."""

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
def test_the_plain_example_searches_exports_and_its_export_trains(tmp_path):
    run = subprocess.run([sys.executable, "-m", "tuner", "run", str(_space(tmp_path, "plain")), "--trials", "2",
                          "--results-dir", str(tmp_path), "--quiet"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    folder = tmp_path / "example-plain"
    assert f"python -m tuner export {folder}" in run.stdout  # the next step, printed
    script = tmp_path / "train_tuned.py"
    export = subprocess.run([sys.executable, "-m", "tuner", "export", str(folder), "--format", "python",
                             "-o", str(script)], capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    trained = subprocess.run([sys.executable, str(script), "--steps", "3"], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)
    assert trained.returncode == 0 and "samples/sec:" in trained.stdout, trained.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf", "lightning"])
def test_the_framework_examples_train_under_bench(tmp_path, name):
    r = subprocess.run([sys.executable, "-m", "tuner", "bench", str(_space(tmp_path, name)), "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    record = json.loads(r.stdout.strip().splitlines()[-1])
    assert record["samples_per_sec"] > 0 and record["loss_finite"]
