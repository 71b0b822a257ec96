"""What both services' gRPC servers share: error mapping, health, reflection, graceful shutdown."""

import asyncio
import functools
import inspect
import logging
import signal
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kiln.errors import KilnError, first_line

log = logging.getLogger(__name__)

# Bundles are tens of MB; single messages stay small (GetArtifact streams), but allow headroom for configs.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def status_errors(method):
    """Map KilnError to its status and anything unexpected to INTERNAL with one line: never a stack trace."""

    async def abort(context, exc: Exception):
        if isinstance(exc, KilnError):
            await context.abort(exc.code, str(exc))
        log.exception("unexpected error in %s", method.__name__)
        await context.abort(grpc.StatusCode.INTERNAL, first_line(exc))

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                await abort(context, exc)

        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001
            await abort(context, exc)

    return unary


class ProgressEvents:
    """Progress that work in a worker thread emits, streamed from the event loop until the work is done.

    Compile and LoadModel both run torch in a thread and stream its phases to the client as they happen.
    """

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def emit(self, event) -> None:
        """Thread-safe: called from the worker."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def until_done(self, job: asyncio.Future):
        """Yield events as they arrive, until ``job`` is done and every event it emitted has been yielded."""
        while not job.done() or not self._queue.empty():
            getter = asyncio.ensure_future(self._queue.get())
            await asyncio.wait([getter, job], return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield getter.result()
            else:
                getter.cancel()


class Server:
    """A grpc.aio server with the standard health service and server reflection."""

    def __init__(self, service_names: Iterable[str], interceptors: Iterable = ()):
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=list(interceptors))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )

    async def set_serving(self, name: str, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(name, status)

    async def start(self, address: str) -> int:
        port = self.server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind {address}")
        await self.server.start()
        for name in ["", *self.service_names]:
            await self.set_serving(name, True)
        return port

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def serve_until_signal(self) -> None:
        """Run until SIGINT/SIGTERM, then drain in-flight calls and stop."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting down")
        await self.stop()


def serve_until_signal(start) -> None:
    """Run ``start()`` (a coroutine returning (Server, port)) and serve until SIGINT/SIGTERM: the CLI's servers."""

    async def serve():
        server, _ = await start()
        await server.serve_until_signal()

    asyncio.run(serve())
