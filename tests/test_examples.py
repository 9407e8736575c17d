"""The worked examples in examples/, each searched and its pick exported in fresh processes,
as the README says a user does (the exported formats' own behaviour: test_export)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import FAST_MEASURE, UNDISTURBED

EXAMPLES = Path(__file__).parent.parent / "examples"


def _space(tmp_path: Path, name: str) -> Path:
    """The example's space, its workload by absolute path, the suite's short windows, no
    window counted as disturbed by the load beside it (under ``pytest -n 3``: other
    tests'), and no confirm rounds or hot-path check (test_search's): the search, the pick
    and its export are what is checked here."""
    data = yaml.safe_load((EXAMPLES / name / "space.yaml").read_text())
    data["workload"] = str(EXAMPLES / name / data["workload"])
    data["measure"] = {**data.get("measure", {}), **FAST_MEASURE, **UNDISTURBED}
    data["confirm"] = {"top": 0}
    data["hot_path"] = False
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name, fmt, says", [
    ("plain", "python", "def main"),
    ("hf", "hf", "TrainingArguments"),
    ("lightning", "lightning", "Trainer"),
])
def test_each_example_searches_and_exports_its_pick(tmp_path, name, fmt, says):
    """As the README's table says to: `run` (one config past the baseline: the search's
    choices are test_search's), then `export`."""
    results = tmp_path / "results"
    run = subprocess.run([sys.executable, "-m", "tuner", "run", str(_space(tmp_path, name)), "--trials", "1",
                          "--results-dir", str(results), "--quiet"],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    out = results / f"example-{name}"
    assert f"next: python -m tuner export {out}" in run.stdout
    best = subprocess.run([sys.executable, "-m", "tuner", "export", str(out), "-o", str(tmp_path / "best.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert best.returncode == 0, best.stderr[-2000:]
    picked = yaml.safe_load((tmp_path / "best.yaml").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert picked["config"] == summary["best"]["config"]
    pasted = subprocess.run([sys.executable, "-m", "tuner", "export", str(out), "--format", fmt],
                            capture_output=True, text=True, timeout=120)
    assert pasted.returncode == 0 and says in pasted.stdout, pasted.stderr[-2000:]
    if fmt == "python":  # the exported script trains, in the user's own process
        script = tmp_path / "train_tuned.py"
        script.write_text(pasted.stdout)
        trained = subprocess.run([sys.executable, str(script), "--steps", "5"], capture_output=True, text=True,
                                 timeout=300, cwd=tmp_path)
        assert trained.returncode == 0, trained.stderr[-2000:]
