"""A full disk as one error, whichever library ran into it: the HTTP layer answers it with 507.

safetensors reports the OS error under its own type (`SafetensorError("Error while serializing:
I/O error: No space left on device (os error 28)")`, Rust's `io::Error` text), so its message is
the only place the errno survives.
"""

from __future__ import annotations

import errno
import os
import re

_OS_ERROR_NUMBER = re.compile(r"\(os error (\d+)\)")


class DiskFullError(OSError):
    """No space left on the device (errno ENOSPC)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.strerror)


def os_error_in(error: Exception, what: str) -> OSError | None:
    """The OS error a library's message names ("... (os error N)") while writing `what`, as an
    OSError (a DiskFullError for ENOSPC); None when it names none (then it was not the disk)."""
    match = _OS_ERROR_NUMBER.search(str(error))
    if match is None:
        return None
    number = int(match.group(1))
    message = f"{os.strerror(number)}: could not write {what}"
    return DiskFullError(message) if number == errno.ENOSPC else OSError(number, message)


def as_disk_full(error: OSError, what: str) -> OSError:
    """`error`, or a DiskFullError naming `what` when it is an ENOSPC of another type."""
    if error.errno != errno.ENOSPC or isinstance(error, DiskFullError):
        return error
    return DiskFullError(f"{os.strerror(errno.ENOSPC)}: could not write {what}")
