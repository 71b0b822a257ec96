"""Errors a client can act on, each bound to the name of the gRPC status code it is reported with.

The code is a name (``grpc.StatusCode[code]`` at the RPC edge), so the engine and everything below the edge raise
these without importing grpc."""

import errno


class KilnError(Exception):
    """Base class: the message is shown to the client as is."""

    code = "INTERNAL"


class InvalidArgument(KilnError):
    code = "INVALID_ARGUMENT"


class NotFound(KilnError):
    code = "NOT_FOUND"


class AlreadyExists(KilnError):
    code = "ALREADY_EXISTS"


class PermissionDenied(KilnError):
    code = "PERMISSION_DENIED"


class Unauthenticated(KilnError):
    code = "UNAUTHENTICATED"


class FailedPrecondition(KilnError):
    code = "FAILED_PRECONDITION"


class DeadlineExceeded(KilnError):
    """The call's deadline passed while it waited (for a lock another request holds): the worker gives up too."""

    code = "DEADLINE_EXCEEDED"


class ResourceExhausted(KilnError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(KilnError):
    code = "UNAVAILABLE"


class DataLoss(KilnError):
    """Stored bytes that are not what their manifest says: refused, never loaded."""

    code = "DATA_LOSS"


class Internal(KilnError):
    code = "INTERNAL"


# Client input quoted in a status message is cut to this many characters: a long name must not turn the real error
# into a trailer too large for gRPC's metadata limit.
QUOTE_CHARS = 200


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` for a status message, cut to ``limit`` characters with how much was left out."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def first_line(exc: BaseException) -> str:
    """The cause of a failure in one line, for a status message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# A write the disk refused: full (or over a quota or file-size limit), or not writable at all.
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}


def resource_error(exc: BaseException, what: str) -> KilnError | None:
    """The status a failure deserves when the disk or memory caused it, not Kiln; None when neither did.

    Follows the exception's causes: torch and Inductor wrap the OSError or allocation failure they hit. ``what``
    says what was being done, e.g. "compile" or "download into the cache /var/cache/kiln".
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            return ResourceExhausted(f"{what}: the disk is full at {exc.filename or 'a write'} ({exc.strerror}); "
                                     f"free space there")
        if isinstance(exc, OSError) and exc.errno in _NOT_WRITABLE:
            return FailedPrecondition(f"{what}: {exc.filename or 'a path'} is not writable ({exc.strerror}); the "
                                      f"operator must make it writable")
        if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or (
                isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)):
            return ResourceExhausted(f"{what}: out of memory: {first_line(exc)}")
        exc = exc.__cause__ or exc.__context__
    return None
