"""The execute service's process-level entry: settings, the gRPC server with its telemetry, start and stop."""

import asyncio
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from exec_service.api.servicer import SERVICE_NAME, ExecServicer
from exec_service.openai.gateway_metrics import GatewayMetrics
from exec_service.openai.local_client import LocalExecClient
from exec_service.openai.server import ApiServer, ApiServerSettings
from exec_service.startup.fetch import COMPILE_CHANNEL_OPTIONS, BundleFetcher
from exec_service.telemetry.exec_telemetry import ExecTelemetry
from exec_service.telemetry.metrics import EngineLoad, ExecMetrics
from kiln.compilation.code_hash import kiln_code_hash
from kiln.model.hub import HubCache
from kiln.model.roots import ModelRoots
from kiln.rpc.client_security import PLAINTEXT, ClientSecurity
from kiln.rpc.grpc_server import (
    DEFAULT_MAX_CONNECTION_AGE_S,
    DEFAULT_SHUTDOWN_GRACE_S,
    UNGUARDED,
    Server,
    ServerSecurity,
    is_loopback,
)
from kiln.step_record import StepObserver
from kiln.store import bundle
from kiln.store.location import open_store
from kiln.store.signing import TrustedKeys
from protos import exec_pb2, exec_pb2_grpc
from tracing.grpc_instrumentation import instrumented_channel, server_interceptors
from tracing.setup import installed_telemetry

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = os.environ.get("KILN_EXEC_CACHE", str(Path.home() / ".cache" / "kiln" / "exec-cache"))


@dataclass(frozen=True)
class ExecServerSettings:
    """Where the execute service listens and where its bundles come from.

    With ``store`` (shared with the compile services: a directory read in place, or ``redis://...`` copied into
    ``cache_dir`` on first use) bundles come from there first and from the compile service at ``compile_address``
    only on a miss; without one they are downloaded from the compile service into ``cache_dir`` once and reused;
    either way only a bundle signed by one of ``trusted`` is loaded.
    """

    address: str  # host:port; port 0 picks a free one
    trusted: TrustedKeys  # the public keys whose signatures make a bundle loadable
    compile_address: str | None = None
    store: str | Path | None = None
    cache_dir: str | Path = DEFAULT_CACHE_DIR
    security: ServerSecurity = UNGUARDED  # TLS and tokens of this server
    client: ClientSecurity = PLAINTEXT  # how this server calls the compile service (TLS, token)
    model_roots: tuple[str | Path, ...] = ()  # the directories a request may name
    preload: tuple[exec_pb2.LoadModelRequest, ...] = ()  # loaded at start (--load), in the background
    hub: HubCache | None = None  # where Hub ids resolve (--hub-cache); None: they are refused
    # Clients reconnect after this long (--max-connection-age-s), so they find replicas added behind a DNS name;
    # None: never asked to.
    max_connection_age_s: float | None = DEFAULT_MAX_CONNECTION_AGE_S
    # The service's own OpenAI-compatible endpoint (--openai-port), its ``target`` unused: requests go to this
    # process's servicer, with no gRPC hop (exec_service.openai.local_client). None: no HTTP endpoint.
    openai: ApiServerSettings | None = None


class ExecServer(Server):
    """The gRPC server with the execute service's telemetry: stopping it also ends the telemetry (the forward-span
    writer exports the last steps, within its bound)."""

    def __init__(self, telemetry: ExecTelemetry, security: ServerSecurity, max_connection_age_s: float | None):
        super().__init__([SERVICE_NAME], server_interceptors(), security, max_connection_age_s)
        self.telemetry = telemetry
        self.api_server: ApiServer | None = None  # the OpenAI endpoint, when it has one

    async def stop(self, grace: float = DEFAULT_SHUTDOWN_GRACE_S) -> None:
        if self.api_server is None:
            await super().stop(grace)
        else:  # the HTTP and gRPC streams in flight finish within the same grace
            await asyncio.gather(asyncio.to_thread(self.api_server.stop), super().stop(grace))
        await asyncio.to_thread(self.telemetry.close)


async def start_exec_server(settings: ExecServerSettings, step_observers: Iterable[StepObserver] = (),
                            metrics: ExecMetrics | None = None) -> tuple[ExecServer, int]:
    """Build, bind and start; returns the server and its port.

    Spans, forward spans and OTLP metrics follow what init_tracing installed in this process (nothing when it did
    not run); ``step_observers`` hear every engine step besides the service's own (tests record them); ``metrics``
    (--metrics-port) hear every step and request and read the engines' load when scraped.
    """
    started = time.perf_counter()
    await asyncio.to_thread(kiln_code_hash)  # every bundle key needs it: parsed once here, not in a LoadModel
    await asyncio.to_thread(bundle.preload_runtime)
    log.info("loaded the compiled-code runtime (Dynamo's loader, Inductor, Triton) in %.2f s",
             time.perf_counter() - started)
    shared = settings.store is not None
    # The fetcher verifies each bundle's signature and sha256s itself: the store only finds them (Redis checks the
    # signature before it downloads a byte, and the sha256s of what it streams into its local copies). A replica
    # only reads a shared store.
    store = open_store(settings.store if shared else settings.cache_dir, settings.cache_dir, read_only=shared,
                       trusted=settings.trusted, verify=False)
    # Instrumented (once init_tracing ran): Compile and GetArtifact carry this trace to the compile service.
    client = settings.client
    channel = instrumented_channel(settings.compile_address, COMPILE_CHANNEL_OPTIONS, credentials=client.credentials(),
                                   interceptors=client.interceptors()) if settings.compile_address else None
    fetcher = BundleFetcher(store, shared=shared, compile_channel=channel,
                            trusted=settings.trusted)
    roots = ModelRoots.for_server(settings.model_roots, loopback=is_loopback(settings.address), hub=settings.hub)
    server = ExecServer(ExecTelemetry(installed_telemetry(), step_observers, metrics), settings.security,
                        settings.max_connection_age_s)
    servicer = ExecServicer(server, fetcher, server.telemetry, roots)
    if metrics:
        metrics.watch(lambda: _engine_loads(servicer))
    exec_pb2_grpc.add_ExecServiceServicer_to_server(servicer, server.server)
    server.on_grace_ending = servicer.end_streams
    port = await server.start(settings.address)
    if settings.openai is not None:
        tokens = settings.security.tokens
        api_metrics = GatewayMetrics(metrics.registry) if metrics else None  # kiln:api_*, beside the service's own
        server.api_server = ApiServer(settings.openai, api_metrics, lambda: LocalExecClient(servicer, tokens))
        api_port = await asyncio.to_thread(server.api_server.start)
        log.info("OpenAI-compatible API on %s://%s:%d/v1, served in this process",
                 "https" if settings.openai.https_cert else "http", settings.openai.host, api_port)
    log.info("exec service listening on %s (port %d), compile service %s, %s %s, trusting %s, model roots: %s",
             settings.address, port, settings.compile_address or "none",
             "shared store" if shared else "cache", store.location,
             ", ".join(sorted(settings.trusted.keys)) or "no key", roots.describe())
    for request in settings.preload:
        await servicer.preload(request)
    return server, port


def _engine_loads(servicer: ExecServicer) -> list[EngineLoad]:
    """Each ready model's load, read from the scraping thread (a model may be unloaded meanwhile: then skipped)."""
    loads = []
    for served in list(servicer.models.values()):
        started = served.started
        if started is not None:
            engine = started.engine
            blocks = engine.block_manager
            loads.append(EngineLoad(served.name, engine.num_running, engine.num_waiting, engine.num_free_blocks,
                                    started.sizing.num_kv_blocks, blocks.queried_tokens, blocks.hit_tokens,
                                    blocks.num_cached_blocks, blocks.evicted_blocks))
    return loads
