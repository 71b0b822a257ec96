"""KV blocks: how many the memory profile gives, and how many a windowed model's sequences hold.

``profile`` (the default; GPU): KV blocks from a memory profile on the eager model (what Kiln does) against one on
the compiled model. Both profiles run the same forward at --tokens tokens plus the logits of --rows rows, measure
the peak above the weights, and size the cache with the execute service's own formula
(exec_service.startup.kv_sizing.cuda_budget).

``window`` (CPU): what freeing the blocks outside every layer's window saves on a long generation. A tiny Mistral
with a small window runs through the real engine (ModelRunner and Engine, eager, in this process) once with the
blocks freed and once keeping them all, and reports the most blocks held and whether the tokens agree. Then, for
that shape and for real presets (their windows read from the op's calls in a forward on the meta device), the
scheduler alone runs the same requests (block counts do not depend on the tokens sampled): the most blocks one
sequence holds, and how many sequences run together in a fixed pool of blocks without a preemption.

usage: python bench/kv_blocks.py --bundle STORE/KEY [--preset llama-3-8b] [--tokens 2048]
       python bench/kv_blocks.py window [--prompt 512] [--new-tokens 2048] [--window 256] [--pool-blocks 4096]
"""

import argparse
import asyncio
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from exec_service.engine.engine_config import EngineConfig
from exec_service.engine.engine_loop import Engine
from exec_service.engine.kv import kv_cache
from exec_service.engine.kv.block_manager import BlockManager
from exec_service.engine.kv.kv_cache import KVCacheSpec
from exec_service.engine.model_forward import ModelForward
from exec_service.engine.model_runner import ModelRunner
from exec_service.engine.scheduler import Scheduler
from exec_service.engine.sequence import SamplingParams, Sequence
from exec_service.engine.step_inputs import StepBuffers
from exec_service.startup import kv_sizing
from exec_service.startup.weights import load_weights
from kiln.attention.op import ATTENTION_IMPLEMENTATION
from kiln.attention.windows import kv_window, layer_windows
from kiln.model.causal_lm import TokenModel, build_model, weights_bytes
from kiln.model.spec import ResolvedModel, resolve
from kiln.runtime_mode import RuntimeMode
from kiln.store.bundle import load_compiled
from kiln.store.signing import TrustedKeys, local_keys_dir
from protos import common_pb2


def peak_bytes(forward, model, tokens: int, rows: int) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    hidden = forward(torch.zeros(tokens, dtype=torch.int64, device="cuda"), torch.arange(tokens, device="cuda"))
    model.logits(hidden[:rows])
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - baseline


def profile(args) -> None:
    if args.bundle is None:
        raise SystemExit("--bundle STORE/KEY is needed to compare the profiles")
    torch.set_grad_enabled(False)
    resolved = resolve(common_pb2.ModelSpec(preset=args.preset, dtype="bfloat16"), "cuda")
    model = build_model(resolved, "cuda")
    spec = kv_cache.KVCacheSpec.from_config(resolved.config, 16, resolved.dtype)
    eager_peak = peak_bytes(model, model, args.tokens, args.rows)
    compiled = load_compiled(args.bundle, args.bundle.name, TrustedKeys.load(
        args.trusted_keys or local_keys_dir(args.bundle.parent)))
    compiled_peak = peak_bytes(lambda ids, pos: compiled(model, ids, pos), model, args.tokens, args.rows)
    rows = []
    for label, peak in (("eager (Kiln)", eager_peak), ("compiled", compiled_peak)):
        budget = kv_sizing.cuda_budget(args.utilization, weights_bytes(model), peak, kv_sizing.CUDAGRAPH_RESERVE_BYTES,
                                       0, torch.device("cuda"))
        rows.append((label, peak, budget.kv_cache_bytes // spec.block_bytes))
    print(f"\n{args.preset} bf16, profile at {args.tokens} tokens, utilization {args.utilization}, "
          f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}")
    print("| profiled on | activation peak GiB | KV blocks (16 tokens) | vs eager |")
    print("|---|---|---|---|")
    for label, peak, blocks in rows:
        print(f"| {label} | {peak / (1 << 30):.2f} | {blocks} | {blocks / rows[0][2]:.3f}x |")


# The window question.

def tiny_mistral(window: int, max_len: int) -> ResolvedModel:
    raw = dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=max_len,
               sliding_window=window, initializer_range=0.2, eos_token_id=2)
    return resolve(common_pb2.ModelSpec(config_json=json.dumps(raw), dtype="float32"), "cpu")


def greedy(max_len: int, prompt_len: int, new_tokens: int, request_id: str = "long") -> Sequence:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return Sequence(request_id, [(7 * i + 3) % 509 + 3 for i in range(prompt_len)], params, max_model_len=max_len)


def engine_run(resolved: ResolvedModel, args, free: bool) -> tuple[list[int], int, int, float]:
    """One long greedy generation through the real engine: (tokens, most blocks held, KV window, seconds)."""
    max_len = args.prompt + args.new_tokens
    config = EngineConfig(device="cpu", runtime_mode=RuntimeMode.EAGER, max_model_len=max_len, max_num_seqs=4,
                          max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                          gpu_memory_utilization=0.9, kv_cache_bytes=0, capture_sizes=(), max_num_waiting=4)
    loaded = load_weights(resolved, config, "dummy", 0)
    window = loaded.kv_window if free else 0  # not free: the engine as it was before, every block kept
    spec = KVCacheSpec.from_config(resolved.config, args.block_size, resolved.dtype)
    kv = kv_sizing.allocate(spec, -(-max_len // args.block_size) + 1, "cpu", window)
    runner = ModelRunner(config, ModelForward(loaded.token_model), kv,
                         StepBuffers.for_config(config, resolved.config.vocab_size))
    engine = Engine("bench", runner, config, frozenset())
    engine.start()

    async def generate() -> list[int]:
        tokens = []
        async for output in engine.add_request(greedy(max_len, args.prompt, args.new_tokens)):
            if output.error is not None:
                raise output.error
            tokens += output.token_ids
        return tokens

    start = time.perf_counter()
    try:
        tokens = asyncio.run(generate())
    finally:
        engine.stop()
    return tokens, engine.peak_used_blocks, runner.kv_window, time.perf_counter() - start


@dataclass
class Shape:
    label: str
    window: int
    block_bytes: int
    prompt: int
    new_tokens: int


def preset_shape(preset: str, prompt: int, new_tokens: int, block_size: int) -> Shape:
    """A preset's KV window (from the op's calls, on the meta device: no memory) and bf16 block bytes."""
    from transformers import AutoModelForCausalLM

    resolved = resolve(common_pb2.ModelSpec(preset=preset, dtype="bfloat16"), "cpu")
    with torch.device("meta"):
        causal_lm = AutoModelForCausalLM.from_config(resolved.config, dtype=resolved.dtype)
    causal_lm.config._attn_implementation = ATTENTION_IMPLEMENTATION
    window = kv_window(layer_windows(TokenModel(causal_lm.eval()), "meta"))
    spec = kv_cache.KVCacheSpec.from_config(resolved.config, block_size, resolved.dtype)
    return Shape(f"{preset} (bf16)", window, spec.block_bytes, prompt, new_tokens)


def simulate(shape: Shape, window: int, num_seqs: int, pool_blocks: int, args) -> tuple[int, int]:
    """``num_seqs`` identical requests at once through the scheduler over ``pool_blocks`` blocks, steps overlapped
    as the engine runs them: (most blocks held at once, preemptions)."""
    manager = BlockManager(pool_blocks, args.block_size, window)
    scheduler = Scheduler(manager, max_num_seqs=num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    seqs = [greedy(shape.prompt + shape.new_tokens, shape.prompt, shape.new_tokens, str(i)) for i in range(num_seqs)]
    for seq in seqs:
        scheduler.add(seq)
    in_flight = None
    while scheduler.has_work or in_flight is not None:
        batch = scheduler.schedule()
        if in_flight is not None:
            scheduler.postprocess(in_flight, [7] * len(in_flight.sampling_entries))
        in_flight = batch if batch.entries else None
    return manager.peak_used_blocks, sum(s.num_preemptions for s in seqs)


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.machine())


def size(num_bytes: float) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB" if num_bytes >= 1 << 20 else f"{num_bytes / 1024:.0f} KiB"


def window_savings(args) -> None:
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    max_len = args.prompt + args.new_tokens
    resolved = tiny_mistral(args.window, max_len)
    freed = engine_run(resolved, args, free=True)
    kept = engine_run(resolved, args, free=False)
    spec = kv_cache.KVCacheSpec.from_config(resolved.config, args.block_size, resolved.dtype)
    print(f"\nwindow: {cpu_name()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, {time.strftime('%Y-%m-%d')}; block {args.block_size} tokens, step budget "
          f"{args.max_num_batched_tokens} tokens")
    print(f"\nThe real engine (eager, CPU): tiny Mistral, window {args.window}, prompt {args.prompt} + "
          f"{args.new_tokens} new tokens, greedy")
    print("| blocks outside the window | KV window | most blocks held | KV held at most | wall s |")
    print("|---|---|---|---|---|")
    for label, (_, peak, kv, seconds) in (("kept (before)", kept), ("freed", freed)):
        print(f"| {label} | {kv or 'none'} | {peak} | {size(peak * spec.block_bytes)} | {seconds:.1f} |")
    same = sum(a == b for a, b in zip(freed[0], kept[0], strict=True))
    print(f"tokens equal with and without freeing: {same}/{len(freed[0])}")

    shapes = [Shape(f"tiny Mistral (fp32), window {args.window}", args.window, spec.block_bytes, args.prompt,
                    args.new_tokens)]
    for preset in args.presets:
        shapes += [preset_shape(preset, args.prompt, new, args.block_size) for new in (args.new_tokens,
                                                                                       args.long_new_tokens)]
    print(f"\nThe scheduler alone (no forward), {args.pool_blocks} blocks of {args.block_size} tokens in the pool")
    print("| model | KV window | prompt + new | blocks / seq, kept | blocks / seq, freed | KV / seq, kept | "
          "KV / seq, freed | seqs in the pool, kept | seqs in the pool, freed | preemptions running them, kept / "
          "freed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        per_seq = {free: simulate(shape, shape.window if free else 0, 1, args.pool_blocks, args)[0]
                   for free in (False, True)}
        fits = {free: args.pool_blocks // per_seq[free] for free in (False, True)}
        preemptions = [simulate(shape, shape.window if free else 0, fits[free], args.pool_blocks, args)[1]
                       for free in (False, True)]
        kv = {free: size(per_seq[free] * shape.block_bytes) for free in (False, True)}
        print(f"| {shape.label} | {shape.window or 'none'} | {shape.prompt} + {shape.new_tokens} | {per_seq[False]} "
              f"| {per_seq[True]} | {kv[False]} | {kv[True]} | {fits[False]} | {fits[True]} "
              f"({fits[True] / fits[False]:.1f}x) | {preemptions[0]} / {preemptions[1]} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("question", nargs="?", choices=("profile", "window"), default="profile")
    p.add_argument("--bundle", type=Path, help="profile: the compiled bundle, STORE/KEY")
    p.add_argument("--trusted-keys", type=Path, help="profile: public key(s) the bundle must be signed by (default: "
                   "the key pair kept beside its store, as kiln demo and kiln bench keep it)")
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--utilization", type=float, default=0.9)
    p.add_argument("--prompt", type=int, default=512, help="window: prompt tokens")
    p.add_argument("--new-tokens", type=int, default=2048, help="window: tokens generated")
    p.add_argument("--long-new-tokens", type=int, default=16384, help="window: a longer generation for the presets")
    p.add_argument("--window", type=int, default=256, help="window: the tiny model's sliding window")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="window: the step's token budget")
    p.add_argument("--pool-blocks", type=int, default=4096, help="window: the fixed pool sequences share")
    p.add_argument("--presets", nargs="*", default=["mistral-7b-v0.1"], help="window: presets to size")
    args = p.parse_args()
    if args.question == "profile":
        profile(args)
    else:
        window_savings(args)


if __name__ == "__main__":
    main()
