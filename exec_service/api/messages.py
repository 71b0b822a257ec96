"""The engine's Python values as the protobuf messages the API sends: the one place they become wire types."""

from exec_service.engine.sampler import TokenLogprobs
from exec_service.engine.sequence import FinishReason, Usage
from exec_service.startup.load_model import ModelSizing, StartupPhase
from exec_service.telemetry.forward_stats import BatchSizeStat
from protos import common_pb2, exec_pb2

FINISH_REASONS = {None: exec_pb2.FINISH_REASON_UNSPECIFIED, FinishReason.STOP: exec_pb2.FINISH_REASON_STOP,
                  FinishReason.LENGTH: exec_pb2.FINISH_REASON_LENGTH}


def startup_phase_message(phase: StartupPhase) -> exec_pb2.StartupPhase:
    return exec_pb2.StartupPhase(phase=phase.phase, seconds=phase.seconds, detail=phase.detail,
                                 progress=phase.progress, step=phase.step)


def model_sizing_message(s: ModelSizing) -> exec_pb2.ModelSizing:
    return exec_pb2.ModelSizing(
        key=common_pb2.ArtifactKey(digest=s.key), num_kv_blocks=s.num_kv_blocks, block_size=s.block_size,
        max_num_seqs=s.max_num_seqs, max_model_len=s.max_model_len, max_num_batched_tokens=s.max_num_batched_tokens,
        kv_cache_bytes=s.kv_cache_bytes, weights_bytes=s.weights_bytes, activation_peak_bytes=s.activation_peak_bytes,
        cudagraph_bytes=s.cudagraph_bytes, total_memory_bytes=s.total_memory_bytes, capture_sizes=s.capture_sizes,
        runtime_mode=s.runtime_mode.value, device=s.device, vocab_size=s.vocab_size, kv_window=s.kv_window,
        dtype=s.dtype, kv_cache_dtype=s.kv_cache_dtype, quantization=s.quantization, quantize_head=s.quantize_head,
        prefix_caching=s.prefix_caching, piecewise_capture_sizes=s.piecewise_capture_sizes,
        piecewise_graph_bytes=s.piecewise_graph_bytes, tensor_parallel_size=s.tensor_parallel_size,
        stream_interval=s.stream_interval,
        timings=[common_pb2.PhaseTiming(phase=phase, seconds=seconds) for phase, seconds in s.timings])


def usage_message(usage: Usage) -> exec_pb2.Usage:
    return exec_pb2.Usage(
        prompt_tokens=usage.prompt_tokens, output_tokens=usage.output_tokens,
        time_to_first_token_s=usage.time_to_first_token_s, total_s=usage.total_s, queue_s=usage.queue_s,
        num_preemptions=usage.num_preemptions, cached_tokens=usage.cached_tokens)


def generate_response(token_ids: list[int], text: str, finish_reason: FinishReason | None, usage: Usage | None,
                      index: int, logprobs: list[TokenLogprobs] | None,
                      token_texts: dict[int, str] | None) -> exec_pb2.GenerateResponse:
    """``token_texts``: the text of every token in ``logprobs`` (None without a tokenizer)."""
    response = exec_pb2.GenerateResponse(token_ids=token_ids, text=text, finish_reason=FINISH_REASONS[finish_reason],
                                         index=index)
    if usage is not None:
        response.usage.CopyFrom(usage_message(usage))
    texts = token_texts or {}
    for logprob in logprobs or ():
        response.logprobs.append(exec_pb2.TokenLogprob(
            token_id=logprob.token_id, logprob=logprob.logprob, token=texts.get(logprob.token_id, ""),
            top=[exec_pb2.TokenLogprob(token_id=t, logprob=lp, token=texts.get(t, "")) for t, lp in logprob.top]))
    return response


def forward_stats_response(stats: list[BatchSizeStat]) -> exec_pb2.GetForwardStatsResponse:
    return exec_pb2.GetForwardStatsResponse(stats=[
        exec_pb2.BatchSizeStats(model=s.model, batch_size=s.batch_size, count=s.count, median_ms=s.median_ms,
                                p90_ms=s.p90_ms, p99_ms=s.p99_ms, runtime_mode=s.runtime_mode, total_ms=s.total_ms,
                                phase=s.phase, path=s.path, host_wait_ms=s.host_wait_ms)
        for s in stats])
