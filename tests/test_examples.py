"""The worked examples in examples/, as the README runs them: a search, then the export
of its pick (each in a fresh process, as a user types them)."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("name, fmt", [("plain", "python"), ("hf", "hf"), ("lightning", "lightning")])
def test_each_example_runs_and_exports_its_pick(tmp_path, name, fmt):
    run = subprocess.run([sys.executable, "-m", "tuner", "run", str(EXAMPLES / name / "space.yaml"), "--trials", "2",
                          "--results-dir", str(tmp_path), "--quiet"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"python -m tuner export {tmp_path / f'example-{name}'}" in run.stdout  # the next step, printed
    out = tmp_path / "exported.txt"
    export = subprocess.run([sys.executable, "-m", "tuner", "export", str(tmp_path / f"example-{name}"),
                             "--format", fmt, "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    text = out.read_text()
    assert {"python": "CONFIG", "hf": "TrainingArguments", "lightning": "Trainer"}[fmt] in text
    if fmt == "python":  # the exported script trains the example as it is
        trained = subprocess.run([sys.executable, str(out), "--steps", "3"], capture_output=True, text=True,
                                 timeout=300, cwd=tmp_path)
        assert trained.returncode == 0 and "samples/sec:" in trained.stdout, trained.stderr[-2000:]
