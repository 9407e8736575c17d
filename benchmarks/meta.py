"""What every benchmark's JSON opens with: when, on what, and the command that wrote it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def stamp() -> dict:
    from tuner.hardware import describe

    return {"date": time.strftime("%Y-%m-%d %H:%M"), "hardware": describe(),
            "command": " ".join(["python", *sys.argv])}
