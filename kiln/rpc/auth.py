"""Bearer tokens with roles, checked on every call before it reaches a servicer; health and reflection stay open.

``admin`` may do what changes a server (Compile, DeleteArtifact, LoadModel, UnloadModel) and everything ``user``
may; ``user`` may read and generate (Generate, ListModels, GetForwardStats, ListArtifacts, GetArtifact). A method
in neither list needs ``admin``. A missing or unknown token is UNAUTHENTICATED, a token of too small a role
PERMISSION_DENIED. Tokens are compared as sha256 digests in constant time and never logged or echoed.
"""

import hashlib
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

ADMIN = "admin"
USER = "user"
ROLES = (ADMIN, USER)
MIN_TOKEN_CHARS = 16
HEADER = "authorization"
SCHEME = "Bearer "

USER_METHODS = frozenset({
    "/kiln.v1.ExecService/Generate", "/kiln.v1.ExecService/ListModels", "/kiln.v1.ExecService/GetForwardStats",
    "/kiln.v1.CompileService/ListArtifacts", "/kiln.v1.CompileService/GetArtifact",
})
ADMIN_METHODS = frozenset({
    "/kiln.v1.CompileService/Compile", "/kiln.v1.CompileService/DeleteArtifact",
    "/kiln.v1.ExecService/LoadModel", "/kiln.v1.ExecService/UnloadModel",
})
# Probes and tooling must work without a token: health checks (compose, Kubernetes) and reflection (grpcurl).
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


class TokenFileError(ValueError):
    """The token file is missing, unreadable or malformed; the message says which line (never the token)."""


def required_role(method: str) -> str | None:
    """The least role that may call ``method``; None for the open ones."""
    if method.startswith(OPEN_PREFIXES):
        return None
    return USER if method in USER_METHODS else ADMIN


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    role: str


class TokenTable:
    """The tokens a server accepts, each with its role: lines ``ROLE TOKEN`` in a file, ``#`` starts a comment."""

    def __init__(self, entries: list[tuple[str, str]]):
        self._entries = [_Entry(hashlib.sha256(token.encode()).digest(), role) for role, token in entries]

    @classmethod
    def load(cls, path: str | Path) -> "TokenTable":
        path = Path(path).expanduser()
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenFileError(f"token file {path}: {getattr(exc, 'strerror', None) or exc}") from None
        entries = []
        for number, line in enumerate(lines, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) != 2 or fields[0] not in ROLES:
                raise TokenFileError(f"token file {path} line {number}: expected 'ROLE TOKEN' with ROLE one of "
                                     f"{', '.join(ROLES)}")
            if len(fields[1]) < MIN_TOKEN_CHARS:
                raise TokenFileError(f"token file {path} line {number}: a token needs {MIN_TOKEN_CHARS} characters "
                                     f"or more")
            entries.append((fields[0], fields[1]))
        if not entries:
            raise TokenFileError(f"token file {path}: no token in it")
        return cls(entries)

    def role_of(self, token: str) -> str | None:
        """The role of ``token``, or None; every entry is compared, so the time says nothing about which matched."""
        digest = hashlib.sha256(token.encode()).digest()
        role = None
        for entry in self._entries:
            if hmac.compare_digest(digest, entry.digest):
                role = entry.role
        return role


def allows(role: str, method: str) -> bool:
    needed = required_role(method)
    return needed is None or role == ADMIN or (role == USER and needed == USER)


def bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key == HEADER and isinstance(value, str) and value.startswith(SCHEME):
            return value[len(SCHEME):].strip()
    return None


def refusal(tokens: TokenTable, method: str, metadata) -> tuple[grpc.StatusCode, str] | None:
    """Why a call of ``method`` with ``metadata`` is refused (its status and message), or None when it may go on:
    the one check of the gRPC interceptor and of the OpenAI endpoint an execute service serves itself."""
    needed = required_role(method)
    if needed is None:
        return None
    token = bearer_token(metadata)
    if token is None:
        return (grpc.StatusCode.UNAUTHENTICATED,
                f"{method} needs a bearer token ('{HEADER}: {SCHEME}...'; the CLI sends KILN_AUTH_TOKEN)")
    role = tokens.role_of(token)
    if role is None:
        log.warning("refused %s: unknown token", method)
        return grpc.StatusCode.UNAUTHENTICATED, f"{method}: the token is not valid here"
    if not allows(role, method):
        log.warning("refused %s: a %s token, %s needed", method, role, needed)
        return grpc.StatusCode.PERMISSION_DENIED, f"{method} needs an {needed} token; this one is {role}"
    return None


class TokenAuth(grpc.aio.ServerInterceptor):
    """Refuses a call without a valid token of a sufficient role before its handler runs."""

    def __init__(self, tokens: TokenTable):
        self.tokens = tokens

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        refused = refusal(self.tokens, details.method, details.invocation_metadata) if handler is not None else None
        return handler if refused is None else _refusal(handler, *refused)


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only aborts with ``code``."""

    async def unary(request, context):
        await context.abort(code, message)

    async def streaming(request, context):
        await context.abort(code, message)
        yield  # never reached: makes this an async generator, as a streaming handler must be

    kinds = {
        (False, False): (grpc.unary_unary_rpc_method_handler, unary),
        (False, True): (grpc.unary_stream_rpc_method_handler, streaming),
        (True, False): (grpc.stream_unary_rpc_method_handler, unary),
        (True, True): (grpc.stream_stream_rpc_method_handler, streaming),
    }
    make, behaviour = kinds[(handler.request_streaming, handler.response_streaming)]
    # No request deserializer: a refused caller's message stays bytes, never parsed.
    return make(behaviour, response_serializer=handler.response_serializer)
