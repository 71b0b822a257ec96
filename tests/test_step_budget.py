"""The step budget (LoadModelRequest.max_num_batched_tokens, the scheduler's) and the compiled token range
(CompileConfig.max_compiled_tokens, a key factor) are two settings: any budget within the range loads one bundle."""

import grpc
import pytest
from conftest import TINY_CONFIG, load_model

from kiln.compilation.config import CompileConfig
from kiln.errors import InvalidArgument
from protos import common_pb2, exec_pb2


def test_two_budgets_over_one_compiled_range_load_one_bundle(exec_stub, tiny_key):
    """Budgets 64 and 128 over the session's range of 128: both serve the session's one compile (its key), each
    scheduling the budget it asked for."""
    for budget in (64, 128):
        events = load_model(exec_stub, f"tiny-budget-{budget}", max_num_batched_tokens=budget)
        sizing = events[-1].ready
        assert sizing.key.digest == tiny_key
        assert sizing.max_num_batched_tokens == budget
        fetch = next(e.phase for e in events
                     if e.HasField("phase") and e.phase.phase == "fetch" and not e.phase.progress)
        assert "local cache" in fetch.detail or "downloaded" in fetch.detail, fetch.detail


def test_a_budget_over_the_compiled_range_is_refused_at_the_edge(exec_stub):
    with pytest.raises(grpc.RpcError) as exc:
        load_model(exec_stub, "tiny-budget-too-big", max_num_batched_tokens=TINY_CONFIG.max_compiled_tokens + 1)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_num_batched_tokens: 129 is outside [2, 128]" in exc.value.details()


def test_the_old_name_of_the_compiled_range_still_reads():
    """Requests and --load JSON written before the split set CompileConfig.max_num_batched_tokens (field 3)."""
    legacy = common_pb2.CompileConfig(device="cpu", max_num_batched_tokens=64)
    assert CompileConfig.from_proto(legacy).max_compiled_tokens == 64
    both = common_pb2.CompileConfig(device="cpu", max_num_batched_tokens=64, max_compiled_tokens=64)
    assert CompileConfig.from_proto(both).max_compiled_tokens == 64
    with pytest.raises(InvalidArgument, match="config.max_num_batched_tokens: 64 differs"):
        CompileConfig.from_proto(common_pb2.CompileConfig(device="cpu", max_num_batched_tokens=64,
                                                          max_compiled_tokens=128))


@pytest.mark.parametrize("value", [1, 131073, -5])
def test_the_compiled_range_is_bounded(value):
    with pytest.raises(InvalidArgument, match=f"config.max_compiled_tokens: {value} is outside"):
        CompileConfig.from_proto(common_pb2.CompileConfig(device="cpu", max_compiled_tokens=value))


def test_the_engine_config_leaves_the_edge_complete():
    """No field left for startup to fill in: the budget defaults to the compiled range, and CUDA-graph capture sizes
    default to the decode batches that fit both max_num_seqs and the budget (checked on CPU: nothing runs)."""
    from exec_service.api.load_request import engine_config
    from kiln.model.roots import ModelRoots
    from kiln.model.spec import resolve

    resolved = resolve(common_pb2.ModelSpec(preset="tiny-llama"), "cuda", ModelRoots.for_server((), loopback=True))
    compiled = CompileConfig(device="cuda", max_compiled_tokens=128)
    graphs = exec_pb2.RUNTIME_MODE_CUDAGRAPH
    config = engine_config(exec_pb2.LoadModelRequest(runtime_mode=graphs), resolved, compiled)
    assert config.max_num_batched_tokens == 128 and config.capture_sizes == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    config = engine_config(exec_pb2.LoadModelRequest(runtime_mode=graphs, max_num_batched_tokens=16), resolved,
                           compiled)
    assert config.max_num_batched_tokens == 16 and config.capture_sizes == (1, 2, 4, 8, 16)
    with pytest.raises(InvalidArgument, match=r"capture_sizes: 32 is outside \[1, 16\]"):
        engine_config(exec_pb2.LoadModelRequest(runtime_mode=graphs, max_num_batched_tokens=16, capture_sizes=[32]),
                      resolved, compiled)


def test_by_key_the_budget_must_fit_the_bundles_own_range(exec_stub, tiny_key):
    """By key the bundle's compile config governs: a budget within the request's range but past the bundle's is
    refused once the bundle's factors are read."""
    from kiln.client.load import load

    config = common_pb2.CompileConfig(device="cpu", max_compiled_tokens=512)
    request = exec_pb2.LoadModelRequest(name="tiny-by-key-budget", model=common_pb2.ModelSpec(preset="tiny-llama"),
                                        config=config, key=common_pb2.ArtifactKey(digest=tiny_key),
                                        max_num_batched_tokens=256)
    with pytest.raises(grpc.RpcError) as exc:
        load(exec_stub, request)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"max_num_batched_tokens: 256 exceeds bundle {tiny_key[:12]}'s compiled token range [1, 128]" in \
        exc.value.details()
