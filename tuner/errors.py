"""Errors the CLI turns into one clear line: exit status 2 (bad input, or a results
folder that cannot be written), 4 (no winner), 5 (the Ray cluster can no longer run a
trial), 130 or 143 (a search stopped by Ctrl-C or SIGTERM)."""

import difflib
import re
import signal
from collections.abc import Iterable


def did_you_mean(name: str, names: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` where one of ``names`` is close to ``name`` (a typo, or
    another library's name for it: ``collate_fn``, ``num_worker``), else ``""``."""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class UserError(ValueError):
    """Bad input from the user (a space file, a --set, a workload reference).

    The message is one line that names the field and says what is allowed.
    """


class KnobRefused(UserError):
    """A knob's value that cannot apply to this workload, whatever the other knobs are
    (a cache of a dataset whose items differ between reads, a fused step for sparse
    gradients): ``values`` lists the refused values, ``at_least`` refuses every value
    from it up. A search does not run another config with such a value."""

    def __init__(self, message: str, knob: str, *, values: list | None = None, at_least: int | None = None):
        super().__init__(message)
        self.knob, self.values, self.at_least = knob, values, at_least

    @property
    def refusal(self) -> dict:
        """What a record keeps of it (JSON): the knob and its refused values."""
        return {"knob": self.knob, **({"values": self.values} if self.values is not None else {}),
                **({"at_least": self.at_least} if self.at_least is not None else {})}


def refuses(refusal: dict, config: dict) -> bool:
    """Whether ``config`` has a value that ``refusal`` (``KnobRefused.refusal``) refuses."""
    value = config.get(refusal["knob"])
    if value in refusal.get("values", []):
        return True
    return refusal.get("at_least") is not None and isinstance(value, int) and value >= refusal["at_least"]


class WorkloadError(RuntimeError):
    """The user's workload raised while it was being built or run."""


class NoWinner(RuntimeError):
    """A results folder with no config to pick: no trial yet, or every measurement
    infeasible, screened or disturbed. The message says why and what to do."""


class Stopped(KeyboardInterrupt):
    """A stop asked for from outside (Ctrl-C: SIGINT, or SIGTERM from a scheduler or
    ``kill``). A KeyboardInterrupt, so that it unwinds through Ray Tune's loop and every
    ``finally`` like Ctrl-C does. ``folder``: the results folder, once known."""

    received: int | None = None  # the signal of the last stop the command's handler raised

    def __init__(self, signum: int, folder: str | None = None):
        super().__init__(signum, folder)
        self.signum, self.folder = signum, folder

    @staticmethod
    def signal_of(exc: KeyboardInterrupt) -> int:
        """The signal behind ``exc``. A Stopped raised while Ray waits in C++ (``ray.get``,
        an actor call) comes back from there as a bare KeyboardInterrupt: Ray's signal
        check maps every KeyboardInterrupt to its own Interrupted status and raises a new
        one. So the handler's record is read first, and SIGINT only where none ran."""
        if isinstance(exc, Stopped):
            return exc.signum
        return Stopped.received or int(signal.SIGINT)

    @staticmethod
    def check() -> None:
        """Raise again a stop the handler raised where it could not unwind: an import
        that swallows it (a Cython module turns an exception in its import into a warning,
        and the handler turns warnings off) would leave the search to run to its end."""
        if Stopped.received is not None:
            raise Stopped(Stopped.received)


class ResultsUnwritable(UserError):
    """The results folder cannot be written (read-only, full disk, quota). The message
    names the file and says what is kept."""


class ClusterFault(RuntimeError):
    """The Ray cluster can no longer run the search's trials (exit 5): the message says
    why, and the ``resume`` that goes on once it can."""


class ClusterShrunk(ClusterFault):
    """No node left in the Ray cluster can hold a trial's resources (the nodes that could
    were lost), and none came back in time. The message says what a trial needs, what is
    left, and that ``resume`` plans its trials for the cluster it then finds."""


class RayMemoryKill(ClusterFault):
    """Ray's memory monitor ended a trial's workers on a node past its memory threshold,
    and Ray Tune stops on that error (it takes it for neither a lost actor nor a task's
    error). The tuner's own local Ray runs without the monitor (``localray``); a
    cluster's nodes run it unless started without."""


def exception_chain(exc: BaseException | None, most: int = 8) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during, outermost first (at most
    ``most``: a chain can loop)."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain and len(chain) < most:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def ray_memory_kill(text: str) -> str | None:
    """What Ray's memory monitor said of the node's memory, where it ended a process
    ("... killed due to the node running low on memory. Memory on the node (...) was
    4.76GB used / 23.54GB limit ..."); None where it did not."""
    if "running low on memory" not in text:
        return None
    use = re.search(r"was ([\d.]+ ?[KMGT]?B used / [\d.]+ ?[KMGT]?B limit)", text)
    return f"the node's memory was {use.group(1)}" if use else "the node's memory ran low"
