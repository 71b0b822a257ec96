"""The ports: TLS and mutual TLS, bearer tokens per RPC and role, loopback by default, bounded requests, and the
model roots, through real servers with certificates and tokens made by ``kiln keygen``'s code in fixtures."""

import asyncio
import ipaddress
import logging
import os
import socket
from pathlib import Path

import grpc
import pytest
from conftest import TINY_CONFIG, TINY_MODEL, BackgroundServer, compile_result, load_model
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kiln.rpc import keygen
from kiln.rpc.auth import TokenTable
from kiln.rpc.client_security import ClientSecurity
from kiln.rpc.grpc_server import CHANNEL_OPTIONS, Server, ServerSecurity
from kiln.rpc.tls import ClientTls, ServerTls
from protos import common_pb2, compile_pb2, compile_pb2_grpc, exec_pb2, exec_pb2_grpc


@pytest.fixture(scope="module")
def material(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    tls = keygen.tls_material(d, ["localhost", "127.0.0.1"])
    table, admin, user = keygen.token_files(d)
    return tls, table, admin.read_text().strip(), user.read_text().strip()


@pytest.fixture(scope="module")
def secure_compile(material, compile_store, signer, tiny_key):
    """A compile service with TLS and tokens on the session's store (so the tiny model is a hit there)."""
    from compile_service.server import CompileServerSettings, start_compile_server

    tls, table, _, _ = material
    security = ServerSecurity(ServerTls.load(tls.server_cert, tls.server_key), TokenTable.load(table))
    server = BackgroundServer(lambda: start_compile_server(CompileServerSettings(
        "127.0.0.1:0", compile_store, signer, security=security)))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def secure_exec(material, secure_compile, trusted_keys, tmp_path_factory):
    """An exec service with TLS and tokens, calling the secure compile service over TLS with the admin token."""
    from exec_service.server import ExecServerSettings, start_exec_server

    tls, table, admin, _ = material
    security = ServerSecurity(ServerTls.load(tls.server_cert, tls.server_key), TokenTable.load(table))
    client = ClientSecurity(ClientTls.load(tls.ca), admin)
    settings = ExecServerSettings("127.0.0.1:0", trusted_keys, secure_compile.address,
                                  cache_dir=tmp_path_factory.mktemp("secure-cache"), security=security, client=client)
    server = BackgroundServer(lambda: start_exec_server(settings))
    yield server
    server.stop()


def client(material, token: str | None = None, with_ca: bool = True) -> ClientSecurity:
    tls = material[0]
    return ClientSecurity(ClientTls.load(tls.ca) if with_ca else None, token)


# Each RPC with a request that passes authentication cheaply: the handler's own answer is then not an auth status.
COMPILE_CALLS = {
    "Compile": (lambda s: list(s.Compile(compile_pb2.CompileRequest())), "admin"),
    "DeleteArtifact": (lambda s: s.DeleteArtifact(compile_pb2.DeleteArtifactRequest()), "admin"),
    "GetArtifact": (lambda s: list(s.GetArtifact(compile_pb2.GetArtifactRequest())), "user"),
    "ListArtifacts": (lambda s: s.ListArtifacts(compile_pb2.ListArtifactsRequest()), "user"),
}
EXEC_CALLS = {
    "LoadModel": (lambda s: list(s.LoadModel(exec_pb2.LoadModelRequest(name="no spaces"))), "admin"),
    "UnloadModel": (lambda s: s.UnloadModel(exec_pb2.UnloadModelRequest(name="nothing")), "admin"),
    "Generate": (lambda s: list(s.Generate(exec_pb2.GenerateRequest(model="nothing"))), "user"),
    "ListModels": (lambda s: s.ListModels(exec_pb2.ListModelsRequest()), "user"),
    "GetForwardStats": (lambda s: s.GetForwardStats(exec_pb2.GetForwardStatsRequest()), "user"),
}
AUTH_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def status_of(call, stub) -> grpc.StatusCode:
    try:
        call(stub)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("service", ["compile", "exec"])
def test_each_rpc_gets_the_status_its_role_allows(material, secure_compile, secure_exec, service, caplog):
    _, _, admin, user = material
    server, calls, stub_class = ((secure_compile, COMPILE_CALLS, compile_pb2_grpc.CompileServiceStub)
                                 if service == "compile" else (secure_exec, EXEC_CALLS, exec_pb2_grpc.ExecServiceStub))
    caplog.set_level(logging.DEBUG)
    for token, role in ((None, None), ("not-a-token-of-this-server", None), (user, "user"), (admin, "admin")):
        with client(material, token).channel(server.address, CHANNEL_OPTIONS) as channel:
            stub = stub_class(channel)
            for method, (call, needed) in calls.items():
                code = status_of(call, stub)
                if role is None:
                    assert code == grpc.StatusCode.UNAUTHENTICATED, (method, token, code)
                elif role == "user" and needed == "admin":
                    assert code == grpc.StatusCode.PERMISSION_DENIED, (method, code)
                else:
                    assert code not in AUTH_CODES, (method, role, code)
    assert admin not in caplog.text and user not in caplog.text, "a token reached the log"


def test_a_refused_callers_message_is_never_parsed(material, secure_exec):
    """Bytes that are no LoadModelRequest, without a token: UNAUTHENTICATED, not the parse failure that reading them
    would give (UNKNOWN, before): the refusal never hands them to protobuf."""
    with client(material).channel(secure_exec.address, CHANNEL_OPTIONS) as channel:
        raw = channel.unary_stream("/kiln.v1.ExecService/LoadModel")  # no serializers: bytes as given
        with pytest.raises(grpc.RpcError) as refused:
            list(raw(b"\xff" * 64))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_and_reflection_stay_open_without_a_token(material, secure_exec):
    with client(material).channel(secure_exec.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert "kiln.v1.ExecService" in ProtoReflectionDescriptorDatabase(channel).get_services()


def test_tls_needs_the_ca_and_a_plaintext_client_gets_nothing(material, secure_compile):
    _, _, admin, _ = material
    for security in (client(material, admin, with_ca=False), ClientSecurity(ClientTls(None), admin)):
        with security.channel(secure_compile.address) as channel:
            with pytest.raises(grpc.RpcError) as exc:
                compile_pb2_grpc.CompileServiceStub(channel).ListArtifacts(compile_pb2.ListArtifactsRequest(),
                                                                           timeout=10)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    with client(material, admin).channel(secure_compile.address) as channel:
        compile_pb2_grpc.CompileServiceStub(channel).ListArtifacts(compile_pb2.ListArtifactsRequest(), timeout=10)


def test_exec_reaches_the_compile_service_over_tls_with_its_token(material, secure_exec, tiny_key):
    """LoadModel on a miss in the exec's own cache: Compile (a hit) and GetArtifact, both over TLS, admin token."""
    _, _, admin, _ = material
    with client(material, admin).channel(secure_exec.address, CHANNEL_OPTIONS) as channel:
        events = load_model(exec_pb2_grpc.ExecServiceStub(channel), "tiny-over-tls")
    assert events[-1].ready.key.digest == tiny_key
    fetch = next(e.phase for e in events if e.HasField("phase") and e.phase.phase == "fetch" and not e.phase.progress)
    assert fetch.detail.startswith("downloaded")


def test_mutual_tls_refuses_a_client_without_a_certificate(material):
    tls = material[0]
    server = BackgroundServer(lambda: _plain_server(ServerSecurity(ServerTls.load(tls.server_cert, tls.server_key,
                                                                                  tls.ca))))
    try:
        anonymous = ClientSecurity(ClientTls.load(tls.ca))
        with anonymous.channel(server.address) as channel, pytest.raises(grpc.RpcError) as exc:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        with ClientSecurity(ClientTls.load(tls.ca, tls.client_cert, tls.client_key)).channel(server.address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()


async def _plain_server(security: ServerSecurity):
    server = Server([], security=security)
    return server, await server.start("127.0.0.1:0")


# --- loopback by default --------------------------------------------------------------------------------------


def listening_addresses(port: int) -> set[str]:
    """The local addresses a LISTEN socket on ``port`` is bound to, read back from the kernel's tables."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # /proc stores each 32-bit word in host (little-endian) order
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                family = socket.AF_INET if width == 8 else socket.AF_INET6
                ip = ipaddress.ip_address(socket.inet_ntop(family, words))
                found.add(str(getattr(ip, "ipv4_mapped", None) or ip))  # gRPC may bind ::ffff:127.0.0.1
    return found


def test_the_default_bind_is_loopback(tmp_path, signing_dir):
    from kiln_cli.service_process import ServiceProcess, free_port, kiln_command

    port = free_port()
    server = ServiceProcess("compile", kiln_command("compile-server", "--port", str(port), "--store",
                                                    str(tmp_path / "store"), "--signing-key",
                                                    str(signing_dir / "signing.key")),
                            f"127.0.0.1:{port}", tmp_path / "compile.log")
    server.start()
    try:
        server.wait_healthy(timeout=120)
        assert listening_addresses(port) == {"127.0.0.1"}
    finally:
        server.stop()
    assert "SECURITY" not in server.log_path.read_text()


def test_an_open_port_gets_one_loud_warning(caplog):
    async def warn_for(*addresses):
        server = Server(["kiln.v1.CompileService"])  # a grpc.aio server: made on an event loop
        for address in addresses:
            server._warn_if_open(address)

    caplog.set_level(logging.WARNING)
    asyncio.run(warn_for("0.0.0.0:50051"))
    (record,) = [r for r in caplog.records if "SECURITY" in r.getMessage()]
    assert "without TLS" in record.getMessage() and "tokens" in record.getMessage()
    assert "kiln.v1.CompileService" in record.getMessage()
    caplog.clear()
    asyncio.run(warn_for("127.0.0.1:50051", "[::1]:50051", "localhost:50051"))
    assert not [r for r in caplog.records if "SECURITY" in r.getMessage()]


# --- bounded requests --------------------------------------------------------------------------------------------


def test_a_request_over_the_cap_is_resource_exhausted(compile_stub):
    huge = common_pb2.ModelSpec(config_json="x" * (5 << 20))
    with pytest.raises(grpc.RpcError) as exc:
        list(compile_stub.Compile(compile_pb2.CompileRequest(model=huge)))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_config_over_one_mib_is_refused_before_it_is_parsed(compile_stub):
    big = common_pb2.ModelSpec(config_json="{" + " " * (1 << 20) + "}")
    with pytest.raises(grpc.RpcError) as exc:
        list(compile_stub.Compile(compile_pb2.CompileRequest(model=big, config=TINY_CONFIG)))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model.config_json" in exc.value.details() and "limit" in exc.value.details()


def test_a_long_name_is_quoted_cut_and_the_real_error_survives(compile_stub, exec_stub):
    with pytest.raises(grpc.RpcError) as exc:
        list(compile_stub.Compile(compile_pb2.CompileRequest(model=common_pb2.ModelSpec(preset="p" * 100_000))))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert "model.preset: unknown preset" in exc.value.details() and len(exc.value.details()) < 600
    assert "more characters" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        list(exec_stub.Generate(exec_pb2.GenerateRequest(model="m" * 100_000, prompt_ids=[1])))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND and len(exc.value.details()) < 1200


# --- model roots --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rooted(tmp_path_factory, signer, compile_store, tiny_key):
    """A compile service on loopback with one --model-root, and a directory outside it."""
    from compile_service.server import CompileServerSettings, start_compile_server

    base = tmp_path_factory.mktemp("roots")
    root, outside = base / "models", base / "elsewhere"
    (root / "tiny").mkdir(parents=True)
    (outside / "secret").mkdir(parents=True)
    (outside / "secret" / "config.json").write_text('{"model_type": "llama"}')
    (root / "escape").symlink_to(outside / "secret")
    (root / "sneaky").mkdir()
    (root / "sneaky" / "config.json").symlink_to(outside / "secret" / "config.json")
    server = BackgroundServer(lambda: start_compile_server(CompileServerSettings(
        "127.0.0.1:0", compile_store, signer, model_roots=(root,))))
    channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    yield compile_pb2_grpc.CompileServiceStub(channel), root, outside
    channel.close()
    server.stop()


def test_a_path_outside_the_roots_is_denied_without_saying_whether_it_exists(rooted):
    stub, root, outside = rooted
    details = {}
    for label, path in [("exists", outside / "secret"), ("missing", outside / "nothing"),
                        ("symlinked dir", root / "escape"), ("symlinked file", root / "sneaky"),
                        ("dotdot", root / ".." / "elsewhere" / "secret")]:
        with pytest.raises(grpc.RpcError) as exc:
            compile_result(stub, common_pb2.ModelSpec(hf_dir=str(path)), TINY_CONFIG)
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED, (label, exc.value.details())
        details[label] = exc.value.details().replace(str(path), "PATH")
    assert details["exists"] == details["missing"], "the message tells an existing path from a missing one"
    with pytest.raises(grpc.RpcError) as exc:  # inside the root, the usual answer
        compile_result(stub, common_pb2.ModelSpec(hf_dir=str(root / "tiny")), TINY_CONFIG)
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "no config.json" in exc.value.details()


def test_weights_outside_the_roots_are_denied_by_the_execute_service(tmp_path, trusted_keys, compile_server):
    from exec_service.server import ExecServerSettings, start_exec_server

    root = tmp_path / "models"
    root.mkdir()
    settings = ExecServerSettings("127.0.0.1:0", trusted_keys, compile_server.address, cache_dir=tmp_path / "cache",
                                  model_roots=(root,))
    server = BackgroundServer(lambda: start_exec_server(settings))
    try:
        with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as exc:
            list(exec_pb2_grpc.ExecServiceStub(channel).LoadModel(exec_pb2.LoadModelRequest(
                name="w", model=TINY_MODEL, config=TINY_CONFIG, weights=str(tmp_path))))
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED and "weights" in exc.value.details()
    finally:
        server.stop()


def test_off_loopback_without_roots_no_client_path_is_read(tmp_path):
    from kiln.errors import PermissionDenied
    from kiln.model.roots import ModelRoots

    (tmp_path / "model").mkdir()
    assert ModelRoots.for_server([], loopback=True).check_dir(str(tmp_path / "model"), "model.hf_dir")
    with pytest.raises(PermissionDenied):
        ModelRoots.for_server([], loopback=False).check_dir(str(tmp_path / "model"), "model.hf_dir")
    assert ModelRoots.for_server([tmp_path], loopback=False).check_dir(str(tmp_path / "model"), "model.hf_dir")


def test_the_cli_sends_kiln_auth_token(material, secure_compile, monkeypatch, capsys):
    from kiln_cli import main

    tls, _, admin, _ = material
    monkeypatch.setenv("KILN_TLS_CA", str(tls.ca))
    monkeypatch.delenv("KILN_AUTH_TOKEN", raising=False)
    assert main(["artifacts", "list", "--server", secure_compile.address]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("KILN_AUTH_TOKEN", admin)
    assert main(["artifacts", "list", "--server", secure_compile.address, "--json"]) == 0
    assert main(["health", secure_compile.address]) == 0
