"""Host time of one call of Kiln's attention op and of its parts, at one Llama-3-8B layer's shapes: what a step that
runs attention eagerly (launched from Python, outside the graphs) pays per layer before the GPU does anything.

Each figure is the host's µs per call over 300 calls with no sync between them (the GPU's work here is tiny, so
the host is what is timed), then the same with the GPU drained. Then the op's call behind ~20 ms of queued GPU work:
a call that waited for the GPU (a sync inside) would take those 20 ms.

usage: python bench/attention_host_cost.py [--tokens 32]
"""

import argparse
import time

import torch

from kiln.attention import (
    op,  # noqa: F401 (registers kiln::attention)
    triton_kernels,
)
from kiln.attention.forward_context import AttentionMetadata, ForwardContext, forward_context

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 32, 8, 128, 16, 32
SCALE = HEAD_DIM ** -0.5


def prefill(tokens: int) -> AttentionMetadata:
    """One sequence prefilling ``tokens`` from scratch."""
    return AttentionMetadata(torch.arange(tokens, device="cuda"),
                             torch.tensor([0, tokens], dtype=torch.int32, device="cuda"),
                             torch.tensor([tokens], dtype=torch.int32, device="cuda"),
                             torch.arange(32, dtype=torch.int32, device="cuda")[None], tokens, 1)


def mixed(tokens: int, decodes: int = 16) -> AttentionMetadata:
    """``decodes`` decodes over 100 tokens of context each, then a prefill chunk of the rest."""
    chunk = tokens - decodes
    tables = torch.arange((decodes + 1) * 8, dtype=torch.int32, device="cuda").view(decodes + 1, 8)
    return AttentionMetadata(torch.arange(tokens, device="cuda") + 1000,
                             torch.tensor([*range(decodes + 1), tokens], dtype=torch.int32, device="cuda"),
                             torch.tensor([100] * decodes + [chunk], dtype=torch.int32, device="cuda"), tables,
                             chunk, decodes + 1, decodes)


def host_us(fn, calls: int = 300) -> tuple[float, float]:
    """(host µs per call, µs per call with the GPU drained)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    launched = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (launched - start) / calls * 1e6, (done - start) / calls * 1e6


def parts(q, k, v, kv, meta: AttentionMetadata, layer: torch.Tensor) -> dict:
    """The op and what it runs, each as a call to time."""
    out = torch.zeros_like(q)
    with_decodes = meta.num_decodes > 0
    calls = {
        "torch.ops.kiln.attention": lambda: torch.ops.kiln.attention(q, k, v, layer, SCALE, 0, 0.0),
        "paged_attention, called directly": lambda: triton_kernels.paged_attention(q, k, v, kv, meta, SCALE),
        "write_kv (one launch)": lambda: triton_kernels.write_kv(k, v, kv, meta.slot_mapping),
        "prefill kernel (one launch)": lambda: triton_kernels._prefill(q, k, v, kv, meta, SCALE, 0, 0.0, out,
                                                                             with_decodes),
        "torch.zeros of the output": lambda: torch.zeros(q.shape, dtype=q.dtype, device=q.device),
    }
    if with_decodes:
        calls["decode kernels (two launches)"] = lambda: triton_kernels._decode(q, kv, meta, SCALE, 0, 0.0, out)
    return calls


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    kv = torch.zeros(2, 512, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    layer = torch.tensor(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.tokens} tokens, {HEADS} heads "
          f"({KV_HEADS} kv) of {HEAD_DIM}")
    print("| step | call | host µs per call | with the GPU drained µs |")
    print("|---|---|---|---|")
    for kind, make in (("prefill", prefill), ("mixed", mixed)):
        meta = make(args.tokens)
        q = torch.randn(args.tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.randn(args.tokens, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        calls = parts(q, k, v, kv, meta, layer)
        with forward_context(ForwardContext([kv] * LAYERS, meta)):
            for name, fn in calls.items():
                host, drained = host_us(fn)
                print(f"| {kind} | {name} | {host:.1f} | {drained:.1f} |", flush=True)
            busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            for _ in range(20):
                busy @ busy
            start = time.perf_counter()
            torch.ops.kiln.attention(q, k, v, layer, SCALE, 0, 0.0)
            call = time.perf_counter() - start
            torch.cuda.synchronize()
            print(f"| {kind} | the op behind ~20 ms of queued GPU work | {call * 1e6:.0f} (no wait) | "
                  f"{(time.perf_counter() - start) * 1e6:.0f} |")


if __name__ == "__main__":
    main()
