"""The statistics of timed windows: how much they disagree, the error of their median,
the screening rule and when the windows end a measurement, and which of them are clear
of epoch boundaries. Pure: the search replay draws its windows under the same rules."""

from __future__ import annotations

import math
import statistics
from typing import NamedTuple

import numpy as np

# Windows per measured epoch: one holds the boundary, the next may hold its catch-up, two
# are steady, and the last runs on the batches the workers queued (``steady_windows``).
EPOCH_WINDOWS = 5


class Window(NamedTuple):
    """One timed window, its figures agreed across ranks (``Agree``)."""

    samples: int  # all ranks'
    wall: float  # seconds, the slowest rank's
    paused: float  # seconds the clock stopped at epoch boundaries
    boundaries: int  # epoch boundaries inside the window
    micro_batches: int
    wait: float  # data wait outside the boundaries
    boundaries_before: int  # in the window before (its catch-up may spill into this one)


def spread(values: list[float]) -> float:
    """(max - min) / median: how much the windows disagree."""
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med > 0 else math.inf


def median_error(values: list[float]) -> float:
    """Relative standard error of the median, from the median absolute deviation
    (robust to the odd disturbed window that a shared machine produces)."""
    med = statistics.median(values)
    if med <= 0 or len(values) < 2:
        return math.inf
    mad = statistics.median(abs(v - med) for v in values)
    return 1.2533 * 1.4826 * mad / math.sqrt(len(values)) / med


# Windows a screening decision never reads: the first one after the warm-up is often
# still start-up (workers filling their queues, the allocator growing, the first epoch):
# a config screened on it could be one that read far faster once started.
SCREEN_SKIP = 1


def screen_stop(rates: list[float], screen: dict | None, screen_windows: int) -> bool:
    """Whether a config is out of the running after the windows ``rates`` so far: once
    ``screen_windows`` windows past the start-up one are in, the best of them, raised by
    the noise allowance ``screen["margin"]``, stays below ``screen["below"]``."""
    if not screen or screen_windows <= 0 or len(rates) != SCREEN_SKIP + screen_windows:
        return False
    return max(rates[SCREEN_SKIP:]) * (1 + screen["margin"]) < screen["below"]


def windows_verdict(rates: list[float], screen: dict | None, *, min_windows: int, target_error: float,
                    screen_windows: int, capped: bool = False, steady: bool = True) -> str | None:
    """Whether the windows ``rates`` so far end the measurement, and why: ``screened``
    (out of the running, ``screen_stop``), ``enough`` (``min_windows`` in, and capped or
    precise to ``target_error`` with steady windows among them), ``below_incumbent``
    (precision only matters near the top: a config clearly below the incumbent, by twice
    its own error, is no contender, and more windows would not make it one), or None:
    measure another window. (The search replay draws its windows under the same rules.)"""
    if screen_stop(rates, screen, screen_windows):
        return "screened"
    if len(rates) < min_windows:
        return None
    if capped or (median_error(rates) <= target_error and steady):
        return "enough"
    if screen and statistics.median(rates) * (1 + 2 * median_error(rates)) < screen["below"]:
        return "below_incumbent"
    return None


def steady_windows(kept: list[Window]) -> list[Window]:
    """The kept windows clear of epoch boundaries: each neither holds one, nor follows
    one, nor precedes one. The window before a boundary runs fast: DataLoader workers
    stop at the epoch's last batch, and the training process runs on the batches they
    queued with every core to itself; counted as steady, it would read the run faster
    than the user's whole epochs. The last window's successor is not known yet: it is not counted. (A
    successor that follows a boundary held by a window dropped as disturbed marks this
    one too.)"""
    return [kept[i] for i in _steady(kept)]


def _steady(kept: list[Window]) -> list[int]:
    """The indices of ``steady_windows``."""
    return [i for i, (w, after) in enumerate(zip(kept, kept[1:], strict=False))
            if w.boundaries == 0 and w.boundaries_before == 0
            and after.boundaries == 0 and after.boundaries_before == 0]


def epoch_fit(kept: list[Window], weights: list[float] | None = None) -> tuple[float, float] | None:
    """Steady seconds per sample and the net cost of one epoch boundary, fitted on the
    kept windows; None where fewer than two windows are steady (``steady_windows``).

    Steady time per sample is all samples over all time of the steady windows (not a
    median of window rates: a right-skewed step time would read fast). A boundary costs
    what the windows took beyond that, per boundary: its pause (old workers shut down,
    new ones spawned, the dataset reopened) less the catch-up of the batches the new
    workers then deliver at once, and less the fast steps before it, on the batches the
    old workers queued. That net can be below zero, and is kept so: clipped at zero, a
    noisy steady figure (steps of unequal cost, as batches of one source each make them)
    would count only when slow, and an epoch of the length measured would read below the
    average of all its windows. Unclipped, an epoch as long as those measured reads
    exactly that average, and the steady figure only weighs in the extrapolation to a
    longer one.

    That holds where the windows the cost is fitted on span as many epochs as they hold
    boundaries: from the first window holding a boundary up to the last one, that one
    left out. Fitted on every kept window, the part of an epoch past the last boundary
    would be counted at the steady rate, and the boundary before it would weigh the
    steady figure into the epoch by that part: whether the timed phase ended just after
    a boundary or just before it would move the figure.

    ``weights``: each window's batches' cost per sample over a whole epoch's
    (``length_weights``): its samples then count at that cost, so that the steady
    windows' figure is a whole epoch's, whichever batches they held, and a boundary's
    cost is what its windows took beyond their own batches'."""
    work = weights or [1.0] * len(kept)
    clear = _steady(kept)
    holding = [i for i, w in enumerate(kept) if w.boundaries]
    fitted = range(holding[0], holding[-1]) if len(holding) >= 2 else range(len(kept))
    boundaries = sum(kept[i].boundaries for i in fitted)
    if not boundaries or len(clear) < 2:
        return None
    per_sample = sum(kept[i].wall for i in clear) / sum(kept[i].samples * work[i] for i in clear)
    samples = sum(kept[i].samples * work[i] for i in fitted)
    extra = sum(kept[i].wall for i in fitted) - per_sample * samples
    # (no boundary makes an epoch twice as fast: a bound for a wild steady figure)
    return per_sample, max(extra / boundaries, -0.5 * per_sample * samples / boundaries)


def length_model(elapsed: list[float], longest: list[list[int]]) -> np.ndarray | None:
    """The coefficients ``(a, b, c)`` of each window's time fitted as ``a + b * L + c *
    L**2`` per batch of longest item ``L`` (a fixed cost, work that grows with the padded
    length, attention's that grows with its square; non-negative least squares).
    ``elapsed``: each window's time; ``longest``: the longest item of each batch it ran.
    None where the windows cannot tell the terms apart (fewer than four windows, or
    windows of the same mix, as whole epochs are)."""
    rows = [[len(b), sum(b), sum(x * x for x in b)] for b in longest]
    if len(rows) < 4 or any(r[0] == 0 for r in rows):
        return None
    x, t = np.array(rows, dtype=float), np.array(elapsed, dtype=float)
    scale = np.linalg.norm(x, axis=0)
    xs = x / scale
    if np.linalg.matrix_rank(xs, tol=1e-6) < 2:
        return None
    best: tuple[float, np.ndarray] | None = None
    # non-negative least squares over three terms: the best of the unconstrained fits on
    # each subset of them whose coefficients are all >= 0 (the NNLS solution is one)
    for mask in range(1, 8):
        cols = [j for j in range(3) if mask >> j & 1]
        coef = np.linalg.lstsq(xs[:, cols], t, rcond=None)[0]
        if (coef < 0).any():
            continue
        full = np.zeros(3)
        full[cols] = coef
        residual = float(np.sum((xs @ full - t) ** 2))
        if best is None or residual < best[0]:
            best = (residual, full)
    return None if best is None else best[1] / scale


def batch_cost(coef: np.ndarray, longest: list[int]) -> float:
    """The fitted time (``length_model``) of batches whose longest items are ``longest``."""
    return float(coef @ np.array([len(longest), sum(longest), sum(x * x for x in longest)], dtype=float))


def length_fit(elapsed: list[float], longest: list[list[int]], epoch: list[int]) -> float | None:
    """Seconds per batch over a whole epoch of batches by length, from windows that each
    ran a few of them (``group_by_length``, an epoch longer than the timed phase).

    ``elapsed``: each window's time; ``longest``: the longest item of each batch it ran;
    ``epoch``: the longest item of each batch of a whole epoch. Batches by length cost
    many-fold apart, and the dearest few can carry much of an epoch, so the average of a
    few windows' batches reads whichever batches they drew. Each window's time is fitted
    (``length_model``) and the fit is averaged over the whole epoch's batches: a
    regression estimate, which the measurement makes interpolate by starting every epoch
    on its longest pair. None where the windows cannot tell the terms apart: then the
    windows' own average stands."""
    coef = length_model(elapsed, longest)
    return batch_cost(coef, epoch) / len(epoch) if coef is not None and epoch else None


def length_weights(elapsed: list[float], longest: list[list[int]], boundaries: list[int],
                   epoch: list[int]) -> list[float] | None:
    """Each window's batches' fitted cost per batch over a whole epoch's (``epoch``), for
    ``epoch_fit``'s ``weights``: batches in a random order that pad to their longest item
    cost many-fold apart, and a few steady windows read whichever the seed put there.
    The cost is fitted on the windows that hold no epoch boundary (``boundaries``: each
    window's; a boundary's catch-up is no batch's cost), on every window where fewer
    than four hold none (a search's few windows over shortened epochs); None where the
    fit cannot tell the terms apart."""
    inside = [i for i, n in enumerate(boundaries) if n == 0]
    inside = inside if len(inside) >= 4 else list(range(len(longest)))
    coef = length_model([elapsed[i] for i in inside], [longest[i] for i in inside])
    mean = batch_cost(coef, epoch) / len(epoch) if coef is not None and epoch else 0.0
    if coef is None or mean <= 0:
        return None
    weights = [batch_cost(coef, b) / len(b) / mean for b in longest]
    return weights if all(w > 0 for w in weights) else None
