"""Rank 0's forward of a tensor-parallel model: each step's inputs to the other ranks, then this rank's shard.

Every rank runs the same forward on its shard, by the same path (a decode graph, a mixed graph, the compiled
layers or the eager model) at the same size; the all-reduces inside it (kiln.model.tensor_parallel) meet across the
ranks. A forward that fails part way leaves the ranks out of step, so any failure loses the model: its requests end
with UNAVAILABLE and it must be loaded again.
"""

from typing import NoReturn

import torch

from exec_service.engine.engine_loop import ModelLost
from exec_service.engine.model_forward import ModelForward
from exec_service.engine.parallel import step_broadcast
from exec_service.engine.parallel.rank_group import RankGroup
from kiln.attention.forward_context import AttentionMetadata
from kiln.model.tensor_parallel import tensor_parallel_group
from kiln.step_record import StepPath


class TensorParallelForward(ModelForward):
    def __init__(self, forward: ModelForward, ranks: RankGroup):
        super().__init__(forward.token_model, forward.compiled)
        self.ranks = ranks

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The fewest blocks any rank's memory holds (each rank sized its own budget)."""
        try:
            return step_broadcast.agree_num_blocks(self.ranks.control, num_blocks)
        except Exception as exc:
            self._failed(exc)

    def begin_step(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                   path: StepPath, padded_size: int) -> None:
        self._check()
        try:
            step_broadcast.send_step(self.ranks.control, self.ranks.collective, input_ids, positions, metadata, path,
                                     padded_size)
        except Exception as exc:
            self._failed(exc)

    def step_synced(self) -> None:
        """ModelLost when a rank was lost while the step ran: on CUDA its all-reduces may have been cut short by the
        abort (RankGroup), so its tokens are not the model's and none is delivered."""
        self._check()

    def compiled_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Inside the ranks' group: what the steps and every CUDA-graph capture (its warm-up included) run."""
        try:
            with tensor_parallel_group(self.ranks.collective):
                return super().compiled_forward(input_ids, positions)
        except Exception as exc:
            self._failed(exc)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 metadata: AttentionMetadata, kv_scales: list[torch.Tensor] | None = None) -> torch.Tensor:
        try:
            with tensor_parallel_group(self.ranks.collective):
                return super().__call__(input_ids, positions, kv_caches, metadata, kv_scales)
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> NoReturn:
        if isinstance(exc, ModelLost):  # lost already, by a forward inside this one
            raise exc
        self.ranks.failed(exc)
        if isinstance(exc, torch.OutOfMemoryError):  # the limit the caller names (a capture's field); lost all the same
            raise exc
        self._check()
        raise exc

    def _check(self) -> None:
        if self.ranks.lost is not None:
            raise ModelLost(f"model: {self.ranks.name!r} is lost ({self.ranks.lost}); unload it and load it again")

    def close(self) -> None:
        self.ranks.close()
