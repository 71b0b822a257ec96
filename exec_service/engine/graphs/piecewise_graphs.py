"""Piecewise CUDA graphs for prefill and mixed steps: each compiled piece of each layer captured at each token-count
size, Kiln's attention op run eagerly between them on the step's real metadata (vLLM's FULL_AND_PIECEWISE).

A step of T tokens, T at most the largest size, runs the model at the next size S >= T: its tokens padded with rows
in no sequence and slot -1, so they write no KV and read none. transformers' code around the layers (embedding,
rotary tables, final norm) and the attention op run eagerly; every call of a compiled piece replays a graph. The
n-th piece call of a forward at size S is graph (S, n): a forward at one size calls the same pieces in the same
order every time (``replay`` checks the count).

A graph reads its inputs where they were at capture. Weights never move; an input an earlier graph of the same
forward wrote is where that graph writes it again (all graphs share one pool, reused as at capture because replays
run in capture order); an input made eagerly (the embedding, the rotary tables, attention's output) is copied into
the staging buffer the graph was captured reading, once per forward for an input several graphs read (the rotary
tables). A graph's outputs are handed back as views that do not own its pool memory (vLLM's weak references): the
next graph to write that memory runs only after the forward has consumed them, as it did at capture. CUDA only.
"""

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from exec_service.engine.step_inputs import StepBuffers
from kiln.attention.forward_context import ForwardContext, forward_context
from kiln.compilation.piecewise import CompiledPiece, piece_calls

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids [T], positions [T]) -> hidden [T, H]


@dataclass
class PieceGraph:
    graph: torch.cuda.CUDAGraph
    staged: list[tuple[int, torch.Tensor]]  # (argument position, staging buffer the graph reads it from)
    output: object  # the piece's outputs, as views of the pool that own nothing


def _unowned(value):
    """``value``'s tensors as views of the same memory that do not keep it allocated."""
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), value.device, storage.nbytes())
        return torch.empty(0, dtype=value.dtype, device=value.device).set_(
            alias, value.storage_offset(), value.shape, value.stride())
    if isinstance(value, (list, tuple)):
        return type(value)(_unowned(v) for v in value)
    return value


def _storages(value) -> Iterator[int]:
    if isinstance(value, torch.Tensor):
        yield value.untyped_storage().data_ptr()
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _storages(v)


class _Replay:
    """One forward's piece calls at one size: each replays its graph."""

    def __init__(self, graphs: list[PieceGraph]):
        self.graphs = graphs
        self.calls = 0
        self.staged_from: dict[int, torch.Tensor] = {}  # id(staging buffer) -> the tensor last copied into it

    def __call__(self, piece: CompiledPiece, args: tuple):
        if self.calls == len(self.graphs):
            raise RuntimeError(f"a forward called more compiled pieces than the {len(self.graphs)} captured")
        entry = self.graphs[self.calls]
        self.calls += 1
        for position, staging in entry.staged:
            source = args[position]
            if self.staged_from.get(id(staging)) is not source:
                staging.copy_(source)
                self.staged_from[id(staging)] = source
        entry.graph.replay()
        return entry.output


class _Capture:
    """One forward's piece calls at one size: each is run once, then captured, then replayed."""

    def __init__(self, owner: "PiecewiseGraphs", size: int):
        self.owner = owner
        self.size = size
        self.graphs: list[PieceGraph] = []
        self.outputs: set[int] = set()  # storages the graphs of this forward wrote

    def __call__(self, piece: CompiledPiece, args: tuple):
        owner = self.owner
        args = list(args)
        staged = []
        seen: Counter = Counter()
        for position, value in enumerate(args):
            if not isinstance(value, torch.Tensor) or not value.is_cuda:
                continue
            storage = value.untyped_storage().data_ptr()
            if storage in owner.persistent or storage in self.outputs:
                continue
            layout = (tuple(value.shape), value.stride(), value.dtype)
            key = (self.size, layout, seen[layout])
            seen[layout] += 1
            staging = owner.staging.get(key)
            if staging is None:
                staging = owner.staging[key] = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                                                   device=value.device)
            staging.copy_(value)
            args[position] = staging
            staged.append((position, staging))
        piece.run(*args)  # the code's first launch at this size (kernel loads) outside the capture
        graph = torch.cuda.CUDAGraph()
        owner.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(owner.stream):
            graph.capture_begin(owner.pool, capture_error_mode="thread_local")
            try:
                out = piece.run(*args)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(owner.stream)
        graph.replay()  # the forward goes on with real values
        self.outputs.update(_storages(out))
        self.graphs.append(PieceGraph(graph, staged, _unowned(out)))
        return out


class PiecewiseGraphs:
    """The piece graphs of one model, per token-count size; captured largest first into ``pool``."""

    def __init__(self, forward: Forward, sizes: tuple[int, ...], buffers: StepBuffers, persistent: list[torch.Tensor],
                 pool):
        self.forward = forward
        self.sizes = tuple(sorted(sizes))
        self.buffers = buffers
        self.pool = pool
        self.graphs: dict[int, list[PieceGraph]] = {}
        self.captured_bytes = 0
        self.seconds = 0.0
        self.persistent = {t.untyped_storage().data_ptr() for t in persistent}  # storages that never move
        self.staging: dict[tuple, torch.Tensor] = {}  # (size, layout, nth of that layout in a call) -> buffer
        self.stream = torch.cuda.Stream()

    def padded_size(self, num_tokens: int) -> int | None:
        """The size a step of ``num_tokens`` replays, or None when it is over the largest."""
        if num_tokens > self.sizes[-1]:
            return None
        return next(size for size in self.sizes if size >= num_tokens)

    def capture(self, kv_caches: list[torch.Tensor], on_captured: Callable[[int, int], None] = lambda *_: None,
                kv_scales: list[torch.Tensor] | None = None) -> float:
        """Capture every size, largest first; ``kv_caches`` serve the eager attention meanwhile (any cache of the
        model's layout: the graphs never read it). Returns the seconds it took; ``captured_bytes`` is the device
        memory the graphs and their staging buffers hold."""
        start = time.perf_counter()
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info()
        for size in reversed(self.sizes):
            capture = _Capture(self, size)
            with forward_context(ForwardContext(kv_caches, self.buffers.piecewise_capture_metadata(size), kv_scales)), \
                    piece_calls(capture):
                self.forward(self.buffers.input_ids[:size], self.buffers.positions[:size])
            self.graphs[size] = capture.graphs
            torch.cuda.synchronize()
            on_captured(size, len(self.graphs))
        free_after, _ = torch.cuda.mem_get_info()
        self.captured_bytes = max(0, free_before - free_after)
        self.seconds = time.perf_counter() - start
        return self.seconds

    @property
    def num_graphs(self) -> int:
        return sum(len(graphs) for graphs in self.graphs.values())

    @contextmanager
    def replay(self, size: int) -> Iterator[None]:
        """Every piece call in the block (one forward at ``size`` tokens) replays its graph."""
        graphs = self.graphs[size]
        replay = _Replay(graphs)
        with piece_calls(replay):
            yield
        if replay.calls != len(graphs):
            raise RuntimeError(f"a forward at {size} tokens called {replay.calls} compiled pieces, "
                               f"{len(graphs)} were captured")
