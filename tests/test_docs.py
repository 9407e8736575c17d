"""The docs match the code."""

import argparse
from pathlib import Path

from tuner.cli import build_parser, knobs_markdown

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_the_knobs_page_is_the_knob_table():
    page = (Path(__file__).parent.parent / "docs" / "knobs.md").read_text()
    start = page.index("<!-- knobs:begin -->\n") + len("<!-- knobs:begin -->\n")
    end = page.index("<!-- knobs:end -->")
    assert page[start:end] == knobs_markdown(), "run: python -m tuner knobs --markdown, paste into docs/knobs.md"


def test_readme_opens_with_the_two_commands():
    block = README.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert block[0].endswith("python -m tuner run search_spaces/quickstart.yaml")
    assert "pytest" in block[1]
    assert (Path(__file__).parent.parent / "search_spaces" / "quickstart.yaml").is_file()


def test_every_command_is_documented():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in sub.choices:
        assert f"python -m tuner {name}" in README, name


def test_the_command_reference_is_the_parser():
    from tuner.clidoc import PAGE, render

    assert PAGE.read_text() == render(), "run: python -m tuner.clidoc (docs/cli.md is generated from cli.py)"
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    page = PAGE.read_text()
    for name, p in sub.choices.items():
        for action in p._actions:
            for flag in ([] if isinstance(action, argparse._HelpAction) else action.option_strings):
                assert f"`{flag}`" in page, (name, flag)


def test_the_readmes_workload_runs_as_written(tmp_path):
    """The README's `my_workload.py`, saved as a user would, loads and takes a training step."""
    import torch

    from tuner.workloads import load_workload

    block = README.split("```python\n# my_workload.py", 1)[1].split("```", 1)[0]
    (tmp_path / "my_workload.py").write_text("# my_workload.py" + block)
    w = load_workload("my_workload.py:make", {"width": 16}, base_dir=tmp_path)
    model, data = w.model(), w.dataset()
    x, y = torch.utils.data.default_collate([data[0], data[1]])
    loss = w.loss(model, (x, y))
    loss.backward()
    w.make_optimizer(model.parameters()).step()
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_the_readmes_schema_names_every_setting():
    """Every field of the `measure:` and `run:` sections, every objective metric and every
    Workload field appear in the README's space file and workload example."""
    import dataclasses

    from tuner.records import OBJECTIVE_METRICS
    from tuner.settings import MeasureSettings, RunPlan
    from tuner.workloads import Workload

    schema = README.split("```yaml\n", 1)[1].split("```", 1)[0]
    missing = [f"measure.{f}" for f in MeasureSettings.model_fields if f"{f}:" not in schema]
    missing += [f"run.{f}" for f in RunPlan.model_fields if f"{f}:" not in schema]
    missing += [f"objective {m}" for m in OBJECTIVE_METRICS if m not in schema]
    snippet = README.split("```python\n# my_workload.py", 1)[1].split("```", 1)[0]
    missing += [f"Workload({f.name}=)" for f in dataclasses.fields(Workload) if f"{f.name}=" not in snippet]
    assert not missing, missing
