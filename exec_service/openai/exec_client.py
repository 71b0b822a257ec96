"""The gateway's only gRPC: Generate, ListModels and the health check against one or more execute services.

One channel for the gateway's life, balanced round-robin over every address its target resolves to: a list
(``ipv4:10.0.0.1:50052,10.0.0.2:50052``) or a DNS name with one record per replica (``dns:///exec:50052``, a
Kubernetes headless Service), so each request goes to the next replica. TLS as every Kiln client has it; the
bearer token is the HTTP client's, passed through per call, so the execute service's roles decide what it may do.
"""

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.rpc.auth import HEADER
from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from kiln.rpc.tls import ClientTls
from protos import exec_pb2, exec_pb2_grpc
from tracing.grpc_instrumentation import instrumented_aio_channel

# How often a DNS target is resolved again at most, so replicas added behind the name start receiving requests.
DNS_REFRESH_MS = 10_000
HEALTH_TIMEOUT_S = 5.0


def channel_options(server_name: str | None = None) -> list[tuple]:
    options = [*CHANNEL_OPTIONS, ("grpc.lb_policy_name", "round_robin"),
               ("grpc.dns_min_time_between_resolutions_ms", DNS_REFRESH_MS)]
    if server_name:  # the name in the replicas' certificate, where the target is a list of addresses
        options += [("grpc.ssl_target_name_override", server_name), ("grpc.default_authority", server_name)]
    return options


class ExecClient:
    """Calls on the execute services behind ``target``. Create and use it on one event loop."""

    def __init__(self, target: str, tls: ClientTls | None = None, server_name: str | None = None):
        self.target = target
        self._channel = instrumented_aio_channel(target, channel_options(server_name),
                                                 credentials=tls.credentials() if tls else None)
        self._exec = exec_pb2_grpc.ExecServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    def generate(self, request: exec_pb2.GenerateRequest, authorization: str | None) -> grpc.aio.UnaryStreamCall:
        return self._exec.Generate(request, metadata=call_metadata(authorization))

    async def list_models(self, authorization: str | None) -> exec_pb2.ListModelsResponse:
        return await self._exec.ListModels(exec_pb2.ListModelsRequest(), metadata=call_metadata(authorization))

    async def serving(self) -> bool:
        """Whether an execute service behind the target answers its health check SERVING (it needs no token)."""
        try:
            response = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S)
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING


def call_metadata(authorization: str | None) -> tuple:
    return ((HEADER, authorization),) if authorization else ()


async def merged(calls: list[grpc.aio.UnaryStreamCall]) -> AsyncIterator[tuple[int, exec_pb2.GenerateResponse]]:
    """The responses of several Generate calls as they arrive, each with the index of its call. The first failure
    ends the iteration with its error and cancels the other calls, as does leaving early."""
    if len(calls) == 1:
        try:
            async for response in calls[0]:
                yield 0, response
        finally:
            calls[0].cancel()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, call: grpc.aio.UnaryStreamCall) -> None:
        try:
            async for response in call:
                await queue.put((index, response, None))
        except grpc.RpcError as exc:
            await queue.put((index, None, exc))
        await queue.put((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, call)) for i, call in enumerate(calls)]
    try:
        remaining = len(calls)
        while remaining:
            index, response, error = await queue.get()
            if error is not None:
                raise error
            if response is None:
                remaining -= 1
            else:
                yield index, response
    finally:
        for call in calls:
            call.cancel()
        for task in tasks:
            task.cancel()
