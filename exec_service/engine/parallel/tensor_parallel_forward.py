"""Rank 0's forward of a tensor-parallel model: the step's inputs to the other ranks, then this rank's shard.

Every rank runs the same forward on its shard; the all-reduces inside it (kiln.model.tensor_parallel) meet across
the ranks. A forward that fails part way leaves the ranks out of step, so any failure loses the model: its requests
end with UNAVAILABLE and it must be loaded again.
"""

import torch

from exec_service.engine.engine_loop import ModelLost
from exec_service.engine.model_forward import ModelForward
from exec_service.engine.parallel import step_broadcast
from exec_service.engine.parallel.rank_group import RankGroup
from kiln.attention.forward_context import AttentionMetadata
from kiln.model.tensor_parallel import tensor_parallel_group


class TensorParallelForward(ModelForward):
    def __init__(self, forward: ModelForward, ranks: RankGroup):
        super().__init__(forward.token_model, forward.compiled)
        self.ranks = ranks

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 metadata: AttentionMetadata, kv_scales: list[torch.Tensor] | None = None) -> torch.Tensor:
        self._check()
        try:
            step_broadcast.send_step(self.ranks.group, input_ids, positions, metadata)
            with tensor_parallel_group(self.ranks.group):
                return super().__call__(input_ids, positions, kv_caches, metadata, kv_scales)
        except Exception as exc:
            self.ranks.failed(exc)
            self._check()
            raise

    def _check(self) -> None:
        if self.ranks.lost is not None:
            raise ModelLost(f"model: {self.ranks.name!r} is lost ({self.ranks.lost}); unload it and load it again")

    def close(self) -> None:
        self.ranks.close()
