"""How many streaming multiprocessors a device has: what Kiln's kernels size their grids by (a decode's splits, a
GEMM's split of K, the quantize's programs)."""

import functools

import torch


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA ``device``; 1 elsewhere (TRITON_INTERPRET=1 runs the kernels on CPU tensors: the tests
    without a GPU)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
