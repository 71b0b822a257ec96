"""Errors a client can act on, each bound to the gRPC status code it is reported with."""

import grpc


class KilnError(Exception):
    """Base class: the message is shown to the client as is."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(KilnError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KilnError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KilnError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(KilnError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(KilnError):
    code = grpc.StatusCode.UNAUTHENTICATED


class FailedPrecondition(KilnError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(KilnError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KilnError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(KilnError):
    """Stored bytes that are not what their manifest says: refused, never loaded."""

    code = grpc.StatusCode.DATA_LOSS


class Internal(KilnError):
    code = grpc.StatusCode.INTERNAL


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
