"""Kiln's custom ops (the attention, the FP8 product, the tensor-parallel all-reduce), registered with the
dispatcher directly instead of through ``torch.library.custom_op``.

``custom_op`` runs each call through Python of its own: an autograd function and a check that no output aliases an
input. On the CPU host under ``no_grad`` ``kiln::fp8_mm`` on tiny tensors took 64 µs a call, 43 registered here, 33
called directly, and ``kiln::attention`` 40–45 µs over its body against 11–17 here (bench/op_dispatch_cost.py,
BENCHMARKS.md); a step launched from Python (a prefill or mixed step past the CUDA graphs' sizes, the eager runtime
mode) makes five such calls a layer. Kiln's ops never need autograd (every forward runs under ``no_grad``) and return
new tensors, so the schema, a kernel for every backend and a fake for tracing are all they register.
"""

from collections.abc import Callable

import torch


def dispatcher_op(qualname: str, schema: str, fake: Callable) -> Callable[[Callable], torch._ops.OpOverload]:
    """Register the decorated function as ``qualname`` (``"kiln::name"``) with ``schema`` (its arguments and
    return, as ``"(Tensor x, int n=0) -> Tensor"``) and ``fake`` for tracing; returns the op, which callers call so
    that Dynamo sees the op rather than its body."""

    def register(fn: Callable) -> torch._ops.OpOverload:
        torch.library.define(qualname, schema, tags=(torch.Tag.pt2_compliant_tag,))
        torch.library.impl(qualname, "CompositeExplicitAutograd")(fn)
        torch.library.register_fake(qualname)(fake)
        namespace, name = qualname.split("::")
        return getattr(getattr(torch.ops, namespace), name).default

    return register
