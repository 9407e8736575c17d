"""The files of a results folder, read defensively, and the folder's one-writer lock.

Pure: no Ray, no torch. Every parse or shape failure is a one-line ``UserError``
naming the file (and, for ``trials.jsonl``, the line). A torn *last* line of
``trials.jsonl`` is what a kill mid-write leaves: it is skipped with a one-line
warning, every complete record kept.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tuner.errors import UserError

LOCK = ".lock"
LOCK_INFO = ".lock.json"


def read_trials(path: Path, warn: Any = sys.stderr) -> list[dict]:
    """Every record of ``trials.jsonl``; a torn last line is skipped with a warning."""
    try:
        lines = path.read_text().split("\n")
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file") from None
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == last and not path.read_text().endswith("\n"):
                print(f"warning: {path}:{i + 1}: skipped a torn last line (a search killed mid-write)",
                      file=warn)
                continue
            raise UserError(f"{path}:{i + 1}: not a JSON record ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("config"), dict) \
                or not isinstance(record.get("phase", "search"), str):
            raise UserError(f"{path}:{i + 1}: not a trial record (expected an object with a 'config' mapping)")
        records.append(record)
    return records


def read_json(path: Path) -> dict:
    """A JSON object file (summary.json, meta.json)."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f":{exc.lineno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise UserError(f"{path}{where}: not valid JSON (a torn or hand-edited file?)") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


@contextmanager
def writer_lock(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s one-writer lock (an OS-level lock: it dies with its process,
    so a kill -9 leaves nothing to clean up). A second writer gets a one-line
    UserError naming the holder (pid, host, start time)."""
    from filelock import FileLock, Timeout

    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder / LOCK), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise UserError(f"{folder}: another search is writing here ({holder(folder)}); "
                        f"wait for it, or use another --name") from None
    try:
        (folder / LOCK_INFO).write_text(json.dumps(
            {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}))
        yield
    finally:
        lock.release()


def holder(folder: Path) -> str:
    """Who holds the lock, in words (from the info its holder wrote)."""
    try:
        info = json.loads((folder / LOCK_INFO).read_text())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
        return f"pid {info['pid']} on {info['host']}, started {started}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"
