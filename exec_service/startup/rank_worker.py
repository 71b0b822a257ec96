"""One rank > 0 of a tensor-parallel model: ``python -m exec_service.startup.rank_worker``, started by rank 0.

It reads its spec (a JSON object) from stdin, builds its shard of the model (on CUDA on its own GPU, which it sees
as cuda:0: exec_service.startup.ranks), profiles its own memory, loads the bundle (verifying its signature itself),
and writes one JSON line to stdout: ready, or the KilnError that stopped it. Then it joins the model's process
groups, agrees with the others on the KV cache's blocks (the fewest any rank holds), captures the same CUDA graphs as
rank 0 in lockstep when the model has them (graph_capture.capture_graphs), and runs each step rank 0 broadcasts, by
rank 0's path, until it is told to stop, or until rank 0 is gone (its connection closes and the broadcast fails).
"""

import dataclasses
import datetime
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from transformers import AutoConfig

from exec_service.engine.engine_config import EngineConfig
from exec_service.engine.graphs.cuda_graphs import CUDAGraphs
from exec_service.engine.kv import kv_cache
from exec_service.engine.model_forward import ModelForward
from exec_service.engine.model_runner import KVCache
from exec_service.engine.parallel import step_broadcast
from exec_service.engine.step_inputs import StepBuffers
from exec_service.startup import kv_sizing
from exec_service.startup.compiled_function import (
    load_compiled,
    warm_up_blocks,
    warm_up_compiled,
    warm_up_paged_attention,
)
from exec_service.startup.graph_capture import capture_graphs
from exec_service.startup.memory_profile import profile_memory
from exec_service.startup.process_groups import join_groups
from exec_service.startup.weights import LoadedWeights, load_weights
from kiln.errors import Internal, KilnError, first_line
from kiln.model.spec import ResolvedModel
from kiln.model.tensor_parallel import tensor_parallel_group
from kiln.runtime_mode import RuntimeMode
from kiln.step_record import StepPath
from kiln.store.signing import TrustedKeys

log = logging.getLogger("exec_service.rank")


def engine_config(fields: dict) -> EngineConfig:
    """The EngineConfig rank 0 serves with, back from its JSON form (``engine_config_fields``)."""
    fields = {**fields, "runtime_mode": RuntimeMode(fields["runtime_mode"])}
    return EngineConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def engine_config_fields(config: EngineConfig) -> dict:
    return {**dataclasses.asdict(config), "runtime_mode": config.runtime_mode.value}


@dataclass
class _Shard:
    """What a rank loaded, as rank 0 has it at the end of its load_compiled phase."""

    rank: int
    config: EngineConfig
    resolved: ResolvedModel
    loaded: LoadedWeights
    forward: ModelForward
    kv_spec: kv_cache.KVCacheSpec
    activation_peak: int
    scratch_kv: list[torch.Tensor]


def _load(spec: dict) -> _Shard:
    config = engine_config(spec["engine_config"])
    rank = spec["rank"]
    model_config = json.loads(spec["model_config"])
    resolved = ResolvedModel(spec["model"], AutoConfig.for_model(model_config.pop("model_type"), **model_config),
                             getattr(torch, spec["dtype"]), None)
    loaded = load_weights(resolved, config, spec["weights"], spec["weights_seed"], rank)
    # The order is rank 0's (load_model): the profile on the eager model, before the compiled function is loaded.
    # On the CPU it measures nothing (the budget is kv_cache_bytes), so it is not run.
    activation_peak = profile_memory(loaded.token_model, config) if config.device == "cuda" else 0
    kv_spec = kv_cache.KVCacheSpec.from_config(resolved.config, config.block_size, resolved.dtype,
                                               config.tensor_parallel_size)
    scratch_kv = kv_cache.allocate(kv_spec, warm_up_blocks(config.block_size), config.device)
    forward = ModelForward(loaded.token_model)
    if spec["bundle"] is not None:
        trusted = TrustedKeys([load_pem_public_key(pem.encode()) for pem in spec["trusted_keys"]])
        forward = ModelForward(loaded.token_model, load_compiled(Path(spec["bundle"]), spec["key"], trusted))
        warm_up_compiled(forward, config, tuple(spec["compile_sizes"]))
        warm_up_paged_attention(forward, scratch_kv, config.block_size, config.device)
    return _Shard(rank, config, resolved, loaded, forward, kv_spec, activation_peak, scratch_kv)


def _report(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


@dataclass
class RankServing:
    """A rank's side of each step: its KV cache and, with CUDA graphs, its own graphs and the buffers they read."""

    forward: ModelForward
    kv: KVCache
    buffers: StepBuffers | None = None
    full: CUDAGraphs | None = None
    mixed: CUDAGraphs | None = None

    def run(self, step: step_broadcast.StepInputs) -> None:
        """The step by rank 0's path, at its size: the same graph, or the same forward, as rank 0 runs."""
        if step.path == StepPath.FULL_GRAPH:
            self.into_graph_buffers(step)
            self.full.replay(step.padded_size)
        elif step.path == StepPath.MIXED_GRAPH:
            self.into_graph_buffers(step)
            self.mixed.replay(step.padded_size)
        else:
            self.forward(step.input_ids, step.positions, self.kv.caches, step.metadata, self.kv.scales)

    def into_graph_buffers(self, step: step_broadcast.StepInputs) -> None:
        """Rank 0's padded inputs where this rank's graphs read them (StepBuffers.graph_metadata and
        mixed_graph_metadata): its tokens and its sequence rows, padding included."""
        b, m, n, seqs = self.buffers, step.metadata, step.input_ids.shape[0], step.metadata.seq_lens.shape[0]
        b.input_ids[:n].copy_(step.input_ids)
        b.positions[:n].copy_(step.positions)
        b.slot_mapping[:n].copy_(m.slot_mapping)
        b.query_start_loc[:seqs + 1].copy_(m.query_start_loc)
        b.seq_lens[:seqs].copy_(m.seq_lens)
        rows, cols = m.block_tables.shape
        b.block_tables[:rows, :cols].copy_(m.block_tables)


def _start_serving(shard: _Shard, control: dist.ProcessGroup) -> RankServing:
    """The KV cache the ranks agree on, and the graphs around it, captured as rank 0 captures its own."""
    config = shard.config

    def agree(blocks: int) -> int:
        return step_broadcast.agree_num_blocks(control, blocks)

    def size_kv(graph_bytes: int) -> KVCache:
        return kv_sizing.allocate_budgeted(config, shard.loaded.weights_bytes, shard.activation_peak, shard.kv_spec,
                                           shard.loaded.kv_window, graph_bytes, agree)

    if config.runtime_mode != RuntimeMode.CUDAGRAPH:  # as rank 0, once the groups exist
        return RankServing(shard.forward, size_kv(0))

    buffers = StepBuffers.for_config(config, shard.resolved.config.vocab_size, shard.kv_spec.num_kv_heads)
    scratch_scales = kv_cache.allocate_scales(shard.kv_spec, config.kv_cache_scale, config.device)
    graphs = capture_graphs(shard.forward, config, shard.resolved, buffers, (shard.scratch_kv, scratch_scales),
                            size_kv)
    return RankServing(shard.forward, graphs.kv, buffers, graphs.full, graphs.mixed)


@torch.no_grad()
def _serve(shard: _Shard, spec: dict) -> None:
    config = shard.config
    store = dist.TCPStore("127.0.0.1", spec["store_port"], config.tensor_parallel_size, False,
                          timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    control, collective = join_groups(store, shard.rank, config.tensor_parallel_size, config.device,
                                      datetime.timedelta(seconds=spec["step_timeout_s"]))
    with tensor_parallel_group(collective):
        serving = _start_serving(shard, control)
        del shard.scratch_kv
        log.info("rank %d: %d KV blocks; serving", shard.rank, serving.kv.caches[0].shape[1])
        bounds = step_broadcast.StepBounds(config.max_num_batched_tokens, config.max_num_seqs,
                                           config.max_blocks_per_seq)
        while (step := step_broadcast.receive_step(control, collective, config.device, bounds)) is not None:
            serving.run(step)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = json.loads(sys.stdin.read())
    try:
        shard = _load(spec)
    except KilnError as exc:
        _report({"error": {"code": exc.code, "message": str(exc)}})
        sys.exit(1)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the load with it
        log.exception("rank %d: load failed", spec["rank"])
        error = Internal(f"rank {spec['rank']}: {first_line(exc)}")
        _report({"error": {"code": error.code, "message": str(error)}})
        sys.exit(1)
    _report({"ready": True})
    _serve(shard, spec)
    # Told to stop. On CUDA the interpreter's teardown would destroy the NCCL communicator while CUDA graphs that
    # captured its calls may still exist, and NCCL waits for those graphs before it lets go (the teardown hangs:
    # pytorch/pytorch#115388); nothing is left to flush but the log, so the process ends here.
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
