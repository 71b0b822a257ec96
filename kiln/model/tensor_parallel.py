"""Tensor parallelism: a decoder layer as one rank's shard of it, and the all-reduce that joins the shards.

Megatron's split, as transformers' ``base_model_tp_plan`` for Llama has it: q/k/v and gate/up by output columns
(each rank its heads, its KV heads, its part of the MLP), o and down by input rows, their partial products summed
over the ranks by one all-reduce each. The embedding, the final norm and the head are replicated. Every rank's
shard has the same shapes, so one compiled layer serves every rank.

The all-reduce is a custom op (``kiln::tp_all_reduce``) rather than a functional collective: Dynamo traces a
functional collective only against a live process group, whose name the compiled code then holds. The compile
service serves many models and joins no group; the op is opaque to Dynamo and Inductor, so the compiled code calls it
and the group is the one the calling thread set (``tensor_parallel_group``), per model, at run time.
"""

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from kiln.dispatcher_op import dispatcher_op
from kiln.errors import InvalidArgument
from kiln.model.merged_projections import GROUPS, ProjectionSlice
from kiln.thread_value import ThreadValue

TP_ALL_REDUCE_OP_NAME = "kiln::tp_all_reduce"
MAX_TENSOR_PARALLEL_SIZE = 8  # the GPUs of one host
# Families whose sharded layers are tested equal to one rank (tests/test_tensor_parallel.py).
TENSOR_PARALLEL_FAMILIES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int


_group: ThreadValue[torch.distributed.ProcessGroup] = ThreadValue()  # per thread: each model's engine has its own


def tensor_parallel_group(group: torch.distributed.ProcessGroup) -> AbstractContextManager[None]:
    """Sum the shards' partial products over ``group`` in the forwards this thread runs inside the block."""
    return _group.set(group)


def _fake(partial):
    return torch.empty_like(partial)


@dispatcher_op(TP_ALL_REDUCE_OP_NAME, "(Tensor partial) -> Tensor", _fake)
def tp_all_reduce(partial: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's ``partial``. Outside a group (the compile service's forward that finds the layers'
    inputs, and the execute service's memory profile and warm-ups, which each rank runs alone) the shard's own partial
    sum stands: those forwards are for shapes and first calls, not for values."""
    total = partial.clone()
    group = _group.get()
    if group is not None:
        group.allreduce([total]).wait()
    return total


class RowParallelLinear(torch.nn.Module):
    """A linear whose input features are divided among the ranks: this rank's columns of the weight, the partial
    products summed over the ranks, the bias (whole) added once after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape  # in_features: this rank's columns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.kiln.tp_all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def check_shardable(config, size: int, field: str = "tensor_parallel_size") -> None:
    """INVALID_ARGUMENT naming ``field`` for a model that cannot be divided into ``size`` shards."""
    if not 1 <= size <= MAX_TENSOR_PARALLEL_SIZE:
        raise InvalidArgument(f"{field}: {size} is outside [1, {MAX_TENSOR_PARALLEL_SIZE}]")
    if size == 1:
        return
    if config.model_type not in TENSOR_PARALLEL_FAMILIES:
        raise InvalidArgument(f"{field}: {size} ranks serve {', '.join(TENSOR_PARALLEL_FAMILIES)} models so far, "
                              f"not {config.model_type!r}")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, count in (("num_key_value_heads", kv_heads), ("num_attention_heads", heads),
                        ("intermediate_size", config.intermediate_size)):
        if count % size:
            raise InvalidArgument(f"{field}: {size} ranks cannot divide the model's {name} {count}; choose a "
                                  f"tensor_parallel_size that divides it")


def shard_layers(layers: list[torch.nn.Module], config, tp: TensorParallel) -> None:
    """Make each decoder layer (its q/k/v and gate/up merged, kiln.model.merged_projections) rank ``tp.rank``'s
    shard, in place; the whole layer's tensors are let go as each shard is cut."""
    check_shardable(config, tp.size)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if isinstance(attn.o_proj, RowParallelLinear):
            continue  # sharded as it was built (kiln.model.causal_lm: dummy weights, layer by layer)
        if not isinstance(attn.q_proj, ProjectionSlice) or not isinstance(mlp.gate_proj, ProjectionSlice):
            raise InvalidArgument("tensor_parallel_size: the decoder's projections are not plain linears (FP8?); "
                                  "tensor parallelism shards plain linears only")
        q = attn.q_proj.out_features // tp.size
        kv = attn.k_proj.out_features // tp.size
        _shard_merged(attn, ("q_proj", "k_proj", "v_proj"), (q, kv, kv), tp.rank)
        attn.o_proj = _row_parallel(attn.o_proj, tp)
        inner = mlp.gate_proj.out_features // tp.size
        _shard_merged(mlp, ("gate_proj", "up_proj"), (inner, inner), tp.rank)
        mlp.down_proj = _row_parallel(mlp.down_proj, tp)


def _shard_merged(parent: torch.nn.Module, names: tuple[str, ...], widths: tuple[int, ...], rank: int) -> None:
    """The group's merged weight cut to this rank's rows of each projection, merged again."""
    slices = [getattr(parent, name) for name in names]
    rows = [torch.arange(s.start + rank * w, s.start + (rank + 1) * w) for s, w in zip(slices, widths, strict=True)]
    index = torch.cat(rows).to(slices[0].weight.device)
    weight = torch.nn.Parameter(slices[0].weight.detach().index_select(0, index), requires_grad=False)
    bias = None
    if slices[0].bias is not None:
        bias = torch.nn.Parameter(slices[0].bias.detach().index_select(0, index), requires_grad=False)
    start = 0
    for name, width in zip(names, widths, strict=True):
        setattr(parent, name, ProjectionSlice(weight, bias, start, start + width))
        start += width


def _row_parallel(linear: torch.nn.Linear, tp: TensorParallel) -> RowParallelLinear:
    width = linear.in_features // tp.size
    weight = linear.weight.detach()[:, tp.rank * width:(tp.rank + 1) * width].contiguous()
    return RowParallelLinear(weight, None if linear.bias is None else linear.bias.detach())


def load_shard(layers: dict[str, torch.nn.Module], files: dict[str, Path], tp: TensorParallel) -> set[str]:
    """Each sharded decoder layer's tensors from a checkpoint (``files``: tensor name -> its safetensors file), this
    rank's rows and columns only, read as slices; returns the names read, so the caller reads the others whole."""
    read: set[str] = set()

    def part(name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        read.add(name)
        with safe_open(files[name], framework="pt") as f:
            stored = f.get_slice(name)
            if rows is not None:
                return stored[rows[0]:rows[1]]
            return stored[:, cols[0]:cols[1]] if cols is not None else stored[:]

    with torch.no_grad():
        for prefix, layer in layers.items():
            for parent_name, names in GROUPS:
                parent = getattr(layer, parent_name)
                first = getattr(parent, names[0])
                for kind in ("weight", "bias"):
                    merged = getattr(first, kind)
                    if merged is None:
                        continue
                    pieces = []
                    for name in names:
                        width = getattr(parent, name).out_features
                        pieces.append(part(f"{prefix}.{parent_name}.{name}.{kind}",
                                           rows=(tp.rank * width, (tp.rank + 1) * width)))
                    merged.copy_(torch.cat(pieces))
            for parent_name, name in (("self_attn", "o_proj"), ("mlp", "down_proj")):
                row_parallel = getattr(getattr(layer, parent_name), name)
                width = row_parallel.in_features
                row_parallel.weight.copy_(part(f"{prefix}.{parent_name}.{name}.weight",
                                               cols=(tp.rank * width, (tp.rank + 1) * width)))
                if row_parallel.bias is not None:
                    row_parallel.bias.copy_(part(f"{prefix}.{parent_name}.{name}.bias"))
    return read
