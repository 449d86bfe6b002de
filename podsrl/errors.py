"""Errors a user can cause. The CLI prints them as one line and exits with code 2 (3 for an unhealthy run); bugs
still raise."""


class UserError(Exception):
    """Bad config, data, path or reward code: the message names the field, file or row."""


class ConfigError(UserError):
    """A config key or value is wrong; the message names the dotted key."""


class DataError(UserError):
    """A dataset file or row is wrong; the message names the file and row."""


class UnhealthyRun(UserError):
    """Training went bad (non-finite losses in a row, or a collapse under train.stop_on_collapse): exit code 3,
    since retrying the same settings fails the same way."""


class WorkerLost(Exception):
    """A worker process of the run (a Ray actor) died or failed more often than its retry bound allows: exit code
    WORKER_LOST (podsrl/exit_codes.py). Not the user's input, and not training gone bad: the run's checkpoints are
    intact, and a resume on a healthy machine may well go on. The message names the worker and its work."""
