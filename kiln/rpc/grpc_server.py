"""What both services' gRPC servers share: error mapping, health, reflection, graceful shutdown, and the
security of the port: TLS, bearer tokens, the request size cap, and a loud warning for an open port."""

import asyncio
import contextvars
import faulthandler
import functools
import inspect
import ipaddress
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kiln.errors import KilnError, first_line, resource_error
from kiln.rpc.auth import TokenAuth, TokenTable
from kiln.rpc.field_bounds import check_request
from kiln.rpc.tls import ServerTls

log = logging.getLogger(__name__)

# How long SIGTERM lets calls in flight finish before what is left is ended (--shutdown-grace-s): below
# Kubernetes' default terminationGracePeriodSeconds of 30, so the drain ends before the kill.
DEFAULT_SHUTDOWN_GRACE_S = 25.0
# After the grace, how long a service has to end what is left with a status of its own before gRPC cancels it.
END_CALLS_S = 3.0

# How long a client's connection to the execute service lives before the server asks it to reconnect
# (--max-connection-age-s): a client then resolves its target again, so a replica added behind a DNS name (a
# Kubernetes headless Service) starts receiving calls within this (gRPC adds up to 10% of jitter) plus the client's
# minimum time between resolutions. The server only sends GOAWAY: calls in flight run to their end on the old
# connection, however long (max_connection_age_grace_ms is left unlimited), new ones go on the new one.
DEFAULT_MAX_CONNECTION_AGE_S = 300.0
GRPC_INT_MAX = 2**31 - 1  # gRPC's "unlimited" for a millisecond option

# Calls that arrived and wait for the event loop to take them. gRPC's defaults (1,000, then random drops up to 3,000)
# end a burst's excess with a bare CANCELLED before any handler runs; a rate-inf benchmark of 2,000 requests is
# such a burst. Up to this many the service's own bounds answer (max_num_waiting: RESOURCE_EXHAUSTED, saying so). A
# waiting call holds at most its request (max_request_bytes) in gRPC's buffers: near what gRPC's 3,000 allowed.
MAX_PENDING_CALLS = 4096

# What a client receives: bundles are tens of MB, but GetArtifact streams them in chunks of at most 4 MiB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# What a server accepts in one request message: requests are configs and prompts, never bundles.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_HOST = "127.0.0.1"
# A status message longer than this is cut: gRPC carries it in a trailer, and an oversized one replaces the real
# error with a metadata-size failure.
MAX_STATUS_CHARS = 1000


@dataclass(frozen=True)
class ServerSecurity:
    """How a server guards its port; the defaults are a plaintext, tokenless server for loopback."""

    tls: ServerTls | None = None
    tokens: TokenTable | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


# No TLS, no tokens, the default request cap: tests' and the demo's loopback servers.
UNGUARDED = ServerSecurity()


def host_of(address: str) -> str:
    """The host of ``host:port``, ``[v6]:port`` or ``v6-literal:port``."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]")


def is_loopback(address: str) -> bool:
    """True when ``address`` binds loopback only; a host name other than localhost counts as not loopback."""
    host = host_of(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cut(message: str) -> str:
    return message if len(message) <= MAX_STATUS_CHARS else message[:MAX_STATUS_CHARS] + "... (cut)"


def status_errors(method):
    """Check every number of the request against its range first (kiln.rpc.field_bounds), then map KilnError to its
    status, a full disk or exhausted memory to theirs, and anything else (a Kiln bug) to INTERNAL with one line:
    never a stack trace."""

    async def abort(context, exc: Exception):
        if isinstance(exc, KilnError):
            await context.abort(grpc.StatusCode[exc.code], _cut(str(exc)))
        caller = resource_error(exc, method.__name__)
        if caller is not None:
            log.warning("%s failed: %s", method.__name__, caller)
            await context.abort(grpc.StatusCode[caller.code], _cut(str(caller)))
        log.exception("unexpected error in %s", method.__name__)
        await context.abort(grpc.StatusCode.INTERNAL, _cut(first_line(exc)))

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                check_request(request)
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
            check_request(request)
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


_workers: set[threading.Thread] = set()  # in_worker_thread's threads still running


def in_worker_thread(fn: Callable, *args) -> asyncio.Future:
    """``fn(*args)`` in a daemon thread, awaited on the event loop, in a copy of the current context (so its spans
    are children of the call's). Unlike asyncio.to_thread, a compile or a model load still running when the
    shutdown grace ends does not hold the process's exit: its staging leftovers are swept at the next start."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    context = contextvars.copy_context()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():
            outcome()

    def run() -> None:
        try:
            result = context.run(fn, *args)
            outcome = functools.partial(future.set_result, result)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = functools.partial(future.set_exception, exc)
        _workers.discard(threading.current_thread())
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:
            pass  # the event loop is closed: the server stopped while this ran

    thread = threading.Thread(target=run, name=getattr(fn, "__name__", "worker"), daemon=True)
    _workers.add(thread)
    thread.start()
    return future


def leave_unfinished_workers() -> None:
    """The last call of a server process, after it stopped and flushed its telemetry: when a compile or a load is
    still running (cut by the shutdown grace), exit now. Finalizing the interpreter under a thread inside torch
    aborts the process; what the thread was writing is swept at the next start."""
    running = [t.name for t in list(_workers) if t.is_alive()]
    if running:
        log.warning("exiting with %d unfinished workers (%s)", len(running), ", ".join(running))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class Health(health.aio.HealthServicer):
    """The standard health service, which also forgets names: an unloaded model is NOT_FOUND, as one never loaded."""

    async def clear(self, service: str) -> None:
        condition = self._server_watchers.get(service)
        if condition is None:
            self._server_status.pop(service, None)
            return
        async with condition:  # watchers hear SERVICE_UNKNOWN
            self._server_status.pop(service, None)
            condition.notify_all()


class Server:
    """A grpc.aio server with the standard health service and server reflection, guarded as ``security`` says.

    ``max_connection_age_s``, when set, has clients reconnect (and resolve their target again) after that long,
    never cutting a call in flight.
    ``on_grace_ending``, when set, runs when a shutdown's grace ends with calls still in flight, so the service
    ends them with a status a client can act on rather than gRPC's bare cancellation END_CALLS_S later.
    """

    def __init__(self, service_names: Iterable[str], interceptors: Iterable = (),
                 security: ServerSecurity = UNGUARDED, max_connection_age_s: float | None = None):
        self.security = security
        guards = [TokenAuth(security.tokens)] if security.tokens else []
        # Requests over the cap are RESOURCE_EXHAUSTED from gRPC itself, before any handler sees a byte.
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", security.max_request_bytes),
                   ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                   ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS)]
        if max_connection_age_s:  # see DEFAULT_MAX_CONNECTION_AGE_S; None or 0: connections live as long as used
            options += [("grpc.max_connection_age_ms", max(1, round(max_connection_age_s * 1000))),
                        ("grpc.max_connection_age_grace_ms", GRPC_INT_MAX)]
        self.server = grpc.aio.server(options=options, interceptors=[*interceptors, *guards])
        self.health = Health()
        self.on_grace_ending: Callable[[float], Awaitable[None]] | None = None
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
        tls = self.security.tls
        port = (self.server.add_secure_port(address, tls.credentials()) if tls
                else self.server.add_insecure_port(address))
        if port == 0:
            raise OSError(f"cannot bind {address}")
        self._warn_if_open(address)
        await self.server.start()
        for name in ["", *self.service_names]:
            await self.set_serving(name, True)
        return port

    def _warn_if_open(self, address: str) -> None:
        """One loud line when a port off loopback lacks TLS or tokens: what it leaves open, and to whom."""
        if is_loopback(address):
            return
        missing = [what for what, present in (("TLS (--tls-cert/--tls-key)", self.security.tls),
                                              ("tokens (--auth-token-file)", self.security.tokens)) if not present]
        if missing:
            log.warning("SECURITY: listening on %s without %s: anyone who can reach this port can call every RPC "
                        "of %s%s", address, " and without ".join(missing), ", ".join(self.service_names),
                        " and read every byte in plaintext" if not self.security.tls else "")

    async def forget(self, name: str) -> None:
        """Health checks of ``name`` answer NOT_FOUND from now on."""
        await self.health.clear(name)

    async def stop(self, grace: float = DEFAULT_SHUTDOWN_GRACE_S) -> None:
        """Refuse new calls (health NOT_SERVING), let those in flight finish for up to ``grace`` seconds, then end
        what is left through ``on_grace_ending``, and cancel whatever still runs END_CALLS_S after that."""
        await self.health.enter_graceful_shutdown()
        if self.on_grace_ending is None:
            await self.server.stop(grace)
            return
        stopping = asyncio.ensure_future(self.server.stop(grace + END_CALLS_S))
        done, _ = await asyncio.wait([stopping], timeout=grace)
        if not done:
            await self.on_grace_ending(grace)
        await stopping

    async def serve_until_signal(self, grace: float = DEFAULT_SHUTDOWN_GRACE_S,
                                 stop: asyncio.Event | None = None) -> None:
        """Run until SIGINT/SIGTERM (or ``stop``, set by them: handlers installed before the server started), then
        drain in-flight calls for up to ``grace`` seconds and stop."""
        if stop is None:
            stop = _stop_on_signals()
        await stop.wait()
        log.info("shutting down: draining calls in flight for up to %.0f s", grace)
        await self.stop(grace)
        log.info("stopped")


def serve_until_signal(start, grace: float = DEFAULT_SHUTDOWN_GRACE_S) -> None:
    """Run ``start()`` (a coroutine returning (Server, port)) and serve until SIGINT/SIGTERM: the CLI's servers.

    A crash in native code (SIGSEGV, SIGBUS, SIGABRT, ...) leaves every thread's Python stack on stderr, the log
    of a service run as a child (faulthandler); SIGUSR1 prints the same without stopping, for a server that hangs.
    """
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)

    async def serve():
        stop = _stop_on_signals()  # before start: a SIGTERM while it starts (its ports may answer already) is a stop
        server, _ = await start()
        await server.serve_until_signal(grace, stop)

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(serve())


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (a dependency but on Windows), as vLLM's API server runs on: streaming a
    token over gRPC costs the execute service's event loop ~16% less CPU on it (bench/serving.py at rate inf on the
    CPU host, BENCHMARKS.md), CPU that at rate inf the engine thread shares under the GIL; asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _stop_on_signals() -> asyncio.Event:
    """An event SIGINT and SIGTERM set, on the running loop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
