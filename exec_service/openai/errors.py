"""Failures as OpenAI's error object (``{"error": {"message", "type", "param", "code"}}``) with the HTTP status
its clients act on: a gRPC status maps to one, and the field a Kiln message names becomes ``param``."""

import re
from dataclasses import dataclass

import grpc

# gRPC status -> (HTTP status, OpenAI error type, OpenAI error code).
_BY_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "invalid_request_error", "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}
_SERVER_ERROR = (500, "server_error", None)
# Kiln's messages start with the field at fault ("top_p: 2.0 is outside (0, 1]", "prompt_ids[3]: ...").
_FIELD = re.compile(r"([a-z_]+)(?:\[\d+\])?(?:\.[a-z_]+)*: ")
# The GenerateRequest field a message names, as the OpenAI parameter the client sent.
_PARAMS = {"prompt_ids": "prompt", "messages": "messages", "stop_token_ids": "stop_token_ids", "model": "model"}


@dataclass
class ApiError(Exception):
    """An error for the HTTP client, already in OpenAI's terms."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> ApiError:
    """A request the gateway refuses itself, before any gRPC call: 400 naming ``param``."""
    return ApiError(400, message, param=param)


def from_rpc_error(exc: grpc.RpcError) -> ApiError:
    """The execute service's status, as the HTTP status and error object OpenAI's clients expect."""
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = (exc.details() if callable(getattr(exc, "details", None)) else "") or code.name
    status, kind, error_code = _BY_STATUS.get(code, _SERVER_ERROR)
    field = _FIELD.match(details)
    param = _PARAMS.get(field.group(1), field.group(1)) if field else None
    if code == grpc.StatusCode.NOT_FOUND and param != "model":
        error_code = None
    return ApiError(status, details, kind, param, error_code)
