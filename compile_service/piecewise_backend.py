"""A torch.compile backend that splits a region's Dynamo graph at the splitting ops and compiles each other piece.

As in vLLM's "[7/N] torch.compile, reduce compilation time", the attention op runs between compiled pieces; Kiln
compiles one decoder layer per kind (``kiln.model.layer_regions``), run for every layer of that kind, so a layer is one
pair of pieces. Each piece is compiled by ``standalone_compile`` for the symbolic token count and for
each compile size; the result is a PiecewiseFunction that ``aot_compile`` saves.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import sympy
import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.passes.split_module import split_module

from kiln.attention.rotary import route_rotary
from kiln.compilation.piecewise import CompiledPiece, PiecewiseFunction
from kiln.model.merged_projections import merge_identical_linears
from kiln.quantization.activation_quant import route_activation_quantize
from kiln.quantization.norm_quantize import route_norm_quantize
from kiln.quantization.residual_add import fuse_residual_add
from tracing import spans

ProgressFn = Callable[[str, int, int, str, str], None]  # (phase, piece, num_pieces, size, region)


@dataclass
class SplitStats:
    num_pieces: int = 0
    num_splits: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    graph_received_ns: int = 0  # wall clock when Dynamo handed over the graph: the end of its tracing


def _split_op_targets(splitting_ops: tuple[str, ...]) -> set:
    targets = set()
    for name in splitting_ops:
        namespace, op = name.split("::")
        packet = getattr(getattr(torch.ops, namespace), op)
        targets |= {packet, packet.default}
    return targets


def _cache_hits() -> int:
    """AOTAutograd cache hits so far; standalone_compile of a piece Inductor has seen before is one more."""
    return counters["aot_autograd"]["autograd_cache_hit"]


def _token_symbols(example_inputs) -> set[sympy.Symbol]:
    """The symbols of the dimensions marked dynamic: each region input that has the token dimension brings its own,
    and all of them are the token count (Dynamo may or may not have found them equal)."""
    symbols = {size.node.expr for value in example_inputs if isinstance(value, torch.Tensor)
               for size in value.shape if isinstance(size, torch.SymInt)}
    if not symbols:
        raise RuntimeError("the traced graph has no symbolic token dimension")
    return symbols


def _token_arg(args, symbols: set[sympy.Symbol]) -> tuple[int, int | None]:
    """Which argument (and dim) carries the token count of a piece."""
    for pos, value in enumerate(args):
        if isinstance(value, torch.SymInt) and value.node.expr in symbols:
            return pos, None
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and size.node.expr in symbols:
                    return pos, dim
    return 0, 0  # a piece without the token dimension: compile sizes cannot differ, any arg will do


def _inputs_for_size(gm: torch.fx.GraphModule, example_inputs, size: int) -> list:
    """Real graph inputs for ``size`` tokens: each input with the token dimension made anew at that size (zeros for
    integers, small random values for floats: static-size compiles need real tensors, not particular values), the
    token count itself for a SymInt, the traced value for everything else (the weights)."""
    out = []
    for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs, strict=True):
        example = node.meta.get("example_value")
        if isinstance(value, torch.SymInt) or isinstance(example, torch.SymInt):
            out.append(size)
        elif isinstance(example, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in example.shape):
            shape = [_at_size(d, size) for d in example.shape]
            if example.dtype.is_floating_point:
                out.append(torch.randn(shape, dtype=example.dtype, device=example.device) * 0.02)
            else:
                out.append(torch.zeros(shape, dtype=example.dtype, device=example.device))
        else:
            out.append(value)
    return out


def _at_size(dim: int | torch.SymInt, size: int) -> int:
    """A dimension with every symbol in it (all of them the token count) set to ``size``."""
    if not isinstance(dim, torch.SymInt):
        return dim
    expr = dim.node.expr
    return int(expr.subs({symbol: size for symbol in expr.free_symbols}))


class SymbolicRangeTag(CustomGraphPass):
    """A no-op post-grad pass whose uuid puts the token range into Inductor's cache key.

    Without it, a piece cached under a narrower range (say [2, 64]) is a hit for a wider one and its guard
    contradicts the requested range: the compile fails with a ConstraintViolationError.
    """

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return f"kiln-token-range-1-{self.max_tokens}"


class PiecewiseBackend:
    """Callable as a torch.compile backend for one region; records what it split and compiled in ``stats``.

    ``first_piece`` numbers this region's pieces after those of the regions compiled before it, in progress events
    and spans.
    """

    def __init__(self, region: str, splitting_ops: tuple[str, ...], compile_sizes: tuple[int, ...], max_tokens: int,
                 config_patches: dict, progress: ProgressFn, first_piece: int = 0):
        self.region = region
        self.split_targets = _split_op_targets(splitting_ops)
        self.compile_sizes = compile_sizes
        self.options = {"config_patches": {**config_patches,
                                           "post_grad_custom_post_pass": SymbolicRangeTag(max_tokens)}}
        self.progress = progress
        self.first_piece = first_piece
        self.stats = SplitStats()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> PiecewiseFunction:
        self.stats.graph_received_ns = time.time_ns()
        start = time.perf_counter()
        with spans.phase_span(spans.SPLIT, region=self.region) as span:
            merged, routed = merge_identical_linears(gm), route_activation_quantize(gm) + route_norm_quantize(gm)
            residual_adds, rotaries = fuse_residual_add(gm), route_rotary(gm)
            split_gm, split_parts = self._split(gm)
            names = [n.target for n in split_gm.graph.nodes if n.op == "call_module" and n.target not in split_parts]
            span.set_attributes({spans.NUM_PIECES: len(names), spans.NUM_SPLITS: len(split_parts),
                                 spans.MERGED_LINEARS: merged, spans.ROUTED_QUANTIZES: routed,
                                 spans.FUSED_RESIDUAL_ADDS: residual_adds, spans.ROUTED_ROTARIES: rotaries})
        self.stats.timings["split"] = time.perf_counter() - start
        self.progress("split", 0, 0, "", self.region)
        pieces: dict[str, CompiledPiece] = {}
        start = time.perf_counter()
        tracing = torch._guards.TracingContext.get()
        symbols = _token_symbols([tracing.fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                  for a in example_inputs])
        self._run_compiling(split_gm, names, pieces, example_inputs, symbols, size=None)
        for size in self.compile_sizes:
            self._run_compiling(split_gm, names, pieces, _inputs_for_size(gm, example_inputs, size), symbols, size)
        self.stats.timings["inductor"] = time.perf_counter() - start
        for name, piece in pieces.items():
            split_gm.register_module(name, piece)
        self.stats.num_pieces = len(pieces)
        self.stats.num_splits = len(split_parts)
        return PiecewiseFunction(split_gm, pieces)

    def _split(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, set[str]]:
        part, assignment, split_parts = 0, {}, set()
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in self.split_targets:
                part += 1
                assignment[node] = part
                split_parts.add(f"submod_{part}")
                part += 1
            else:
                assignment[node] = part
        split_gm = split_module(gm, None, lambda n: assignment[n], keep_original_order=True)
        return split_gm, split_parts

    def _run_compiling(self, split_gm, names, pieces, inputs, symbols, size: int | None) -> None:
        """Interpret the split graph, compiling each piece on the way with the inputs it really receives."""
        backend = self
        label = "symbolic" if size is None else str(size)

        class Compiling(torch.fx.Interpreter):
            def call_module(self, target, args, kwargs):
                out = super().call_module(target, args, kwargs)
                if target in names:
                    submodule = getattr(self.module, target)
                    piece_number = backend.first_piece + names.index(target) + 1
                    backend.progress("inductor", piece_number, backend.first_piece + len(names), label, backend.region)
                    with spans.phase_span(spans.INDUCTOR, piece=piece_number, compile_size=label,
                                          region=backend.region) as span:
                        hits = _cache_hits()
                        if size is None:
                            output_node = next(iter(reversed(submodule.graph.nodes)))
                            piece = CompiledPiece(int(target.split("_")[-1]), isinstance(
                                output_node.args[0], (tuple, list)), _token_arg(args, symbols))
                            piece.symbolic = torch._inductor.standalone_compile(
                                submodule, list(args), dynamic_shapes="from_tracing_context", options=backend.options,
                                aot=True)
                            pieces[target] = piece
                        else:
                            pieces[target].by_size[size] = torch._inductor.standalone_compile(
                                submodule, list(args), dynamic_shapes="from_example_inputs", options=backend.options,
                                aot=True)
                        span.set_attribute(spans.CACHE_HIT, _cache_hits() > hits)
                return out

        if size is None:
            fake_mode = torch._guards.TracingContext.get().fake_mode
            fake_inputs = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in inputs]
            # The python dispatcher keeps fake aten.size symbolic (else HF's rotary specializes the token count).
            with fake_mode, enable_python_dispatcher():
                Compiling(split_gm).run(*fake_inputs)
        else:
            with torch.no_grad():
                Compiling(split_gm).run(*inputs)
