"""Screening: the incumbent's figure and noise that a trial is held against, and the
recheck of the incumbent after screened trials in a row (``Board``)."""

from __future__ import annotations

import json
import statistics

from tuner.records import with_cold_compile

BOARD_KEY = "tuner_board"  # the Board's state in a Tune trial's config (JSON)

# The least allowance a screening figure gets. One config's figure moves between trials
# more than its windows move within one (a trial's own level: where its DataLoader
# workers land, the state of the allocator, the machine's drift): on a 2-core machine
# configs screened out in a live search read 9-13% above their screening figures when
# measured again alone, and one of them was within 3% of the pick. Replayed, 10% against
# 5% keeps the picks at or above stock TPE's on every landscape and lowers the false
# negatives on each (bert 3.7% to 2.5%, transformer 2.8% to 1.0% at 12 configs), for
# 5-20% fewer configs screened.
MIN_MARGIN = 0.10


class Board:
    """What a trial needs to know of the search so far, for screening: the incumbent's
    figure and the noise seen so far; and the cold compile cost of each compile group.
    The driver holds it, updates it as results land, and hands its state to each Tune
    trial in the trial's config (``BOARD_KEY``) as Optuna's suggestion is made, just
    before the trial starts (the trainable's parameters are fixed when Tune starts).
    It was once a Ray actor that trials asked: an idle actor's process used 0.006-0.011
    cores beside every trial here (Ray's core worker timers), out of the trial's cores.

    The rule is Optuna's ThresholdPruner with a threshold that moves with the
    incumbent, applied inside the trial process between windows (``measure``), where
    stopping costs nothing: a Tune scheduler would stop the trial by killing its actor,
    and with it the process that measures.

    The threshold is a figure from the past. After ``recheck_after`` screened trials in
    a row, the next trial first measures the incumbent again (phase ``recheck``), and
    that figure becomes the threshold: on a machine that slowed since, the incumbent
    reads lower too. (In a conv search here the VM slowed 30% after the first trial and
    screened out the 10 trials after it, among them the config a stock search picked,
    which re-measured 1.3x the tuner's pick.)
    """

    def __init__(self, min_margin: float = MIN_MARGIN, screening: bool = True, recheck_after: int = 0):
        self.best: float | None = None
        self.incumbent: dict | None = None  # the config behind ``best``
        self.errors: list[float] = []
        self.min_margin = min_margin
        self.screening = screening
        self.recheck_after = recheck_after
        self.screened_in_a_row = 0
        self.cold: dict[str, float] = {}  # compile group -> the compile its first trial paid
        self.best_error = 0.0

    def update(self, record: dict) -> None:
        if record.get("compile_cache") == "cold" and record.get("compile_s") is not None:
            self.cold.setdefault(record.get("compile_group"), record["compile_s"])
        ok = record.get("status") == "ok" and not record.get("disturbed")
        value = record.get("samples_per_sec")
        if record.get("phase") == "recheck":
            if ok and value is not None:
                self.best = value  # the incumbent as the machine runs it now
            return
        if ok and record.get("screened"):
            self.screened_in_a_row += 1
        if not ok or record.get("screened"):
            return
        self.screened_in_a_row = 0
        if value is not None and (self.best is None or value > self.best):
            self.best, self.incumbent = value, record.get("config")
            self.best_error = record.get("samples_per_sec_error") or 0.0
        if record.get("samples_per_sec_error") is not None:
            self.errors.append(record["samples_per_sec_error"])

    def screen(self, recheck: bool = True) -> dict | None:
        """The threshold for the next trial, or None before any full measurement.
        The allowance is 3x the median window error seen so far, at least min_margin
        (``MIN_MARGIN``: drift between trials exceeds one measurement's own error),
        plus twice the incumbent's own error.
        ``recheck``: the incumbent's config, to measure before the trial (once per run
        of ``recheck_after`` screened trials; not with ``recheck=False``, when there is no
        time left for it)."""
        if self.best is None or not self.screening:
            return None
        margin = max(self.min_margin, 3 * statistics.median(self.errors)) if self.errors else 2 * self.min_margin
        # The incumbent is the highest of several noisy figures, so likely one read high:
        # its own error widens the allowance (replayed, this took the share of screened
        # configs within 3% of the pick from 4-10% to at most 3.4% on every landscape).
        margin += 2 * self.best_error
        out: dict = {"below": self.best, "margin": margin}
        if recheck and self.recheck_due():
            out["recheck"] = self.incumbent
            self.screened_in_a_row = 0  # asked once: concurrent trials do not all re-measure it
        return out

    def recheck_due(self) -> bool:
        """Whether the next screened trial first measures the incumbent again."""
        return bool(self.screening and self.best is not None and self.recheck_after
                    and self.screened_in_a_row >= self.recheck_after and self.incumbent is not None)

    def state(self, screen: bool = True, recheck: bool = True) -> str:
        """What a trial gets (``BOARD_KEY``): the screen (none for a config measured in
        full again after it was screened), and the cold compile costs."""
        return json.dumps({"screen": self.screen(recheck) if screen else None, "cold": self.cold})


def with_compile_cost(record: dict, cold: dict[str, float]) -> dict:
    """A warm-cache trial's record with its group's cold compile cost (``projected_run_s``
    keeps what a user's first run pays)."""
    if record.get("compile_cache") == "warm":
        return with_cold_compile(record, cold.get(record.get("compile_group") or ""))
    if record.get("compile_cache") == "cold":
        return with_cold_compile(record, None)
    return record


def rescreen(screen: dict, recheck: dict) -> dict:
    """The screen after the incumbent was measured again (``Board.update`` on a recheck,
    done in the trial: the incumbent as the machine runs it now, where that
    measurement is sound)."""
    screen = {k: v for k, v in screen.items() if k != "recheck"}
    value = recheck.get("samples_per_sec")
    if recheck.get("status") == "ok" and not recheck.get("disturbed") and value is not None:
        screen["below"] = value
    return screen
