"""The load_compiled phase: the bundle's compiled layers, unpickled without compiling, and their first calls paid
here rather than in a request's step."""

from itertools import pairwise
from pathlib import Path

import torch

from exec_service.engine.engine_config import EngineConfig
from exec_service.engine.model_forward import ModelForward
from kiln.attention.forward_context import AttentionMetadata
from kiln.compilation.counters import expect_no_compile
from kiln.errors import FailedPrecondition, first_line
from kiln.store import bundle
from kiln.store.signing import TrustedKeys


def load_compiled(bundle_dir: Path, key: str, trusted: TrustedKeys):
    """The bundle's compiled layers once its signature verifies, compiling nothing."""
    with expect_no_compile("loading the compiled function"):
        try:
            return bundle.load_compiled(bundle_dir, key, trusted)
        except (RuntimeError, AssertionError) as exc:
            raise FailedPrecondition(f"bundle {bundle_dir.name[:12]}: torch refused to load it: "
                                     f"{first_line(exc)}") from exc


# Steps of up to these many tokens run Triton kernels of their own: Kiln's FP8 product builds one a power-of-two
# block of rows, up to 128 (kiln.quantization.fp8_small_m; the step's row count is not specialised on).
ROW_BLOCKS = (16, 32, 64, 128)


@torch.no_grad()
def warm_up_compiled(forward: ModelForward, config: EngineConfig, compile_sizes: tuple[int, ...]) -> None:
    """The first call at a token count does one-off work (kernel loads, launch setup, Inductor's pick among a
    kernel's configs): pay it here for the smallest and the largest step and every compile size, whose code is its
    own, not in a request's step (BENCHMARKS.md, startup and throughput); on a GPU also at the largest step of each
    of ROW_BLOCKS, which a step launched from Python (no CUDA graph) would otherwise build after ready. The largest
    step goes first: the symbolic piece's kernels pick their config once, timed at their first call, and it is the
    long steps whose kernels move enough bytes for the pick to matter."""
    tokens = config.max_num_batched_tokens
    sizes = {min(2, tokens), tokens, *(s for s in compile_sizes if s <= tokens)}
    if config.device != "cpu":
        sizes |= {s for s in ROW_BLOCKS if s <= tokens}
    with expect_no_compile("warming up the compiled function"):
        for size in sorted(sizes, reverse=True):
            forward.compiled_forward(torch.zeros(size, dtype=torch.int64, device=config.device),
                                     torch.arange(size, device=config.device))
        forward.compiled.skip_guard_checks()  # every layer's weights passed torch's guards just now


@torch.no_grad()
def warm_up_blocks(block_size: int) -> int:
    """KV blocks ``warm_up_paged_attention`` writes: two sequences of three tokens at most."""
    return 2 * -(-3 // block_size)


def warm_up_paged_attention(forward: ModelForward, kv_caches: list[torch.Tensor], block_size: int,
                            device: str, kv_scales: list[torch.Tensor] | None = None) -> None:
    """A two-token prefill, then one decode step, of one sequence through a paged KV cache, the decode again over
    tables 256 and 1,024 tokens wide, then a mixed step (that decode beside a second sequence's two-token prefill):
    the attention kernels are built here (Triton's JIT), every variant of the prefill kernel and of the decode
    kernel among them, not in a request's first step. The decode kernel's variant follows the splits of a
    sequence's context, which follow the table's width: one split over the narrow table, several over the others,
    merged by the last split (4 of at least 64 tokens over 256, on CUDA with split counters as a serving step has
    them) or by the reduce kernel (over 1,024). ``kv_caches`` need only its first blocks."""
    if kv_caches[0].shape[1] < warm_up_blocks(block_size):
        return
    tables = torch.arange(warm_up_blocks(block_size), dtype=torch.int32, device=device).view(2, -1)
    wide = {}
    for width in (256, 1024):  # past 3 tokens, never read
        wide[width] = torch.zeros(1, -(-width // block_size), dtype=torch.int32, device=device)
        wide[width][0, :tables.shape[1]] = tables[0]
    second = int(tables[1, 0]) * block_size
    counters = (torch.zeros(2, kv_caches[0].shape[3], dtype=torch.int32, device=device)
                if torch.device(device).type == "cuda" else None)
    # (positions, slots, query starts, sequence lengths, block tables, decodes first)
    steps = ((range(0, 2), range(0, 2), [0, 2], [2], tables[:1], 0),
             (range(2, 3), range(2, 3), [0, 1], [3], tables[:1], 1),
             (range(2, 3), range(2, 3), [0, 1], [3], wide[256], 1),
             (range(2, 3), range(2, 3), [0, 1], [3], wide[1024], 1),
             ([2, 0, 1], [2, second, second + 1], [0, 1, 3], [3, 2], tables, 1))
    for positions, slots, starts, lens, table, decodes in steps:
        positions = torch.tensor(list(positions), device=device)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(list(slots), device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), block_tables=table,
            max_query_len=max(b - a for a, b in pairwise(starts)), num_seqs=len(table), num_decodes=decodes,
            split_counters=counters)
        forward(torch.zeros_like(positions), positions, kv_caches, metadata, kv_scales)
