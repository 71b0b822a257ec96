"""Every number of every request has a range, checked at the API edge of the real servers: the descriptors are
walked, so a field added without a line in kiln/rpc/field_bounds.py fails here."""

import grpc
import pytest
from conftest import BackgroundServer
from google.protobuf.descriptor import FieldDescriptor

from kiln.rpc.field_bounds import BOUNDS, NUMERIC_TYPES
from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from protos import compile_pb2, compile_pb2_grpc, exec_pb2, exec_pb2_grpc

_I32, _I64 = (-(1 << 31), (1 << 31) - 1), (-(1 << 63), (1 << 63) - 1)
INT_RANGES = {
    FieldDescriptor.TYPE_INT32: _I32, FieldDescriptor.TYPE_SINT32: _I32, FieldDescriptor.TYPE_SFIXED32: _I32,
    FieldDescriptor.TYPE_INT64: _I64, FieldDescriptor.TYPE_SINT64: _I64, FieldDescriptor.TYPE_SFIXED64: _I64,
    FieldDescriptor.TYPE_UINT32: (0, (1 << 32) - 1), FieldDescriptor.TYPE_FIXED32: (0, (1 << 32) - 1),
    FieldDescriptor.TYPE_UINT64: (0, (1 << 64) - 1), FieldDescriptor.TYPE_FIXED64: (0, (1 << 64) - 1),
}
FLOAT_MAX = {FieldDescriptor.TYPE_FLOAT: 3.4028234663852886e38, FieldDescriptor.TYPE_DOUBLE: 1.7976931348623157e308}
SERVICES = [(compile_pb2, "CompileService", compile_pb2_grpc.CompileServiceStub),
            (exec_pb2, "ExecService", exec_pb2_grpc.ExecServiceStub)]
MAX_COUNT_PROBED = 1 << 16  # a longer repeated field would pass gRPC's message limit before the bound


def numeric_paths(message, seen=()):
    """Every numeric field reachable from ``message``: (path of field descriptors, the numeric field)."""
    for field in message.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.full_name not in seen:
            for path in numeric_paths(field.message_type, (*seen, field.message_type.full_name)):
                yield (field, *path)
        elif field.type in NUMERIC_TYPES:
            yield (field,)


def request_fields():
    """(RPC, dotted field name, path) for every numeric field of every request message of both services."""
    for module, service, _ in SERVICES:
        for method in module.DESCRIPTOR.services_by_name[service].methods:
            for path in numeric_paths(method.input_type, (method.input_type.full_name,)):
                yield method, ".".join(f.name for f in path), path


def probes(field: FieldDescriptor) -> list[tuple[str, object]]:
    """Out-of-range values the field's type can carry: its maximum + 1, the type's largest value, its minimum - 1
    (the minimum itself when open), and one value too many for a repeated field."""
    bound = BOUNDS[field.full_name]
    out = []
    if field.type in INT_RANGES:
        low, high = INT_RANGES[field.type]
        candidates = [("max + 1", bound.high + 1), ("type max", high), ("min - 1", bound.low - 1)]
        out = [(what, int(v)) for what, v in candidates if low <= v <= high and not bound.holds(v)]
    else:
        top = FLOAT_MAX[field.type]
        candidates = [("max + 1", bound.high + 1), ("type max", top), ("min - 1", bound.low - 1),
                      ("nan", float("nan"))]
        if bound.low_open:
            candidates.append(("open min", bound.low))
        out = [(what, float(v)) for what, v in candidates if -top <= v <= top or v != v]
    if field.is_repeated and bound.max_count and bound.max_count < MAX_COUNT_PROBED:
        out.append(("count", [int(bound.low) if field.type in INT_RANGES else bound.low] * (bound.max_count + 1)))
    return out


def build(method, path, value):
    request = getattr(compile_pb2 if method.containing_service.name == "CompileService" else exec_pb2,
                      method.input_type.name)()
    target = request
    for field in path[:-1]:
        target = getattr(target, field.name)
        if field.is_repeated:
            target = target.add()
    leaf = path[-1]
    if leaf.is_repeated:
        getattr(target, leaf.name).extend(value if isinstance(value, list) else [value])
    else:
        setattr(target, leaf.name, value)
    return request


CASES = [(method, name, path, what, value) for method, name, path in request_fields()
         for what, value in (probes(path[-1]) if path[-1].full_name in BOUNDS else [("unbounded", None)])]


@pytest.fixture(scope="module")
def stubs(tmp_path_factory, signer, trusted_keys):
    from compile_service.server import CompileServerSettings, start_compile_server
    from exec_service.server import ExecServerSettings, start_exec_server

    compile_server = BackgroundServer(lambda: start_compile_server(CompileServerSettings(
        "127.0.0.1:0", tmp_path_factory.mktemp("store"), signer)))
    exec_server = BackgroundServer(lambda: start_exec_server(ExecServerSettings(
        "127.0.0.1:0", trusted_keys, None, cache_dir=tmp_path_factory.mktemp("cache"))))
    channels = [grpc.insecure_channel(s.address, options=CHANNEL_OPTIONS) for s in (compile_server, exec_server)]
    yield {"CompileService": compile_pb2_grpc.CompileServiceStub(channels[0]),
           "ExecService": exec_pb2_grpc.ExecServiceStub(channels[1])}
    for channel in channels:
        channel.close()
    exec_server.stop()
    compile_server.stop()


def test_every_numeric_request_field_has_a_bound_and_every_bound_a_field():
    names = {path[-1].full_name for _, _, path in request_fields()}
    assert not names - BOUNDS.keys(), f"request fields with no range in field_bounds.py: {names - BOUNDS.keys()}"
    assert not BOUNDS.keys() - names, f"ranges for fields no request has: {BOUNDS.keys() - names}"


@pytest.mark.parametrize("field", sorted({path[-1].full_name for _, _, path in request_fields()}))
def test_every_bound_can_be_exceeded_by_a_value_the_wire_carries(field):
    descriptor = next(path[-1] for _, _, path in request_fields() if path[-1].full_name == field)
    assert field in BOUNDS and probes(descriptor), f"{field}: its range is its type's whole range, so no bound"


@pytest.mark.parametrize(("method", "name", "path", "what", "value"), CASES,
                         ids=[f"{m.name}-{n}-{w}" for m, n, _, w, _ in CASES])
def test_an_out_of_range_number_is_invalid_argument_naming_the_field(stubs, method, name, path, what, value):
    assert what != "unbounded", f"{path[-1].full_name} has no range"
    call = getattr(stubs[method.containing_service.name], method.name)
    request = build(method, path, value)
    with pytest.raises(grpc.RpcError) as refused:
        reply = call(request, timeout=30)
        if method.server_streaming:
            list(reply)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert refused.value.details().startswith(name), refused.value.details()


def test_ten_million_sequences_are_refused_before_anything_is_allocated(stubs):
    with pytest.raises(grpc.RpcError) as refused:
        list(stubs["ExecService"].LoadModel(exec_pb2.LoadModelRequest(
            name="huge", model={"preset": "tiny-llama"}, max_num_seqs=10_000_000), timeout=10))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "max_num_seqs: 10000000 is outside [0, 4096]; 0 means 64"
