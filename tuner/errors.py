"""Errors the CLI turns into one clear line and exit status 2."""


class UserError(ValueError):
    """Bad input from the user (a space file, a --set, a workload reference).

    The message is one line that names the field and says what is allowed.
    """


class WorkloadError(RuntimeError):
    """The user's workload raised while it was being built or run."""
