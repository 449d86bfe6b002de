"""Errors a user can cause. The CLI prints them as one line and exits with code 2; bugs still raise."""


class UserError(Exception):
    """Bad config, data, path or reward code: the message names the field, file or row."""


class ConfigError(UserError):
    """A config key or value is wrong; the message names the dotted key."""


class DataError(UserError):
    """A dataset file or row is wrong; the message names the file and row."""
