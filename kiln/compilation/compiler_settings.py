"""The compiler's settings as a key factor, fingerprinted the way torch fingerprints them for its own caches.

Inductor keys its FX graph cache on ``save_config_portable()`` and AOTAutograd on functorch's; Dynamo hashes every
option not marked compile-ignored. Those are the effective values of this process: defaults, ``TORCHINDUCTOR_*``
(and other) environment overrides read at import, and the request's patches laid over them. A patch equal to the
default leaves the settings, and so the key, as they were; an environment variable that changes an option changes it.
The patches are laid over a copy rather than applied with ``config.patch``, which would leak into a compile running
in another thread on torch versions whose config is process-global.
"""

import torch

# Inductor options that name where logs, caches and outputs go: a path is never an input of the generated code.
_PATH_SUFFIXES = ("_dir", "_path", "logpath")


def compiler_settings(inductor_patches: dict) -> dict:
    """Inductor (with ``inductor_patches``), functorch and Dynamo settings, and torch's global numeric modes."""
    from torch._dynamo import config as dynamo_config
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    inductor = inductor_config.save_config_portable()
    for name, value in inductor_patches.items():
        if name in inductor:  # options torch leaves out of its own key (trace.*, compile_threads, ...) stay out
            inductor[name] = value
    ignored = getattr(dynamo_config, "_compile_ignored_keys", set())
    dynamo = {k: v for k, v in dynamo_config.save_config_portable().items() if k not in ignored}
    return {
        "inductor": _canonical({k: v for k, v in inductor.items() if not k.endswith(_PATH_SUFFIXES)}),
        "functorch": _canonical(functorch_config.save_config_portable()),
        "dynamo": _canonical(dynamo),
        "torch": _canonical(_global_modes()),
    }


def _global_modes() -> dict:
    """Process-wide settings that Inductor's own cache key also holds: they change lowering, not any config."""
    matmul = torch.backends.cuda.matmul
    return {
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": [torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()],
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul": [getattr(matmul, "fp32_precision", None), matmul.allow_fp16_reduced_precision_reduction,
                        matmul.allow_bf16_reduced_precision_reduction],
    }


def _canonical(value):
    """JSON-ready and independent of set order; tuples and lists alike, as a patch sent as JSON has lists."""
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_canonical(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)
