"""What Triton builds for Kiln's own kernels on a Hopper, without a GPU: registers, shared memory, spills, the
machine instructions (SASS) of each loop and the width of each global load, per kernel at the tile the tree picks.

Triton compiles for a target it is given (here sm_90, with its bundled ptxas, nvdisasm and cuobjdump), so a CPU host
can read what a kernel change does to the instruction stream before any device time is spent: a memory-bound loop
that needs more instructions per byte than the SM can issue will not reach the bandwidth however it is tiled. The
arguments are specialised as Triton's JIT specialises a real launch (16-byte-aligned pointers, integers divisible by
16, strides of 1 as constants), except those the kernel marks ``do_not_specialize``. Timing stays the GPU's: this
counts instructions, it does not run them.

usage: python bench/kernel_sass.py [--kernels decode,decode-fp8,decode-fp8-one-split,prefill,prefill-fp8,fp8-gemm,
                                             quantize-glu,norm-quantize-add] [--arch 90]
"""

import argparse
import collections
import os
import re
import subprocess
import tempfile
from typing import NamedTuple

import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kiln.attention import triton_kernels as attention
from kiln.quantization import fp8_small_m, norm_quantize_kernel, quantize_kernel

TOOLS = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
FLOATS = {"qk_scale", "cap_scale", "min_scale", "eps"}


class Build(NamedTuple):
    """A kernel as one launch of the tree builds it: its pointers' types, its constexprs, the strides passed as 1."""
    fn: object
    pointers: dict
    constexprs: dict
    ones: tuple
    num_warps: int
    num_stages: int


def _kv_cache(fp8: bool) -> tuple[dict, dict]:
    """(pointer types, constexprs) of the attention kernels' cache: FP8 with its scales, or the model's bf16 (its
    scale pointers None, as the tree launches it)."""
    if fp8:
        return (dict(k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv", k_scale_ptr="*fp32", v_scale_ptr="*fp32"),
                dict(KV_SCALED=True))
    return dict(k_cache_ptr="*bf16", v_cache_ptr="*bf16"), dict(KV_SCALED=False, k_scale_ptr=None, v_scale_ptr=None)


def _attention_kernels() -> dict:
    """Llama-3-8B's attention (32 query heads, 8 kv heads of 128, blocks of 16) at the tiles the tree picks."""
    cache = dict(block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", out_ptr="*bf16")
    heads = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, SOFTCAP=False, DOT_PRECISION="tf32")
    kernels = {}
    for name, fp8, tile in (("decode", False, attention.DECODE_TILE), ("decode-fp8", True, attention.DECODE_TILE_FP8),
                            ("decode-fp8-one-split", True, attention.DECODE_TILE_FP8_ONE_SPLIT)):
        block_n, warps, stages = tile
        pointers, constexprs = _kv_cache(fp8)
        kernels[name] = Build(
            attention._decode_split_kernel,
            dict(cache, q_ptr="*bf16", part_out_ptr="*fp32", part_lse_ptr="*fp32", counters_ptr="*i32", **pointers),
            dict(heads, GROUP=4, BLOCK_G=16, BLOCK_N=block_n, MERGE=True, BLOCK_S=attention.MAX_DECODE_SPLITS,
                 **constexprs),
            ("stride_qd", "stride_cd"), warps, stages)
    block_m, block_n, warps, stages = attention.PREFILL_CONFIG
    for name, fp8 in (("prefill", False), ("prefill-fp8", True)):
        pointers, constexprs = _kv_cache(fp8)
        kernels[name] = Build(
            attention._prefill_kernel,
            dict(cache, q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", **pointers),
            dict(heads, GROUP=4, BLOCK_M=block_m, BLOCK_N=block_n, SKIP_DECODES=False,
                 STEP_KV=attention.PREFILL_STEP_KV and not fp8, HEAVY_FIRST=attention.PREFILL_HEAVY_FIRST,
                 **constexprs),
            ("stride_qd", "stride_kd", "stride_vd", "stride_cd"), warps, stages)
    return kernels


def _quantization_kernels() -> dict:
    """Kiln's FP8 GEMM at one token (Llama-3-8B's o: K 4,096), the SiLU x up quantize of a 14,336-wide row, and the
    residual add, RMSNorm and quantize of a 4,096-wide row."""
    block_k = fp8_small_m._block_k(4096)
    block, one_pass, warps = quantize_kernel._config(2048, 14336)
    return {
        "fp8-gemm": Build(
            fp8_small_m._swap_ab_kernel,
            dict(x_ptr="*fp8e4nv", x_scale_ptr="*fp32", w_ptr="*fp8e4nv", w_scale_ptr="*fp32", out_ptr="*bf16",
                 part_ptr="*fp32", res_ptr="*bf16"),
            dict(BLOCK_M=16, BLOCK_N=fp8_small_m.BLOCK_N, BLOCK_K=block_k, SPLIT_K=1, RESIDUAL=False, PDL=True,
                 PREFETCH=fp8_small_m.prefetched_tiles(fp8_small_m.BLOCK_N, block_k, 4096)),
            (), fp8_small_m.NUM_WARPS, fp8_small_m.DEEP_STAGES),
        "quantize-glu": Build(
            quantize_kernel._quantize_kernel,
            dict(x_ptr="*bf16", up_ptr="*bf16", q_ptr="*fp8e4nv", scale_ptr="*fp32"),
            dict(GLU=True, BLOCK=block, ONE_PASS=one_pass, LEAD=True, FOLLOW=False),
            (), warps, 3),
        "norm-quantize-add": Build(
            norm_quantize_kernel._rms_norm_quantize_kernel,
            dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", sum_ptr="*bf16", q_ptr="*fp8e4nv", scale_ptr="*fp32"),
            dict(ADD=True, BLOCK=4096, LEAD=True, FOLLOW=False),
            (), norm_quantize_kernel.num_warps(4096), 3),
    }


def compile_kernel(build: Build, arch: int):
    """Triton's build of the kernel for sm_``arch``, specialised as a launch with these pointer types would be."""
    sig, attrs = {}, {}
    constexprs = dict(build.constexprs, **{name: 1 for name in build.ones})
    for param in build.fn.params:
        name = param.name
        if name in constexprs or param.is_constexpr:
            sig[name] = "constexpr"
            continue
        sig[name] = build.pointers.get(name, "fp32" if name in FLOATS else "i32")
        if not param.do_not_specialize and name not in FLOATS:
            attrs[(param.num,)] = [["tt.divisibility", 16]]
    source = ASTSource(build.fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=build.num_warps, num_stages=build.num_stages))


def _tool(name: str, *args: str) -> str:
    return subprocess.run([os.path.join(TOOLS, name), *args], capture_output=True, text=True, check=True).stdout


def loops(sass: str) -> list[tuple[int, collections.Counter]]:
    """(instructions, opcode counts) of each loop: the code from a label to a branch back to it, outermost first."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\s*\.(L_x_\d+):", line))}
    found = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`\(\.(L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            body = [x for x in lines[labels[m.group(1)]:i + 1] if re.search(r"/\*[0-9a-f]{4}\*/", x)]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x.split("*/", 1)[1].strip()).split()[0].split(".")[0]
                                      for x in body)
            found.append((len(body), ops))
    return found


def describe(name: str, build: Build, arch: int) -> str:
    compiled = compile_kernel(build, arch)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = _tool("cuobjdump", "--dump-resource-usage", f.name)
        sass = _tool("nvdisasm", "-c", f.name)
    regs = re.search(r"REG:(\d+)", usage).group(1)
    stack = re.search(r"STACK:(\d+)", usage).group(1)
    shared = compiled.metadata.shared / 1024
    body = "; ".join(f"{count}: " + ", ".join(f"{op} {n}" for op, n in ops.most_common(8))
                     for count, ops in loops(sass) if count >= 20) or "-"
    total = len(re.findall(r"/\*[0-9a-f]{4}\*/", sass))
    return (f"| {name} | {build.num_warps} / {build.num_stages} | {regs} | {stack} | {shared:.1f} | {total} | {body} | "
            f"{global_loads(sass)} | {launch_order(sass)} |")


def global_loads(sass: str) -> str:
    """The kernel's loads from global memory (LDG, and LDGSTS: to shared memory) by bits a thread, as "32x16 2x128":
    a memory-bound kernel reading 16 bits a load issues eight loads where a 128-bit one would do."""
    widths = collections.Counter()
    for op in re.findall(r"\b(LDG(?:STS)?(?:\.[A-Z0-9]+)*)(?![A-Z])", sass):
        parts = set(op.split("."))
        widths[next((w for w in ("128", "64") if w in parts), "8" if "U8" in parts or "S8" in parts
                    else "16" if "U16" in parts or "S16" in parts else "32")] += 1
    return " ".join(f"{n}x{w}" for w, n in sorted(widths.items(), key=lambda item: int(item[0]))) or "-"


def launch_order(sass: str) -> str:
    """The kernel's programmatic-launch instructions in program order, as "8 prefetch, wait, release": its L2
    prefetches (CCTL.E.PF2), its wait for the kernel before (ACQBULK) and its release of the next (PREEXIT)."""
    events = []
    for op in re.findall(r"\b(CCTL\.E\.PF2|ACQBULK|PREEXIT)\b", sass):
        event = {"ACQBULK": "wait", "PREEXIT": "release"}.get(op, "prefetch")
        if events and events[-1][0] == event:
            events[-1][1] += 1
        else:
            events.append([event, 1])
    return ", ".join(f"{n} {event}" if n > 1 else event for event, n in events) or "-"


def main() -> None:
    kernels = {**_attention_kernels(), **_quantization_kernels()}
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default=",".join(kernels))
    p.add_argument("--arch", type=int, default=90, help="compute capability: 90 for a Hopper")
    args = p.parse_args()
    print(f"Triton {triton.__version__}, sm_{args.arch}; loops of at least 20 instructions, each: instructions "
          f"(most frequent opcodes); global loads: count x bits a thread")
    print("| kernel | warps / stages | registers | stack bytes | shared KB | instructions | loops | global loads "
          "| programmatic launch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.kernels.split(","):
        print(describe(name, kernels[name], args.arch), flush=True)


if __name__ == "__main__":
    main()
