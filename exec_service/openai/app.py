"""The gateway's ASGI app: OpenAI's endpoints over an ExecClient.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (whole or streamed as server-sent events), ``GET
/v1/models`` (the execute service's ready models), ``GET /health`` (200 while an execute service behind the
target answers SERVING, else 503: a readiness probe). Every failure is OpenAI's error object with its HTTP status.
"""

import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from exec_service.openai.body_limit import BodyLimit
from exec_service.openai.errors import ApiError, from_rpc_error
from exec_service.openai.exec_client import ExecClient, merged
from exec_service.openai.gateway_metrics import GatewayMetrics
from exec_service.openai.http_limits import DEFAULT_LIMITS, HttpLimits
from exec_service.openai.requests import ChatCompletionRequest, CompletionRequest, SamplingFields
from exec_service.openai.responses import Completion
from exec_service.openai.streaming import ChunkStream, EventStream
from kiln.rpc.grpc_server import DEFAULT_MAX_REQUEST_BYTES
from protos import exec_pb2

log = logging.getLogger(__name__)

MAX_AUTHORIZATION_CHARS = 4096
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health")


def build_app(client_factory: Callable[[], ExecClient], metrics: GatewayMetrics | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, limits: HttpLimits = DEFAULT_LIMITS) -> FastAPI:
    """The app; ``client_factory`` makes the ExecClient on the server's event loop when the app starts; a body over
    ``max_request_bytes``, or slower than ``limits`` allow, is refused before it is parsed."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.client = client_factory()
        log.info("OpenAI gateway in front of %s", app.state.client.target)
        try:
            yield
        finally:
            await app.state.client.close()

    app = FastAPI(title="Kiln OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid')}" if param else first.get("msg", "invalid request body")
        return JSONResponse(ApiError(400, message, param=param).body(), status_code=400)

    app.add_middleware(BodyLimit, max_bytes=max_request_bytes, timeout_s=limits.body_timeout_s,
                       budget_bytes=limits.buffered_bodies * max_request_bytes)
    if metrics is not None:
        app.add_middleware(_CountResponses, metrics=metrics)  # added last, so it runs first: a 413 is counted too

    @app.get("/health")
    async def health(request: Request):
        if await request.app.state.client.serving():
            return {"status": "ok"}
        raise ApiError(503, "no execute service behind this gateway answers its health check SERVING",
                       "server_error", code="service_unavailable")

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            listed = await request.app.state.client.list_models(_authorization(request))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return {"object": "list", "data": [
            {"id": m.name, "object": "model", "created": 0, "owned_by": "kiln", "max_model_len": m.sizing.max_model_len}
            for m in listed.models if m.state == exec_pb2.MODEL_STATE_READY]}

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        body = await _parsed(request, CompletionRequest)
        return await _answer(request, body, chat=False, want_logprobs=body.logprobs is not None)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        body = await _parsed(request, ChatCompletionRequest)
        return await _answer(request, body, chat=True, want_logprobs=body.logprobs)

    async def _answer(request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool,
                      want_logprobs: bool):
        client: ExecClient = request.app.state.client
        generate_requests = body.generate_requests()
        authorization = _authorization(request)
        started = time.perf_counter()
        responses = merged([client.generate(r, authorization) for r in generate_requests])
        try:
            first = await anext(responses)  # the first token, or the status that decides the HTTP one
        except grpc.RpcError as exc:
            await responses.aclose()
            raise from_rpc_error(exc) from None
        except StopAsyncIteration:
            raise ApiError(502, "the execute service ended the stream without a response", "server_error") from None
        endpoint = request.url.path
        if metrics is not None:
            first_s = time.perf_counter()
            metrics.first_token(endpoint, first_s - started)
            responses = metrics.gaps(endpoint, first, first_s, responses)
        if body.stream:
            stream = ChunkStream(body.n, chat, body.model, want_logprobs, body.include_usage, body.return_token_ids)
            return EventStream(_timed(stream.events(first, responses), endpoint, started))
        answer = await _whole(body, chat, want_logprobs, first, responses)
        if metrics is not None:
            metrics.finished(endpoint, time.perf_counter() - started)
        return answer

    async def _timed(events, endpoint: str, started: float):
        async for item in events:
            yield item
        if metrics is not None:
            metrics.finished(endpoint, time.perf_counter() - started)

    return app


def _body_schema(model: type[BaseModel]) -> dict:
    """The request body's schema in the OpenAPI document, as FastAPI writes it for a model parameter."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


async def _parsed(request: Request, model: type[BaseModel]) -> SamplingFields:
    """The body as ``model``, validated by pydantic straight from its bytes (FastAPI's model parameter decodes the
    JSON in Python first, then validates the objects: ~0.15 ms more per request); refused as FastAPI refuses it."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


async def _whole(body: SamplingFields, chat: bool, want_logprobs: bool, first, responses) -> dict:
    completion = Completion(body.n, chat, body.model, want_logprobs, body.return_token_ids)
    completion.add(*first)
    try:
        async for prompt, response in responses:
            completion.add(prompt, response)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
    return completion.body()


class _CountResponses:
    """Counts each HTTP answer by endpoint and status as its headers go out. Plain ASGI: Starlette's
    BaseHTTPMiddleware would relay every streamed chunk through a queue of its own."""

    def __init__(self, app, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in ENDPOINTS else "other"  # bounded labels

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.request_done(path, message["status"])
            await send(message)

        await self.app(scope, receive, counted)


def _authorization(request: Request) -> str | None:
    """The client's ``Authorization`` header, passed to the execute service as the call's bearer token."""
    value = request.headers.get("authorization")
    if value is None:
        return None
    if len(value) > MAX_AUTHORIZATION_CHARS or not value.startswith("Bearer "):
        raise ApiError(401, "Authorization: expected 'Bearer <token>'", code="invalid_api_key")
    return value
