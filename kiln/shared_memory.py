"""The shared memory a Triton program may use on a CUDA device: what Kiln's kernels check their pipelines against
before they pick a tile (a Hopper has 227 KB, an Ada 99 KB)."""

import functools

import torch
import triton


@functools.cache
def max_shared_bytes(device: torch.device) -> int:
    """The shared memory a program may use on ``device``, as Triton checks a build against it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
