"""Tensor parallelism inside the engine: the ranks' process group, rank 0's step inputs broadcast to the others,
and the forward every rank runs on its shard."""
