"""Prefill and mixed steps of up to 512 tokens: the step's time against the sum of its own GPU kernels, replayed from
mixed CUDA graphs (the whole step, attention included) and launched from Python (the compiled layers), on one GPU.

A step is host-bound when its time (CUDA events around the forward, as the engine's forward stats time it) is well
over its kernels' sum (the profiler's CUDA kernel events): the GPU waits for launches. The target is at most 1.15x.
Steps: one sequence prefilling T tokens from scratch, and a mixed step of 16 decodes (1,024 tokens of context each)
with a prefill chunk of T - 16 tokens. Compiles the preset once (a compile service in this process, on loopback, fresh
store), then loads the bundle as the execute service does (signature checked, no compile).

With --host-profile, each step launched from Python is also run under cProfile, and the functions that hold the host
longest (their own time) are printed: where a host-bound step's time goes.

A step of a captured size that is slower than a larger size's is named at the end: padding it up would be faster, so
that size is not worth its graph (cuBLAS's 448-row GEMM on the H200 was one).

usage: python bench/prefill_steps.py [--preset llama-3-8b] [--tokens 8,16,...,512 (the default capture sizes)]
                                     [--json-out FILE] [--host-profile]
"""

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import tempfile
import time
from pathlib import Path

import grpc
import torch
from forward_latency import BLOCK_SIZE, time_ms
from layer_kernels import profile_step

from exec_service.engine.engine_config import DEFAULT_PIECEWISE_CAPTURE_SIZES
from exec_service.engine.kv import kv_cache
from exec_service.engine.model_forward import ModelForward
from exec_service.engine.step_inputs import StepBuffers
from exec_service.startup.graph_capture import mixed_graphs
from kiln.attention.forward_context import AttentionMetadata
from kiln.compilation.counters import expect_no_compile
from kiln.model.causal_lm import build_model
from kiln.model.spec import resolve
from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from kiln.store.bundle import load_compiled
from kiln.store.signing import Signer, TrustedKeys, generate_key_pair, local_keys_dir
from protos import common_pb2, compile_pb2, compile_pb2_grpc

DECODES = 16
CONTEXT = 1024
MAX_TOKENS = 512


async def compile_bundle(store: Path, spec: common_pb2.ModelSpec, config) -> str:
    """The bundle's key, compiled by a compile service started here for it."""
    from compile_service.server import CompileServerSettings, start_compile_server

    signing_key, _ = generate_key_pair(local_keys_dir(store))
    server, port = await start_compile_server(CompileServerSettings("127.0.0.1:0", store, Signer.load(signing_key)))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
            key = ""
            async for event in compile_pb2_grpc.CompileServiceStub(channel).Compile(
                    compile_pb2.CompileRequest(model=spec, config=config)):
                if event.HasField("result"):
                    key = event.result.key.digest
            return key
    finally:
        await server.stop(grace=1)


def step_metadata(tokens: int, mixed: bool, max_blocks: int) -> AttentionMetadata:
    """One prefill of ``tokens`` (blocks from 0), or 16 decodes over CONTEXT tokens and a prefill of the rest."""
    decodes = DECODES if mixed else 0
    chunk = tokens - decodes
    context_blocks = -(-(CONTEXT + 1) // BLOCK_SIZE)
    tables = torch.arange((decodes + 1) * max_blocks, dtype=torch.int32, device="cuda").view(decodes + 1, max_blocks)
    slots = [int(tables[i, CONTEXT // BLOCK_SIZE]) * BLOCK_SIZE + CONTEXT % BLOCK_SIZE for i in range(decodes)]
    slots += [int(tables[decodes, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(chunk)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device="cuda"),
        query_start_loc=torch.tensor([*range(decodes + 1), tokens], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([CONTEXT + 1] * decodes + [chunk], dtype=torch.int32, device="cuda"),
        block_tables=tables[:, :max(context_blocks, -(-chunk // BLOCK_SIZE))].contiguous(),
        max_query_len=chunk, num_seqs=decodes + 1, num_decodes=decodes)


def host_profile(fn, steps: int = 20, top: int = 25) -> str:
    """The ``top`` functions by their own host time over ``steps`` calls of ``fn`` under cProfile (which slows small
    functions more than large ones: a ranking, not a timing)."""
    fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def fill_buffers(buffers: StepBuffers, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 padded: int) -> None:
    """The step where the mixed graph of ``padded`` tokens reads it, padded as StepBuffers.prepare pads it (part of
    the step's time, as the engine's upload is)."""
    tokens, seqs, rows = ids.shape[0], meta.seq_lens.shape[0], buffers.mixed_rows(padded)
    buffers.input_ids[:tokens] = ids
    buffers.positions[:tokens] = positions
    buffers.slot_mapping[:padded] = -1
    buffers.slot_mapping[:tokens] = meta.slot_mapping
    buffers.query_start_loc[:seqs + 1] = meta.query_start_loc
    buffers.query_start_loc[seqs + 1:rows + 1] = tokens
    buffers.seq_lens[:rows] = 0
    buffers.seq_lens[:seqs] = meta.seq_lens
    buffers.block_tables[:seqs, :meta.block_tables.shape[1]] = meta.block_tables


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_PIECEWISE_CAPTURE_SIZES)))
    p.add_argument("--json-out", type=Path)
    p.add_argument("--host-profile", action="store_true", help="cProfile each step launched from Python too")
    args = p.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    spec = common_pb2.ModelSpec(preset=args.preset, dtype="bfloat16")
    config = common_pb2.CompileConfig(device="cuda", max_compiled_tokens=MAX_TOKENS)
    with tempfile.TemporaryDirectory() as tmp:
        key = asyncio.run(compile_bundle(Path(tmp) / "store", spec, config))
        torch.set_grad_enabled(False)
        resolved = resolve(spec, "cuda")
        model = build_model(resolved, "cuda")
        with expect_no_compile("loading the bundle"):
            compiled = load_compiled(Path(tmp) / "store" / key, key,
                                     TrustedKeys.load(local_keys_dir(Path(tmp) / "store")))
    forward = ModelForward(model, compiled)
    max_blocks = -(-(CONTEXT + MAX_TOKENS + 1) // BLOCK_SIZE)
    caches = kv_cache.allocate(kv_cache.KVCacheSpec.from_config(resolved.config, BLOCK_SIZE, resolved.dtype),
                               (DECODES + 1) * max_blocks, "cuda")
    buffers = StepBuffers(MAX_TOKENS, DECODES + 1, max_blocks, BLOCK_SIZE, resolved.config.vocab_size, "cuda")
    for tokens in (2, MAX_TOKENS):  # the execute service's warm-up
        forward.compiled_forward(torch.zeros(tokens, dtype=torch.int64, device="cuda"),
                                 torch.arange(tokens, device="cuda"))
    compiled.skip_guard_checks()
    graphs = mixed_graphs(forward, DEFAULT_PIECEWISE_CAPTURE_SIZES, resolved, buffers, torch.cuda.graph_pool_handle())
    with expect_no_compile("capturing"):
        graphs.capture(caches)
    print(f"captured {len(graphs.graphs)} mixed graphs in {graphs.seconds:.2f} s, "
          f"{graphs.captured_bytes / 2**20:.0f} MiB", flush=True)

    rows = []
    for mixed in (False, True):
        for tokens in sizes:
            if mixed and tokens < DECODES + 2:  # a mixed step's chunk has at least two tokens
                continue
            meta = step_metadata(tokens, mixed, max_blocks)
            ids = torch.randint(0, resolved.config.vocab_size, (tokens,), device="cuda")
            positions = torch.arange(tokens, device="cuda")
            padded = graphs.padded_size(tokens)

            def graphed(padded=padded, ids=ids, positions=positions, meta=meta):
                fill_buffers(buffers, ids, positions, meta, padded)
                graphs.replay(padded)

            def launched(ids=ids, positions=positions, meta=meta):
                forward(ids, positions, caches, meta)

            row = {"step": "mixed" if mixed else "prefill", "tokens": tokens, "padded": padded}
            for name, fn in (("graph", graphed), ("compiled", launched)):
                kernels = profile_step(fn, 10)
                row[f"{name}_ms"] = time_ms(fn)
                row[f"{name}_kernels_ms"] = sum(us for _, us in kernels.values()) / 1e3
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.host_profile:
                print(f"host profile, {row['step']} of {tokens} tokens launched from Python (20 steps):\n"
                      f"{host_profile(launched)}", flush=True)

    print(f"\n{args.preset} bf16, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}: a prefill of T tokens, "
          f"and a mixed step of {DECODES} decodes ({CONTEXT} tokens of context) + a chunk of T - {DECODES}")
    print("| step | T | padded | mixed graph ms | its kernels ms | step/kernels | compiled (Python) ms "
          "| its kernels ms | step/kernels |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['tokens']} | {r['padded']} | {r['graph_ms']:.2f} | "
              f"{r['graph_kernels_ms']:.2f} | {r['graph_ms'] / r['graph_kernels_ms']:.2f}x | "
              f"{r['compiled_ms']:.2f} | {r['compiled_kernels_ms']:.2f} | "
              f"{r['compiled_ms'] / r['compiled_kernels_ms']:.2f}x |")
    for r in rows:  # a captured size is worth its graph only where its step beats the next sizes' (issue 28: 448)
        faster = [o for o in rows if o["step"] == r["step"] and o["padded"] > r["padded"]
                  and o["graph_ms"] < r["graph_ms"]]
        if faster:
            print(f"slower than a larger size: a {r['step']} step padded to {r['padded']} takes "
                  f"{r['graph_ms']:.2f} ms, one padded to {faster[0]['padded']} {faster[0]['graph_ms']:.2f} ms")
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
