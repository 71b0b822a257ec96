"""FP8 against bfloat16 for the same weights: per-position top-1 agreement and the mean KL divergence of the
next-token distributions, for FP8 linears (dynamic W8A8), FP8 linears and head (``quantize_head``), an FP8 KV
cache (at Kiln's default scale 1.0, and at per-head scales calibrated on training text), and both.

The model must give peaked distributions for the figures to mean anything (a random model's are near uniform, so any
noise flips its top-1), so the bench first trains a small Llama for a few hundred steps on text Python itself ships
(the source of standard-library modules, byte by byte), on the CPU, then scores held-out modules. Kiln's own forward
serves every variant (kiln.model.causal_lm.build_model from the saved directory; the CPU reference attention over a
paged KV cache in the model's dtype or in FP8).

usage: python bench/fp8_accuracy.py [--steps 600] [--positions 2048] [--out DIR]
"""

import argparse
import inspect
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.attention.forward_context import AttentionMetadata, ForwardContext, forward_context
from kiln.model.causal_lm import build_model
from kiln.model.spec import resolve
from protos import common_pb2

TRAIN_MODULES = ("argparse", "collections", "dataclasses", "inspect", "logging", "pathlib", "subprocess", "typing",
                 "unittest.case", "email.message", "http.client", "json.decoder", "tarfile", "zipfile")
HELD_OUT_MODULES = ("textwrap", "shutil", "tempfile", "string", "difflib")
BLOCK_SIZE = 16


def corpus(names: tuple[str, ...]) -> torch.Tensor:
    import importlib

    text = "\n".join(inspect.getsource(importlib.import_module(n)) for n in names)
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def train(path: Path, steps: int, seq_len: int = 128, batch: int = 8) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                  max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    data = corpus(TRAIN_MODULES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    started = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,))
        x = torch.stack([data[s:s + seq_len + 1] for s in starts])
        loss = F.cross_entropy(model(x[:, :-1]).logits.reshape(-1, 256), x[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    model.to(torch.bfloat16).save_pretrained(path)


@torch.no_grad()
def next_token_logits(model, tokens: torch.Tensor, kv_dtype: torch.dtype | None,
                      scales: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Kiln's forward over one sequence, its KV written to and read from a paged cache of ``kv_dtype`` (None: no
    cache, the plain causal attention); an FP8 cache at ``scales`` per layer ([2, Hkv]), 1.0 without."""
    return _forward(model, tokens, kv_dtype, scales)[0]


@torch.no_grad()
def calibrated_scales(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Per layer and kv head, the largest |key| and |value| over ``tokens`` / 448: the scales a calibration pass
    (vLLM's calculate_kv_scales, llm-compressor's kv_cache_scheme) gives."""
    _, caches = _forward(model, tokens, torch.float32, None)
    return [cache.abs().amax(dim=(1, 2, 4)) / 448.0 for cache in caches]


def _forward(model, tokens: torch.Tensor, kv_dtype: torch.dtype | None, scales: list[torch.Tensor] | None):
    positions = torch.arange(len(tokens))
    if kv_dtype is None:
        return model.logits(model(tokens, positions)), []
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    blocks = -(-len(tokens) // BLOCK_SIZE)
    caches = [torch.zeros(2, blocks, BLOCK_SIZE, config.num_key_value_heads, head_dim, dtype=kv_dtype)
              for _ in range(config.num_hidden_layers)]
    if kv_dtype == torch.float8_e4m3fn and scales is None:
        scales = [torch.ones(2, config.num_key_value_heads) for _ in caches]
    meta = AttentionMetadata(slot_mapping=positions, query_start_loc=torch.tensor([0, len(tokens)], dtype=torch.int32),
                             seq_lens=torch.tensor([len(tokens)], dtype=torch.int32),
                             block_tables=torch.arange(blocks, dtype=torch.int32)[None], max_query_len=len(tokens),
                             num_seqs=1)
    with forward_context(ForwardContext(caches, meta, scales if kv_dtype == torch.float8_e4m3fn else None)):
        return model.logits(model(tokens, positions)), caches


def compare(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """Top-1 agreement and mean KL(reference || other) over the positions, and the reference's own confidence."""
    ref_logp, logp = F.log_softmax(reference, -1), F.log_softmax(other, -1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    return {"top1_agreement": (reference.argmax(-1) == other.argmax(-1)).float().mean().item(),
            "mean_kl": kl.mean().item(), "p99_kl": kl.quantile(0.99).item()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--positions", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--out", type=Path, default=None, help="where the trained model is saved (default: a temp dir)")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        path = args.out or Path(tmp)
        if not (path / "config.json").is_file():
            train(path, args.steps)
        spec = common_pb2.ModelSpec(hf_dir=str(path), dtype="bfloat16")
        resolved = resolve(spec, "cpu")
        bf16 = build_model(resolved, "cpu", weights=str(path))
        fp8 = build_model(resolved, "cpu", weights=str(path), quantization="fp8")
        fp8_head = build_model(resolved, "cpu", weights=str(path), quantization="fp8", quantize_head=True)
        held_out = corpus(HELD_OUT_MODULES)
        sequences = [held_out[i:i + args.seq_len + 1] for i in range(0, args.positions, args.seq_len)]
        scales = calibrated_scales(bf16, corpus(TRAIN_MODULES)[:args.seq_len])
        fp8_kv = torch.float8_e4m3fn
        variants = {"bf16": (bf16, torch.bfloat16, None), "fp8_linears": (fp8, torch.bfloat16, None),
                    "fp8_linears_and_head": (fp8_head, torch.bfloat16, None),
                    "fp8_kv": (bf16, fp8_kv, None), "fp8_kv_calibrated": (bf16, fp8_kv, scales),
                    "fp8_linears_and_kv": (fp8, fp8_kv, None), "fp8_linears_and_kv_calibrated": (fp8, fp8_kv, scales)}
        logits = {name: torch.cat([next_token_logits(m, s, kv, sc)[:-1] for s in sequences]).float()
                  for name, (m, kv, sc) in variants.items()}
        targets = torch.cat([s[1:] for s in sequences])
        reference = logits["bf16"]
        rows = {"positions": len(targets),
                "bf16_top1_accuracy": (reference.argmax(-1) == targets).float().mean().item(),
                "bf16_mean_top1_probability": F.softmax(reference, -1).max(-1).values.mean().item(),
                "bf16_loss": F.cross_entropy(reference, targets).item()}
        compared = [name for name in variants if name != "bf16"]
        rows["kv_scales_calibrated"] = [[round(v, 4) for v in layer.flatten().tolist()] for layer in scales]
        for name in compared:
            rows[name] = compare(reference, logits[name])
            rows[name]["loss"] = F.cross_entropy(logits[name], targets).item()
    print(json.dumps(rows, indent=1))
    print(f"\n{rows['positions']} held-out positions, bf16 top-1 accuracy {rows['bf16_top1_accuracy']:.3f}, mean top-1 "
          f"probability {rows['bf16_mean_top1_probability']:.3f}, loss {rows['bf16_loss']:.3f}")
    print("| against bf16 | top-1 agreement | mean KL (nats) | p99 KL | loss |")
    print("|---|---|---|---|---|")
    for name in [n for n in rows if n.startswith("fp8_")]:
        r = rows[name]
        print(f"| {name} | {r['top1_agreement']:.4f} | {r['mean_kl']:.2e} | {r['p99_kl']:.2e} | {r['loss']:.3f} |")


if __name__ == "__main__":
    main()
