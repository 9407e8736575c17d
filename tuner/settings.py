"""How a config is measured and the run it is projected for: the ``measure:`` and
``run:`` sections of space.yaml. ``spec`` validates them (field errors name the line);
``measure`` consumes them. One definition, one set of defaults."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# Where a trial says it is in its timed windows (``measure.hushed``): set by the Tune
# actor, which never imports torch itself (its trials do, in their own processes), so the
# name lives here and not in ``measure``.
HUSH_ENV = "TUNER_HUSH_DIR"


# Where a trial is before its first step is over, in order (``trial.execute`` says the
# first): what a trial that hangs there reports, and which knobs can matter to the hang.
PHASES = ("building the model and data", "starting the DataLoader", "waiting for the first batch",
          "the first step's compute (forward, backward, compile)")

class Strict(BaseModel):
    """A section of space.yaml: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", strict=False, use_attribute_docstrings=True)


class MeasureSettings(Strict):
    """How a config is measured (the ``measure:`` section of space.yaml)."""

    warmup_steps: int = Field(3, ge=1)
    """Optimizer steps before timing (compile and worker start happen here)."""
    window_s: float = Field(1.0, gt=0)
    """Target seconds per timed window. The step count is derived from the warm-up, and
    from the first window when the warm-up read fast (workers' prefetched batches). Epoch
    boundaries' pauses are not counted, except where epochs are shorter than a window:
    then every window holds boundaries, and this is its wall time."""
    min_windows: int = Field(5, ge=1)
    """The timed phase starts on an epoch start: the first window holds that boundary, the
    second may hold its catch-up, the epoch cost needs two steady windows after them, and
    a window is steady only once the next one shows no boundary (the window before a
    boundary runs on the workers' queued batches: fast where they share the cores)."""
    max_windows: int = Field(12, ge=1)
    target_error: float = Field(0.01, gt=0)
    """Add windows (up to max_windows) while the median's relative standard error,
    estimated robustly from the windows' median absolute deviation, exceeds this.
    (In a search with confirm rounds every measurement stops at min_windows: precision
    comes from the interleaved repeats, ``tuner.policy.measure_settings``.)"""
    epoch_steps: int | None = Field(None, ge=1)
    """Optimizer steps per measured epoch; None: five windows, so that the timed phase
    crosses epoch boundaries and has windows clear of them."""
    max_timed_s: float = Field(60.0, gt=0)
    """Stop adding windows once this much time was timed."""
    screen_windows: int = Field(2, ge=0)
    """Screening: when the search passes a threshold (its incumbent's figure), a config
    whose best of its ``screen_windows`` windows after the first (start-up) one, raised
    by the noise allowance, stays below it stops there, recorded as ``screened``; 0
    never screens. The sampler may measure a screened config again in full when its
    model still predicts it a contender."""
    recheck_after: int = Field(3, ge=0)
    """After this many screened trials in a row, the incumbent is measured again before
    the next trial, and its new figure becomes the threshold: a machine that slowed
    since the incumbent was measured (a VM's host can drift by tens of percent within a
    minute, with no steal to show for it) would otherwise screen out every config after
    it. 0: never."""
    max_interference: float = Field(0.10, gt=0, le=1)
    """A window is disturbed when processes outside the trial (the tuner's own
    included) used more than this share of the machine's cores while no core was
    left idle; it is dropped and measured again (up to max_windows more times)."""
    idle_limit_s: float = Field(20.0, gt=0)
    """Before its first step, a trial whose processes do nothing (no CPU, no I/O, its GPU
    idle) for this long is hung: a DataLoader worker blocked at its start, say. A
    compile, a dataset being opened and workers starting are all busy; raise it where
    the first batch waits longer than this on something outside the machine (a data
    service, a remote store's first byte)."""
    stall_limit_s: float = Field(30.0, gt=0)
    """After its first step, a trial with no step for max(this, 10x its slowest gap
    between steps) is hung: a deadlock in the loss, a worker blocked mid-epoch."""
    max_steal: float = Field(0.25, gt=0, le=1)
    """A window is also disturbed when the hypervisor took more than this share of the
    machine's cores from it (steal time: a neighbour on the host). Less is common on a
    busy VM and only recorded (``steal_cores``); this much halved a window's figure."""


class RunPlan(Strict):
    """The training run a projection is made for (the ``run:`` section)."""

    epochs: int = Field(1, ge=1)
    epoch_size: int | None = Field(None, ge=1)
    """Samples per epoch; None: the dataset's length."""
