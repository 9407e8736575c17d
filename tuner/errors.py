"""Errors the CLI turns into one clear line: exit status 2 (bad input) or 4 (no winner)."""


class UserError(ValueError):
    """Bad input from the user (a space file, a --set, a workload reference).

    The message is one line that names the field and says what is allowed.
    """


class WorkloadError(RuntimeError):
    """The user's workload raised while it was being built or run."""


class NoWinner(RuntimeError):
    """A results folder with no config to pick: no trial yet, or every measurement
    infeasible, screened or disturbed. The message says why and what to do."""
