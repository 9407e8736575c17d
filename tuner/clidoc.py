"""The command reference, ``docs/cli.md``, generated from the argparse definitions so
that it cannot drift from them (``tests/test_docs.py`` fails when it does).

    python -m tuner.clidoc          # rewrite docs/cli.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest.upper() if action.nargs in ('*', '+') else action.metavar or action.dest}`"
    names = ", ".join(f"`{o}`" for o in action.option_strings)
    if action.nargs == 0:
        return names
    meta = action.metavar or (action.dest.upper() if not action.choices else "{" + ",".join(map(str, action.choices)) + "}")
    meta = " ".join(meta) if isinstance(meta, tuple) else meta
    return f"{names} `{meta}`"


def _help(action: argparse.Action) -> str:
    text = (action.help or "").replace("%(default)s", str(action.default)).replace("|", "\\|")
    if action.default not in (None, False, argparse.SUPPRESS, []) and action.option_strings \
            and "default" not in text:
        text += f" (default: {action.default})"
    return text


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The reference of every command and flag of ``parser`` (the CLI's by default)."""
    if parser is None:
        from tuner.cli import build_parser

        parser = build_parser()
    lines = ["# Command reference", "",
             "Generated from the argparse definitions by `python -m tuner.clidoc`; every command "
             "also answers `--help`. `--debug` (anywhere on the line) shows tracebacks.", ""]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, p in sub.choices.items():
        lines += [f"## {name}", "", helps.get(name) or "", "", "| argument | what |", "|---|---|"]
        for action in p._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            lines.append(f"| {_flags(action)} | {_help(action)} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE}")
