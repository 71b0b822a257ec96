"""Replaying one CUDA graph with its inputs refilled between replays: how the GPU tests catch a kernel that reads what
the kernel before it writes before that one has ended (programmatic dependent launch, kiln.programmatic_launch)."""

import torch


def replays(fn, inputs: tuple[torch.Tensor, ...], steps: int) -> torch.Tensor:
    """``fn()``'s output after each of ``steps`` replays of one CUDA graph of it, stacked; before replay i each input
    is refilled from a normal draw seeded with i, so that two captures of ``fn`` see the same inputs."""
    fn()  # build the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    results = []
    for step in range(steps):
        generator = torch.Generator("cuda").manual_seed(step)
        for tensor in inputs:
            tensor.copy_(torch.randn(tensor.shape, generator=generator, device="cuda", dtype=tensor.dtype))
        graph.replay()
        results.append(out.clone())
    return torch.stack(results)
