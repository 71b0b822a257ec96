"""One rank > 0 of a tensor-parallel model: ``python -m exec_service.startup.rank_worker``, started by rank 0.

It reads its spec (a JSON object) from stdin, builds its shard of the model, loads the bundle (verifying its
signature itself), and writes one JSON line to stdout: ready, or the KilnError that stopped it. Then it joins the
model's process group, allocates its KV cache at the size rank 0 chose, and runs each step rank 0 broadcasts until it
is told to stop, or until rank 0 is gone (its connection closes and the broadcast fails).
"""

import dataclasses
import datetime
import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from transformers import AutoConfig

from exec_service.engine.engine_config import EngineConfig
from exec_service.engine.kv import kv_cache
from exec_service.engine.model_forward import ModelForward
from exec_service.engine.parallel import step_broadcast
from exec_service.startup.compiled_function import load_compiled, warm_up_compiled
from kiln.errors import Internal, KilnError, first_line
from kiln.model.causal_lm import build_model
from kiln.model.spec import ResolvedModel
from kiln.model.tensor_parallel import TensorParallel, tensor_parallel_group
from kiln.runtime_mode import RuntimeMode
from kiln.store.signing import TrustedKeys

log = logging.getLogger("exec_service.rank")


def engine_config(fields: dict) -> EngineConfig:
    """The EngineConfig rank 0 serves with, back from its JSON form (``engine_config_fields``)."""
    fields = {**fields, "runtime_mode": RuntimeMode(fields["runtime_mode"])}
    return EngineConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def engine_config_fields(config: EngineConfig) -> dict:
    return {**dataclasses.asdict(config), "runtime_mode": config.runtime_mode.value}


def _load(spec: dict) -> tuple[ModelForward, EngineConfig, kv_cache.KVCacheSpec]:
    config = engine_config(spec["engine_config"])
    model_config = json.loads(spec["model_config"])
    resolved = ResolvedModel(spec["model"], AutoConfig.for_model(model_config.pop("model_type"), **model_config),
                             getattr(torch, spec["dtype"]), None)
    rank = TensorParallel(spec["rank"], config.tensor_parallel_size)
    token_model = build_model(resolved, config.device, spec["weights"], spec["weights_seed"], tensor_parallel=rank)
    forward = ModelForward(token_model)
    if spec["bundle"] is not None:
        trusted = TrustedKeys([load_pem_public_key(pem.encode()) for pem in spec["trusted_keys"]])
        forward = ModelForward(token_model, load_compiled(Path(spec["bundle"]), spec["key"], trusted))
        warm_up_compiled(forward, config, tuple(spec["compile_sizes"]))
    kv_spec = kv_cache.KVCacheSpec.from_config(resolved.config, config.block_size, resolved.dtype,
                                               config.tensor_parallel_size)
    return forward, config, kv_spec


def _report(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


@torch.no_grad()
def _serve(forward: ModelForward, config: EngineConfig, kv_spec: kv_cache.KVCacheSpec, spec: dict) -> None:
    store = dist.TCPStore("127.0.0.1", spec["store_port"], config.tensor_parallel_size, False,
                          timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    group = dist.ProcessGroupGloo(store, spec["rank"], config.tensor_parallel_size,
                                  datetime.timedelta(seconds=spec["step_timeout_s"]))
    blocks = step_broadcast.receive_num_blocks(group)
    caches = kv_cache.allocate(kv_spec, blocks, config.device)
    log.info("rank %d: %d KV blocks; serving", spec["rank"], blocks)
    with tensor_parallel_group(group):
        while (step := step_broadcast.receive_step(group, config.device)) is not None:
            forward(step.input_ids, step.positions, caches, step.metadata)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = json.loads(sys.stdin.read())
    try:
        forward, config, kv_spec = _load(spec)
    except KilnError as exc:
        _report({"error": {"code": exc.code, "message": str(exc)}})
        sys.exit(1)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the load with it
        log.exception("rank %d: load failed", spec["rank"])
        error = Internal(f"rank {spec['rank']}: {first_line(exc)}")
        _report({"error": {"code": error.code, "message": str(error)}})
        sys.exit(1)
    _report({"ready": True})
    _serve(forward, config, kv_spec, spec)


if __name__ == "__main__":
    main()
