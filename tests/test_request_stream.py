"""Outputs reach a Generate handler in order; a handler that fell behind gets what piled up as one message."""

import asyncio
import threading

from exec_service.engine.request_stream import RequestOutput, RequestStream, deliver
from exec_service.engine.sequence import FinishReason, Usage
from kiln.errors import Internal


def test_pending_outputs_go_out_as_one_and_in_order():
    async def scenario():
        loop = asyncio.get_running_loop()
        streams = [RequestStream(loop), RequestStream(loop)]
        usage = Usage(prompt_tokens=1, output_tokens=4, time_to_first_token_s=0.1, total_s=0.2, queue_s=0.0,
                      num_preemptions=0)
        # The engine thread delivers four steps while the handlers are busy elsewhere.
        def engine():
            for token in (1, 2, 3):
                deliver([(s, RequestOutput([token + 10 * i])) for i, s in enumerate(streams)])
            deliver([(s, RequestOutput([4 + 10 * i], FinishReason.LENGTH, usage))
                     for i, s in enumerate(streams)])
        thread = threading.Thread(target=engine)
        thread.start()
        thread.join()
        await asyncio.sleep(0)  # the deliveries' callbacks run
        return [[output async for output in s] for s in streams]

    first, second = asyncio.run(scenario())
    assert [o.token_ids for o in first] == [[1, 2, 3, 4]]
    assert first[0].finish_reason == FinishReason.LENGTH and first[0].usage.output_tokens == 4
    assert [o.token_ids for o in second] == [[11, 12, 13, 14]]


def test_an_error_is_not_merged_into_tokens_before_it():
    async def scenario():
        stream = RequestStream(asyncio.get_running_loop())
        deliver([(stream, RequestOutput([5]))])
        deliver([(stream, RequestOutput(error=Internal("forward failed")))])
        await asyncio.sleep(0)
        return [output async for output in stream]

    tokens, failure = asyncio.run(scenario())
    assert tokens.token_ids == [5] and tokens.error is None
    assert isinstance(failure.error, Internal) and failure.is_last


def test_outputs_one_at_a_time_when_the_handler_keeps_up():
    async def scenario():
        stream = RequestStream(asyncio.get_running_loop())
        received = []

        async def handler():
            async for output in stream:
                received.append(output.token_ids)

        task = asyncio.ensure_future(handler())
        for token in range(3):
            stream.put(RequestOutput([token], FinishReason.STOP if token == 2 else None))
            await asyncio.sleep(0.01)
        await task
        return received

    assert asyncio.run(scenario()) == [[0], [1], [2]]


def test_a_requests_sequences_coalesce_each_on_its_own_until_every_one_ended():
    async def scenario():
        stream = RequestStream(asyncio.get_running_loop(), num_sequences=2)
        for token in (1, 2):
            deliver([(stream, RequestOutput([token], index=0)), (stream, RequestOutput([10 + token], index=1))])
        deliver([(stream, RequestOutput([3], FinishReason.STOP, index=0))])
        await asyncio.sleep(0)
        received = []

        async def handler():
            async for output in stream:
                received.append((output.index, output.token_ids, output.finish_reason))
                if len(received) == 1:  # the engine goes on while the handler sends
                    stream.put(RequestOutput([13], index=1))
                    await asyncio.sleep(0.01)
                elif len(received) == 3:
                    stream.put(RequestOutput([14], FinishReason.LENGTH, index=1))

        await asyncio.wait_for(handler(), timeout=5)
        return received

    assert asyncio.run(scenario()) == [(0, [1, 2, 3], FinishReason.STOP), (1, [11, 12], None), (1, [13], None),
                                       (1, [14], FinishReason.LENGTH)]
