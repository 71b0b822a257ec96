"""A model the execute service knows: loading, ready with its engine, or failed with the reason."""

import uuid
from dataclasses import dataclass

from exec_service.api import generate_request, messages
from exec_service.engine.engine_loop import Engine
from exec_service.engine.sequence import Sequence
from exec_service.startup.load_model import StartedModel
from kiln.errors import Unavailable
from protos import exec_pb2


@dataclass(eq=False)
class ServedModel:
    name: str
    state: int = exec_pb2.MODEL_STATE_LOADING
    error: str = ""
    started: StartedModel | None = None

    @property
    def is_ready(self) -> bool:
        return self.state == exec_pb2.MODEL_STATE_READY

    def engine(self) -> Engine:
        """The serving engine; UNAVAILABLE while loading or after a failed load."""
        if self.state == exec_pb2.MODEL_STATE_LOADING:
            raise Unavailable(f"model: {self.name!r} is still loading; wait for LoadModel's ready event or the "
                              f"health status SERVING")
        if self.state == exec_pb2.MODEL_STATE_FAILED:
            raise Unavailable(f"model: {self.name!r} failed to load: {self.error}")
        return self.started.engine

    def new_sequences(self, request: exec_pb2.GenerateRequest) -> tuple[list[Sequence], tuple[str, ...]]:
        """The request as engine state (its n sequences, sharing one request id) and its stop strings, or
        INVALID_ARGUMENT naming the field at fault."""
        sizing, tokenizer = self.started.sizing, self.started.tokenizer
        prompt = generate_request.prompt_token_ids(request, tokenizer, sizing.vocab_size, sizing.max_model_len)
        params = generate_request.sampling_params(request, sizing.vocab_size)
        stop = generate_request.stop_strings(request, tokenizer)
        request_id, eos = uuid.uuid4().hex, self.started.engine.eos_token_ids
        seqs = [Sequence(request_id, prompt, generate_request.sequence_params(params, index), sizing.max_model_len,
                         eos, index=index) for index in range(generate_request.num_sequences(request))]
        return seqs, stop

    def info(self) -> exec_pb2.ModelInfo:
        failure = self.started.engine.failure if self.started is not None else None
        if failure is not None:  # the engine stopped by itself (a lost rank, a bug): loading it again is the way
            return exec_pb2.ModelInfo(name=self.name, state=exec_pb2.MODEL_STATE_FAILED, error=str(failure))
        info = exec_pb2.ModelInfo(name=self.name, state=self.state, error=self.error)
        if self.is_ready:
            engine = self.started.engine
            info.sizing.CopyFrom(messages.model_sizing_message(self.started.sizing))
            info.num_waiting = engine.num_waiting
            info.num_running = engine.num_running
            info.num_free_blocks = engine.num_free_blocks
            info.peak_used_blocks = engine.peak_used_blocks
            blocks = engine.block_manager
            info.prefix_cache_queried_tokens = blocks.queried_tokens
            info.prefix_cache_hit_tokens = blocks.hit_tokens
            info.prefix_cache_blocks = blocks.num_cached_blocks
            info.prefix_cache_evicted_blocks = blocks.evicted_blocks
        return info
