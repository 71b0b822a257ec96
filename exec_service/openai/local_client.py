"""The OpenAI endpoint an execute service serves itself (``kiln exec-server --openai-port``): the gateway's app over
the service's own servicer, in its process, with no second hop.

The stand-alone gateway pays a gRPC call per request on top of its HTTP (~1.6–1.9 ms of a lone request's first
token, BENCHMARKS.md); here a request goes from HTTP straight to the servicer, on the HTTP server's event loop. The
checks a gRPC call meets on the way in are the same: the bearer token's role (kiln.rpc.auth.refusal) and every
field's bounds (the servicer's own status_errors), and a refusal is the same status, so the app answers it with the
same HTTP error.
"""

import asyncio
from collections.abc import AsyncGenerator

import grpc

from exec_service.api.servicer import SERVICE_NAME, ExecServicer
from exec_service.openai.exec_client import call_metadata
from kiln.rpc.auth import TokenTable, refusal
from protos import exec_pb2

GENERATE = f"/{SERVICE_NAME}/Generate"
LIST_MODELS = f"/{SERVICE_NAME}/ListModels"


class LocalRpcError(grpc.RpcError):
    """A status from the servicer or the token check, shaped as grpc.aio's errors are (code(), details())."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Context:
    """What Generate and ListModels use of a grpc.aio ServicerContext: abort (kiln.rpc.grpc_server.status_errors)."""

    async def abort(self, code: grpc.StatusCode, details: str = ""):
        raise LocalRpcError(code, details)


class LocalCall:
    """One Generate, iterated as a grpc.aio unary-stream call is; ``cancel()`` ends it (the engine frees its blocks,
    as it does when a gRPC client goes away)."""

    def __init__(self, responses: AsyncGenerator[exec_pb2.GenerateResponse]):
        self._responses = responses
        self._closing: asyncio.Future | None = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> exec_pb2.GenerateResponse:
        return await anext(self._responses)

    def cancel(self) -> None:
        """Close the servicer's stream, which runs its cleanup (engine.abort), soon on this event loop."""
        async def close() -> None:
            try:
                await self._responses.aclose()
            except RuntimeError:  # another task is iterating it: that task's cancellation ends it
                pass

        self._closing = asyncio.ensure_future(close())


class LocalExecClient:
    """The ExecClient the gateway's app calls (exec_service.openai.exec_client), answered by ``servicer`` in this
    process. Tokens are checked against ``tokens`` (the execute service's own), when it has any."""

    target = "this execute service (in process)"

    def __init__(self, servicer: ExecServicer, tokens: TokenTable | None):
        self._servicer = servicer
        self._tokens = tokens

    async def close(self) -> None:
        pass

    def generate(self, request: exec_pb2.GenerateRequest, authorization: str | None) -> LocalCall:
        return LocalCall(self._generate(request, authorization))

    async def _generate(self, request, authorization) -> AsyncGenerator[exec_pb2.GenerateResponse]:
        self._check(GENERATE, authorization)
        async for response in self._servicer.Generate(request, _Context()):
            yield response

    async def list_models(self, authorization: str | None) -> exec_pb2.ListModelsResponse:
        self._check(LIST_MODELS, authorization)
        return await self._servicer.ListModels(exec_pb2.ListModelsRequest(), _Context())

    async def serving(self) -> bool:
        return True  # this process answers: what the gRPC health check's "" service says while it runs

    def _check(self, method: str, authorization: str | None) -> None:
        if self._tokens is None:
            return
        refused = refusal(self._tokens, method, call_metadata(authorization))
        if refused is not None:
            raise LocalRpcError(*refused)
