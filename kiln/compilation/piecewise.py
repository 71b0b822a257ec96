"""The runtime half of the piecewise split: the split graph with Inductor-compiled pieces, as one serializable callable.

It is pickled into the bundle by the compile service and unpickled by ``torch.compiler.load_compiled_function`` in
the execute service, so it lives here, importable by both. Each piece holds the artifact compiled for the symbolic
token count and, optionally, artifacts for static token counts (``compile_sizes``), chosen per call.
"""

import hashlib
import pickle

import torch
from torch._dynamo.aot_compile_types import SerializableCallable
from torch._inductor.standalone_compile import AOTCompiledArtifact
from torch.fx.graph_module import _format_import_block
from torch.package import sys_importer


class CompiledPiece(torch.nn.Module):
    """One compiled submodule of the split graph, standing in for the FX submodule it replaced."""

    def __init__(self, index: int, tuple_output: bool, token_arg: tuple[int, int | None]):
        super().__init__()
        self.index = index
        self.tuple_output = tuple_output
        self.token_arg = token_arg  # (argument position, dim) giving the token count; dim None: a SymInt arg
        self.symbolic: AOTCompiledArtifact | None = None
        self.by_size: dict[int, AOTCompiledArtifact] = {}

    def num_tokens(self, args) -> int:
        pos, dim = self.token_arg
        return int(args[pos]) if dim is None else args[pos].shape[dim]

    def forward(self, *args):
        """The compiled code for this call's token count (the symbolic one unless a compile size matches)."""
        artifact = self.by_size.get(self.num_tokens(args), self.symbolic) if self.by_size else self.symbolic
        out = artifact(*args)
        # AOT artifacts return a bare tensor for a single output where the FX submodule returned it bare too.
        if self.tuple_output or not isinstance(out, (list, tuple)):
            return out
        return out[0]

    def __getstate__(self):
        state = self.__dict__.copy()
        state["symbolic"] = None
        state["by_size"] = {}
        return state


class SplitForward(torch.nn.Module):
    """The split graph as its generated Python source and its submodules: what runs, pickled without FX.

    A pickled GraphModule is rebuilt by symbolically tracing its code, and tracing patches ``nn.Module.__call__``
    for the whole process while it runs: a forward of another model in another thread then fails ("module is not
    installed as a submodule"). This module runs the same generated source as its forward, so loading a bundle
    traces nothing. The source comes from the signed bundle, as the pickle around it does.
    """

    def __init__(self, source: str, children: dict[str, torch.nn.Module]):
        super().__init__()
        self.source = source
        for name, child in children.items():
            self.add_module(name, child)
        self._bind()

    @classmethod
    def of(cls, graph_module: torch.fx.GraphModule) -> "SplitForward":
        """The graph module's code with the imports it needs (as FX pickles it), its GraphModule children alike."""
        imports = _format_import_block(graph_module.recompile().globals, sys_importer)
        children = {name: cls.of(child) if isinstance(child, torch.fx.GraphModule) else child
                    for name, child in graph_module.named_children()}
        attributes = [n.target for n in graph_module.graph.nodes
                      if n.op == "get_attr" and n.target.split(".")[0] not in children]
        if attributes:
            raise RuntimeError(f"the split graph reads attributes that are not submodules: {attributes}")
        return cls(f"{imports}\n{graph_module.code}", children)

    def _bind(self) -> None:
        namespace: dict = {}
        exec(compile(self.source, "<kiln split graph>", "exec"), namespace)  # noqa: S102 (signed bundle source)
        self._generated_forward = namespace["forward"]

    def forward(self, *args):
        return self._generated_forward(self, *args)

    def __getstate__(self):
        state = self.__dict__.copy()
        del state["_generated_forward"]
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._bind()


class PiecewiseFunction(SerializableCallable):
    """The split graph module whose compiled submodules are CompiledPieces; splitting ops run eagerly between them."""

    def __init__(self, split_module: torch.fx.GraphModule | SplitForward, pieces: dict[str, CompiledPiece]):
        self.split_module = split_module
        self.pieces = pieces

    def __call__(self, *args):
        return self.split_module(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "PiecewiseFunction") -> bytes:
        """Identical pieces (the middle layers) compile to identical artifacts: store and load each blob once."""
        blobs: dict[str, bytes] = {}

        def ref(artifact: AOTCompiledArtifact) -> str:
            blob = artifact.serialize()
            digest = hashlib.sha256(blob).hexdigest()
            blobs.setdefault(digest, blob)
            return digest

        pieces = {name: {"symbolic": ref(p.symbolic), "by_size": {n: ref(a) for n, a in p.by_size.items()}}
                  for name, p in fn.pieces.items()}
        return pickle.dumps({"split_module": SplitForward.of(fn.split_module), "pieces": pieces, "blobs": blobs})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "PiecewiseFunction":
        state = pickle.loads(data)
        artifacts = {digest: AOTCompiledArtifact.deserialize(blob) for digest, blob in state["blobs"].items()}
        split_module = state["split_module"]
        pieces = {}
        for name, refs in state["pieces"].items():
            piece = getattr(split_module, name)
            piece.symbolic = artifacts[refs["symbolic"]]
            piece.by_size = {n: artifacts[digest] for n, digest in refs["by_size"].items()}
            pieces[name] = piece
        return cls(split_module, pieces)
