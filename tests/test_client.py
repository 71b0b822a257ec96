"""kiln.client, the library the CLI, the benches and the tests use, against the session's real servers."""

import asyncio

import pytest
from conftest import TINY_CONFIG, TINY_MODEL

from kiln.client.channels import connect_aio
from kiln.client.compile import compile_model
from kiln.client.generate import generate, generate_async
from kiln.client.load import load, load_async
from kiln.client.requests import compile_config, compile_config_from_text, model_spec
from kiln.client.streams import StreamIncomplete
from protos import common_pb2, compile_pb2, exec_pb2, exec_pb2_grpc


def test_load_streams_each_phase_and_returns_the_ready_sizing(exec_stub, tiny_key):
    phases = []
    sizing = load(exec_stub, exec_pb2.LoadModelRequest(name="tiny-client", model=TINY_MODEL, config=TINY_CONFIG),
                  phases.append)
    assert sizing.key.digest == tiny_key
    assert [p.phase for p in phases if not p.progress][:2] == ["fetch", "load_weights"]


def test_a_generation_adds_up_each_of_its_sequences(exec_stub, tiny_loaded):
    request = exec_pb2.GenerateRequest(model="tiny", prompt_ids=[4, 5, 6], max_tokens=5, temperature=0.9, seed=1,
                                       ignore_eos=True, n=2)
    generation = generate(exec_stub, request)
    assert set(generation.sequences) == {0, 1}
    for sequence in generation.sequences.values():
        assert len(sequence.token_ids) == 5 and sequence.usage.output_tokens == 5
        assert sequence.finish_reason == exec_pb2.FINISH_REASON_LENGTH
    assert generation.token_ids == generation.sequences[0].token_ids


def test_the_async_calls_match_the_blocking_ones(exec_server, tiny_loaded):
    request = exec_pb2.GenerateRequest(model="tiny", prompt_ids=[7, 8], max_tokens=4, temperature=0)

    async def run():
        async with connect_aio(exec_server.address) as channel:
            stub = exec_pb2_grpc.ExecServiceStub(channel)
            sizing = await load_async(stub, exec_pb2.LoadModelRequest(name="tiny-client-aio", model=TINY_MODEL,
                                                                      config=TINY_CONFIG))
            return sizing, await generate_async(stub, request)

    sizing, generation = asyncio.run(run())
    assert sizing.max_num_batched_tokens == TINY_CONFIG.max_compiled_tokens
    assert len(generation.token_ids) == 4


class EndsEarly:
    """A stub whose streams end without their last message, as a server cut off without a status would."""

    def Compile(self, request, timeout=None):
        return iter([compile_pb2.CompileEvent(progress=compile_pb2.CompileProgress(phase="trace"))])

    def LoadModel(self, request, timeout=None):
        return iter([exec_pb2.LoadModelEvent(phase=exec_pb2.StartupPhase(phase="fetch"))])


def test_a_stream_without_its_last_message_is_said_so():
    with pytest.raises(StreamIncomplete, match="without a result"):
        compile_model(EndsEarly(), compile_pb2.CompileRequest())
    with pytest.raises(StreamIncomplete, match="before the model was ready"):
        load(EndsEarly(), exec_pb2.LoadModelRequest())


def test_requests_from_plain_values():
    assert model_spec("tiny-llama", "float32") == common_pb2.ModelSpec(preset="tiny-llama", dtype="float32")
    full_graph = compile_config("cpu", [8], 128, splitting_ops=())
    assert full_graph.HasField("splitting_ops") and not full_graph.splitting_ops.ops
    assert not compile_config("cpu").HasField("splitting_ops")
    assert compile_config_from_text("{'compile_sizes': [1]}").compile_sizes == [1]
    with pytest.raises(ValueError, match="no_such_field"):
        compile_config_from_text('{"no_such_field": 1}')
