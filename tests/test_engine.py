"""The engine loop on the eager tiny model: a failed forward fails its step's requests, never the engine."""

import asyncio
import threading

import pytest
from conftest import TINY_MODEL

from exec_service.engine.engine_config import EngineConfig
from exec_service.engine.engine_loop import Engine
from exec_service.engine.model_runner import ModelRunner
from exec_service.engine.sequence import SamplingParams, Sequence
from exec_service.startup import kv_sizing
from kiln.errors import Internal
from kiln.model_spec import resolve
from kiln.runtime_mode import RuntimeMode

CONFIG = EngineConfig(device="cpu", runtime_mode=RuntimeMode.EAGER, max_model_len=64, max_num_seqs=4,
                      max_num_batched_tokens=64, block_size=16, gpu_memory_utilization=0.9, kv_cache_bytes=1 << 20,
                      capture_sizes=(), max_num_waiting=16)


class FailingOnce:
    """Fault injection (no real forward fails on demand on CPU): the next step after ``arm()`` raises as a device
    error would, every other step runs the real forward. ``failed`` is the request ids of the step that failed."""

    def __init__(self, execute):
        self._execute = execute
        self._armed = threading.Event()
        self.failed: list[str] = []

    def arm(self) -> None:
        self._armed.set()

    def __call__(self, batch):
        if self._armed.is_set():
            self._armed.clear()
            self.failed = [entry.seq.request_id for entry in batch.entries]
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self._execute(batch)


@pytest.fixture
def engine():
    runner = ModelRunner(resolve(TINY_MODEL, "cpu"), CONFIG)
    runner.load_weights("dummy", 0)
    runner.allocate_kv_cache(kv_sizing.num_blocks(kv_sizing.memory_budget(CONFIG, runner.weights_bytes, 0),
                                                  runner.kv_cache_spec, CONFIG.max_model_len))
    runner.execute = FailingOnce(runner.execute)
    engine = Engine("tiny", runner, CONFIG, frozenset())
    engine.start()
    yield engine
    engine.stop()


def request(request_id: str) -> Sequence:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return Sequence(request_id, [5, 6, 7, 8, 9], params, max_model_len=CONFIG.max_model_len)


async def outcome(engine: Engine, seq: Sequence) -> tuple[list[int], Exception | None]:
    tokens = []
    async for output in engine.add_request(seq):
        if output.error is not None:
            return tokens, output.error
        tokens += output.token_ids
    return tokens, None


def test_a_failed_forward_fails_its_steps_requests_and_the_engine_serves_on(engine):
    async def run():
        before = await outcome(engine, request("before"))
        engine.runner.execute.arm()
        doomed = await asyncio.gather(outcome(engine, request("a")), outcome(engine, request("b")))
        after = await outcome(engine, request("after"))
        return before, doomed, after

    before, doomed, after = asyncio.run(run())
    assert before == (before[0], None) and len(before[0]) == 6
    failed = engine.runner.execute.failed
    assert failed  # "a", and "b" too when both were in that step
    for request_id, (tokens, error) in zip("ab", doomed, strict=True):
        if request_id in failed:
            assert isinstance(error, Internal)
            assert str(error) == "forward failed: RuntimeError: CUDA error: an illegal memory access was encountered"
        else:  # it joined at the next step: untouched
            assert (tokens, error) == before
    assert after == before  # same prompt, greedy: the same tokens, from an engine that went on
    assert engine.num_running == 0 and engine.num_free_blocks == engine.runner.num_blocks  # nothing leaked
