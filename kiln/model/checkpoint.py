"""A safetensors checkpoint checked against its model, name by name and shape by shape, before any of it loads.

transformers loads a checkpoint whose names or shapes do not match with a warning, leaving the random initial
values where tensors were missing: the model reports ready and serves garbage. Here a missing, unexpected or
mis-shaped tensor is FAILED_PRECONDITION listing the first few of each, and a file that is not valid safetensors is
DATA_LOSS naming it. Only the files' headers are read.
"""

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kiln.errors import DataLoss, FailedPrecondition, NotFound, first_line

SHOWN = 3  # names listed per kind of difference


def tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of the directory's ``*.safetensors`` files (shards included) with its shape."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise NotFound(f"weights: {directory} has no *.safetensors files")
    shapes = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError) as exc:
            raise DataLoss(f"weights: {path.name} is not a readable safetensors file ({first_line(exc)})") from None
    return shapes


def check(directory: Path, model: torch.nn.Module, extra: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """FAILED_PRECONDITION unless the checkpoint holds exactly the model's tensors, in the model's shapes, and the
    ``extra`` ones in theirs (an FP8 checkpoint's scales, kiln.quantization.fp8_checkpoint)."""
    shapes = tensor_shapes(directory)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()} | dict(extra or {})
    tied = _tied_names(model)
    missing = [n for n in expected if n not in shapes and not tied.get(n, set()) & shapes.keys()]
    unexpected = [n for n in shapes if n not in expected]
    misshaped = [f"{n} {list(shapes[n])} where the model has {list(expected[n])}" for n in expected
                 if n in shapes and shapes[n] != expected[n]]
    problems = [f"{len(names)} {kind}: {', '.join(names[:SHOWN])}{', ...' if len(names) > SHOWN else ''}"
                for kind, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
                if names]
    if problems:
        raise FailedPrecondition(f"weights: {directory.name} does not match the model config ({'; '.join(problems)})")


def _tied_names(model: torch.nn.Module) -> dict[str, set[str]]:
    """Name -> the other names of the same parameter (tied embeddings): a checkpoint stores one of them."""
    by_param: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), set()).add(name)
    return {name: names - {name} for names in by_param.values() for name in names}
