"""The gateway's ASGI app: OpenAI's endpoints over an ExecClient.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (whole or streamed as server-sent events), ``GET
/v1/models`` and ``GET /v1/models/{model}`` (the execute service's ready models), ``GET /health`` (200 while an
execute service behind the target answers SERVING, else 503: a readiness probe). Every failure is OpenAI's error
object with its HTTP status.
"""

import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

import grpc
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

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
from tracing.http_server_spans import traced_http

log = logging.getLogger(__name__)

MAX_AUTHORIZATION_CHARS = 4096
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}", "/health")


def build_app(client_factory: Callable[[], ExecClient], metrics: GatewayMetrics | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, limits: HttpLimits = DEFAULT_LIMITS,
              cors_origins: tuple[str, ...] = ()):
    """The app; ``client_factory`` makes the ExecClient on the server's event loop when the app starts; a body over
    ``max_request_bytes``, or slower than ``limits`` allow, is refused before it is parsed. Pages from
    ``cors_origins`` may call it from a browser (Starlette's CORS middleware answers their preflight requests).
    With tracing on, each request is a server span continuing its client's trace (tracing.http_server_spans).

    Starlette's routes, not FastAPI's: its dependency solving and request wrapping, which nothing here uses, were
    ~40% of the app's own CPU before a streamed request's first chunk (~30 µs of ~80); the bodies are pydantic models
    all the same."""

    @asynccontextmanager
    async def lifespan(app: Starlette):
        app.state.client = client_factory()
        log.info("OpenAI gateway in front of %s", app.state.client.target)
        try:
            yield
        finally:
            await app.state.client.close()

    async def health(request: Request) -> JSONResponse:
        if await request.app.state.client.serving():
            return JSONResponse({"status": "ok"})
        raise ApiError(503, "no execute service behind this gateway answers its health check SERVING",
                       "server_error", code="service_unavailable")

    async def ready_models(request: Request) -> list[dict]:
        try:
            listed = await request.app.state.client.list_models(_authorization(request))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return [{"id": m.name, "object": "model", "created": 0, "owned_by": "kiln",
                 "max_model_len": m.sizing.max_model_len}
                for m in listed.models if m.state == exec_pb2.MODEL_STATE_READY]

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": await ready_models(request)})

    async def model(request: Request) -> JSONResponse:
        """One ready model (the SDK's ``models.retrieve``), or 404 as OpenAI answers a model it does not serve."""
        name = request.path_params["model"]
        for listed in await ready_models(request):
            if listed["id"] == name:
                return JSONResponse(listed)
        raise ApiError(404, f"model: no ready model named {name[:200]!r}", param="model", code="model_not_found")

    async def completions(request: Request):
        body = await _parsed(request, CompletionRequest)
        return await _answer(request, body, chat=False, want_logprobs=body.logprobs is not None)

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
        endpoint = request.scope["path"]
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
        return JSONResponse(answer)

    async def _timed(events, endpoint: str, started: float):
        async for item in events:
            yield item
        if metrics is not None:
            metrics.finished(endpoint, time.perf_counter() - started)

    routes = [Route("/health", health, methods=["GET"]), Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{model}", model, methods=["GET"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error})
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes, timeout_s=limits.body_timeout_s,
                       budget_bytes=limits.buffered_bodies * max_request_bytes)
    if cors_origins:  # no cookies: a page's calls carry their bearer token in Authorization, as any client's
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    if metrics is not None:
        app.add_middleware(_CountResponses, metrics=metrics)  # added last, so it runs first: a 413 is counted too
    return traced_http(app, lambda scope: f"{scope.get('method', 'HTTP')} {_endpoint(scope.get('path', ''))}")


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such path, a method a path does not take) in OpenAI's shape."""
    message = f"{request.method} {request.scope['path']}: {exc.detail}"
    return JSONResponse(ApiError(exc.status_code, message, code=exc.detail.lower().replace(" ", "_")).body(),
                        status_code=exc.status_code, headers=exc.headers)


async def _parsed(request: Request, model: type[BaseModel]) -> SamplingFields:
    """The body as ``model``, validated by pydantic straight from its bytes (decoding the JSON in Python first, then
    validating the objects, costs ~0.15 ms more per request); a refusal names the first field at fault."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from None


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
        path = _endpoint(scope["path"])

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.request_done(path, message["status"])
            await send(message)

        await self.app(scope, receive, counted)


def _endpoint(path: str) -> str:
    """The metrics label of a request's path: one of ENDPOINTS, or ``other`` (the labels stay bounded)."""
    if path.startswith("/v1/models/") and "/" not in path.removeprefix("/v1/models/"):
        return "/v1/models/{model}"
    return path if path in ENDPOINTS else "other"


def _authorization(request: Request) -> str | None:
    """The client's ``Authorization`` header, passed to the execute service as the call's bearer token."""
    value = request.headers.get("authorization")
    if value is None:
        return None
    if len(value) > MAX_AUTHORIZATION_CHARS or not value.startswith("Bearer "):
        raise ApiError(401, "Authorization: expected 'Bearer <token>'", code="invalid_api_key")
    return value
