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
