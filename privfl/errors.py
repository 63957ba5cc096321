"""Exceptions that mean "the user asked for something that cannot be done here".

They are kept apart from programming errors so that the command line can print the message and exit with
status 2 instead of showing a traceback. Each subclass also derives from the builtin exception a caller would
naturally catch (``ValueError``, ``FileNotFoundError``), so library users need not know these names.
"""

import errno
import os
from pathlib import Path

from accounting.validation import Checks


class PrivflError(Exception):
    """A user error: bad input or a missing resource. The CLI prints its message and exits with status 2."""


class ConfigError(PrivflError, ValueError):
    """A configuration value is invalid; the message names the value and the valid choices."""


class DataUnavailableError(PrivflError, FileNotFoundError):
    """A data source cannot be read here; the message says where it looked and how to provide the files."""


class StorageError(PrivflError, OSError):
    """A file cannot be written (or read) where the user pointed: the disk is full, the folder read-only or not
    theirs. The message names the path and the fix (free space, then resume)."""


#: The ``errno`` values of an environment fault rather than a bug: the disk or the permissions.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM,
                            errno.EIO})


def is_storage_fault(error: BaseException) -> bool:
    """Whether ``error`` is an :class:`OSError` of the disk or the permissions (:data:`STORAGE_ERRNOS`)."""
    return isinstance(error, OSError) and error.errno in STORAGE_ERRNOS


def storage_message(error: OSError) -> str:
    """``error`` in words: what happened and, where the error names one, to which file."""
    where = f" ({error.filename})" if error.filename else ""
    return f"{error.strerror or error}{where}"


def check_writable(path: "str | os.PathLike[str]", option: str) -> None:
    """Refuse, with :class:`StorageError`, an output file ``path`` (given as ``option``) that cannot be written:
    called before the work whose result goes there, so that nothing is computed (or released) for nothing. Creates
    the missing folders; leaves no file behind."""
    target = Path(path)
    existed = target.exists()
    try:
        if target.is_dir():
            raise IsADirectoryError(errno.EISDIR, "it is a folder", str(target))
        above = next(parent for parent in target.parents if parent.exists())
        if not above.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(above))
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "ab"):
            pass
    except OSError as error:
        raise StorageError(f"{option} {target} cannot be written ({storage_message(error)}); choose another path"
                           ) from None
    if not existed:
        target.unlink(missing_ok=True)


class TrainingDivergedError(PrivflError, ArithmeticError):
    """Training produced non-finite values with these settings (learning rates too high, say): the message names the
    round and the settings to lower. Raised before the server steps, so the last checkpoint stays finite."""


class DataFreeError(Exception):
    """Mixin for an error whose text depends only on configuration and protocol state, never on a client's data.

    A Flower node forwards the text of such an error to the server; every other error text stays on the node (see
    :func:`privfl.engines.flower.client_app.handle`), since a message such as "NaN in 3 rows" or a label range
    describes the client's data outside any ledger.
    """


class PublicConfigError(ConfigError, DataFreeError):
    """A :class:`ConfigError` whose text names only configuration (node and run config, partitions, the protocol's
    messages), never a client's data; a Flower node forwards it to the server."""


class ProtocolStateError(DataFreeError, RuntimeError):
    """A node's client state does not match the round the server expects (lost, or of another run); the text names
    only rounds, client ids and paths, and a Flower node forwards it to the server."""


class InternalError(RuntimeError):
    """A fault inside privfl (a broken protocol state, an impossible round number): a bug, not a user error.

    Deliberately not a :class:`PrivflError`: the command line shows its traceback and asks for a report, where a
    user error gets one line and exit status 2.
    """


#: The shared value checks (:mod:`accounting.validation`), raising :class:`ConfigError`.
check = Checks(ConfigError)
