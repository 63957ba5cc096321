"""Exceptions that mean "the user asked for something that cannot be done here".

They are kept apart from programming errors so that the command line can print the message and exit with
status 2 instead of showing a traceback. Each subclass also derives from the builtin exception a caller would
naturally catch (``ValueError``, ``FileNotFoundError``), so library users need not know these names.
"""


class PrivflError(Exception):
    """A user error: bad input or a missing resource. The CLI prints its message and exits with status 2."""


class ConfigError(PrivflError, ValueError):
    """A configuration value is invalid; the message names the value and the valid choices."""


class DataUnavailableError(PrivflError, FileNotFoundError):
    """A data source cannot be read here; the message says where it looked and how to provide the files."""
