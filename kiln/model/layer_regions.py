"""The decoder layers as regions: one compiled code per kind of layer, run for every layer of that kind.

A decoder's layers are one or two kinds repeated (local and global layers alternate in some families). Each layer is
wrapped as a LayerStep whose index is an input, and layers whose modules hold the same settings and weight shapes
are one kind, so the compile service traces and compiles one layer per kind, not every layer. The model's own
forward (transformers' embedding, rotary tables, layer loop, final norm) runs as written; each layer call is routed
to its kind's code: the layer's own forward (eager), or the bundle's compiled code for the kind.
"""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kiln.attention.op import LAYER_NEUTRAL_KWARGS, asked_of
from kiln.errors import FailedPrecondition

LayerCode = Callable[..., torch.Tensor]  # (LayerStep, hidden, cos, sin, layer index) -> hidden

class LayerStep(torch.nn.Module):
    """One decoder layer, its index an input (a 0-d CPU tensor the attention op reads) so that one compiled code
    serves every layer of its kind."""

    def __init__(self, layer: torch.nn.Module, index: int, kind: int):
        super().__init__()
        self.layer = layer
        self.index = torch.tensor(index)
        self.kind = kind

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_index: torch.Tensor):
        # The class's forward: the instance's own is the router below.
        out = type(self.layer).forward(self.layer, hidden, position_embeddings=(cos, sin), kiln_layer=layer_index)
        return out[0] if isinstance(out, tuple) else out


def run_eagerly(step: LayerStep, *inputs: torch.Tensor) -> torch.Tensor:
    return step(*inputs)


def layer_signature(layer: torch.nn.Module) -> str:
    """What makes two layers' code the same: per submodule, its class, its settings (every scalar attribute but the
    layer index, which is an input) and its weights' names, shapes and dtypes."""
    parts = []
    for name, module in layer.named_modules():
        settings = sorted((k, repr(v)) for k, v in vars(module).items()
                          if not k.startswith("_") and k not in ("training", "layer_idx")
                          and isinstance(v, (bool, int, float, str, tuple, type(None))))
        tensors = [(n, tuple(t.shape), str(t.dtype)) for n, t in [*module.named_parameters(recurse=False),
                                                                  *module.named_buffers(recurse=False)]]
        parts.append((name, type(module).__qualname__, settings, tensors))
    return repr(parts)


class DecoderLayers:
    """The layers of a decoder as steps, their kinds, and the code each kind runs for the call in progress."""

    def __init__(self, layers: Sequence[torch.nn.Module]):
        signatures: dict[str, int] = {}
        self.steps = [LayerStep(layer, i, signatures.setdefault(layer_signature(layer), len(signatures)))
                      for i, layer in enumerate(layers)]
        self.kinds = tuple(step.kind for step in self.steps)
        self.num_kinds = len(signatures)
        self.code: Sequence[LayerCode] | None = None  # None: outside a Kiln forward, layers run as transformers wrote
        for step in self.steps:
            step.layer.forward = self._router(step)

    def first_of_each_kind(self) -> list[LayerStep]:
        return [next(s for s in self.steps if s.kind == kind) for kind in range(self.num_kinds)]

    @contextmanager
    def running(self, code: Sequence[LayerCode] | None = None) -> Iterator[None]:
        """Route every layer call to ``code[kind]`` while the block runs (a forward of the model); without code, to
        the code already routed to, else to each layer's own forward."""
        previous = self.code
        self.code = code or previous or [run_eagerly] * self.num_kinds
        try:
            yield
        finally:
            self.code = previous

    def _router(self, step: LayerStep) -> Callable[..., torch.Tensor]:
        def forward(hidden_states: torch.Tensor, attention_mask=None, position_embeddings=None, **kwargs):
            if self.code is None:  # transformers' own use of the module (generate with its cache, a reference run)
                return type(step.layer).forward(step.layer, hidden_states, attention_mask=attention_mask,
                                                position_embeddings=position_embeddings, **kwargs)
            asked = asked_of(kwargs, LAYER_NEUTRAL_KWARGS)  # and Kiln registers no attention mask
            if asked or attention_mask is not None or not isinstance(position_embeddings, tuple):
                raise NotImplementedError(f"a decoder layer called with {asked or ['a mask or no rotary tables']}: "
                                          f"Kiln runs layers that take hidden states and rotary tables only")
            cos, sin = position_embeddings
            return self.code[step.kind](step, hidden_states, cos, sin, step.index)

        return forward


@dataclass(frozen=True)
class CompiledLayers:
    """A bundle's compiled code, one per kind of layer; called as ``fn(token_model, input_ids, positions)``."""

    code: tuple  # per kind: the aot-compiled function of a LayerStep
    kinds: tuple[int, ...]  # the kind of each layer, as the compile service found them

    def __call__(self, model, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if model.layers.kinds != self.kinds:
            raise FailedPrecondition(f"the bundle's layers are of kinds {list(self.kinds)}, this model's "
                                     f"{list(model.layers.kinds)}")
        with model.layers.running(self.code):
            return model(input_ids, positions)

    def skip_guard_checks(self) -> None:
        """Once a call at each end of the token range has passed torch's guards for every layer: the weights and
        the step inputs cannot change kind after that, and checking them again costs ~35 us per layer call."""
        for function in self.code:
            function.disable_guard_check()
