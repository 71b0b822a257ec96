"""One forward of the model over a step's flattened tokens: the bundle's compiled layers, or the eager model.

What the runner, the warm-ups and the graph captures all call; the KV cache and the step's metadata reach Kiln's
attention op through the forward context (kiln.attention.forward_context).
"""

import torch

from kiln.attention.forward_context import AttentionMetadata, ForwardContext, forward_context
from kiln.model.causal_lm import TokenModel
from kiln.step_record import StepPath


class ModelForward:
    def __init__(self, token_model: TokenModel, compiled=None):
        self.token_model = token_model
        self.compiled = compiled  # kiln.model.layer_regions.CompiledLayers, or None: the eager model serves

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The KV blocks the cache gets when this rank's memory holds ``num_blocks``: on one rank, those."""
        return num_blocks

    def begin_step(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                   path: StepPath, padded_size: int) -> None:
        """A step is about to run by ``path``: nothing to do on one rank (TensorParallelForward: tell the others)."""

    def step_synced(self) -> None:
        """A step's results reached the host: nothing to check on one rank (TensorParallelForward: that no rank was
        lost while it ran)."""

    def compiled_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The compiled layers in whatever forward context is set (what CUDA graphs capture)."""
        return self.compiled(self.token_model, input_ids, positions)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 metadata: AttentionMetadata, kv_scales: list[torch.Tensor] | None = None) -> torch.Tensor:
        with forward_context(ForwardContext(kv_caches, metadata, kv_scales)):
            if self.compiled is None:
                return self.token_model(input_ids, positions)
            return self.compiled_forward(input_ids, positions)

    def close(self) -> None:
        """Let go of what the forward holds besides tensors: nothing on one rank (TensorParallelForward: the
        others)."""
