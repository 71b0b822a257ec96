"""An FP8 checkpoint's decoder linears, checked and loaded as stored: each quantized linear's float8 weight and its
scales, name by name and shape by shape like every other tensor (kiln.model.checkpoint), then turned into Kiln's
form, one float32 scale per weight row (kiln.quantization.fp8_linear), layer by layer.
"""

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kiln.errors import DataLoss, FailedPrecondition, first_line
from kiln.quantization.checkpoint_formats import Fp8Checkpoint
from kiln.quantization.fp8_linear import FP8, Fp8Linear, frozen, quantize_rows
from kiln.quantization.quantize_layers import merge_fp8_groups

SAFETENSORS_FP8 = "F8_E4M3"


def quantized_linears(layers: dict[str, torch.nn.Module], fmt: Fp8Checkpoint) -> dict[str, torch.nn.Linear]:
    """Full name -> Linear for every linear of the decoder layers (``{prefix: layer}``) that the checkpoint stores
    in FP8: all but those its ignore list names."""
    out = {}
    for prefix, layer in layers.items():
        for name, module in layer.named_modules():
            full = f"{prefix}.{name}"
            if type(module) is torch.nn.Linear and not fmt.ignores(full):
                out[full] = module
    return out


def expected_scales(linears: dict[str, torch.nn.Linear], fmt: Fp8Checkpoint) -> dict[str, tuple[int, ...]]:
    """The scale tensors the checkpoint must hold beside the linears' weights, with their shapes."""
    return {f"{name}.{scale}": fmt.scale_shape(scale, linear.out_features, linear.in_features)
            for name, linear in linears.items() for scale in fmt.scale_names()}


class CheckpointReader:
    """The tensors of a directory's safetensors files by name, each read when asked for."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.files: dict[str, Path] = {}
        self.dtypes: dict[str, str] = {}
        for path in sorted(directory.glob("*.safetensors")):
            with self._open(path) as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    self.files[name] = path
                    self.dtypes[name] = f.get_slice(name).get_dtype()

    def _open(self, path: Path):
        try:
            return safe_open(path, framework="pt")
        except (SafetensorError, OSError) as exc:
            raise DataLoss(f"weights: {path.name} is not a readable safetensors file ({first_line(exc)})") from None

    def read(self, name: str) -> torch.Tensor:
        with self._open(self.files[name]) as f:
            return f.get_tensor(name)

    def check_fp8(self, linears: dict[str, torch.nn.Linear]) -> None:
        """FAILED_PRECONDITION unless every quantized linear's weight is stored in float8_e4m3fn."""
        wrong = [f"{name}.weight ({self.dtypes[f'{name}.weight']})" for name in linears
                 if self.dtypes.get(f"{name}.weight") != SAFETENSORS_FP8]
        if wrong:
            raise FailedPrecondition(f"weights: {self.directory.name} stores {len(wrong)} quantized linear weights in "
                                     f"another type than {SAFETENSORS_FP8}: {', '.join(wrong[:3])}")

    def check_scales(self, names: Iterable[str]) -> None:
        """FAILED_PRECONDITION unless every scale named is finite, and positive where it divides (an activation's
        ``input_scale``) or not negative where it multiplies (a weight's: an all-zero row's scale is 0). A NaN or an
        infinity here is no error while loading: the model would report ready and serve NaN logits, every token
        the same id. The scales are small (a value a weight row), so all are read before anything is built."""
        for name in names:
            scale = self.read(name).float()
            divides = name.endswith(".input_scale")
            bad = ~torch.isfinite(scale) | (scale <= 0 if divides else scale < 0)
            if bad.any():
                where = torch.nonzero(bad)[0].tolist() if scale.numel() > 1 else ""  # a tensor's one scale: no index
                raise FailedPrecondition(
                    f"weights: {self.directory.name}: {name}{where} is {scale[bad][0].item()}; "
                    f"a scale must be finite and {'positive' if divides else 'not negative'} (the checkpoint is "
                    "damaged, or was not written by an FP8 quantizer)")


def load_layer(layer: torch.nn.Module, prefix: str, reader: CheckpointReader, fmt: Fp8Checkpoint) -> None:
    """Every tensor of one decoder layer from the checkpoint, its quantized linears as Fp8Linears, groups merged."""
    fp8 = quantized_linears({prefix: layer}, fmt)
    with torch.no_grad():
        for name, tensor in layer.state_dict(keep_vars=True).items():
            full = f"{prefix}.{name}"
            if full.removesuffix(".weight") not in fp8 or not name.endswith(".weight"):
                tensor.copy_(reader.read(full))
    device = next(layer.parameters()).device
    for name in fp8:
        parent_name, _, child = name.removeprefix(prefix + ".").rpartition(".")
        parent = layer.get_submodule(parent_name)
        linear = getattr(parent, child)
        weight, scale = _row_scaled(name, reader, fmt)
        input_scale = frozen(reader.read(f"{name}.input_scale").float().reshape(1).to(device)) \
            if fmt.static_activations else None
        setattr(parent, child, Fp8Linear(frozen(weight.to(device)), frozen(scale.to(device)), linear.bias,
                                         input_scale))
    merge_fp8_groups(layer)


def _row_scaled(name: str, reader: CheckpointReader, fmt: Fp8Checkpoint) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear's float8 weight [N, K] and one float32 scale per row [N], from its stored form."""
    weight = reader.read(f"{name}.weight")
    rows, cols = weight.shape
    if fmt.weight_scales == "block":  # dequantized block by block, then one scale per row
        inverse = reader.read(f"{name}.weight_scale_inv").float()
        scales = inverse.repeat_interleave(fmt.block[0], 0)[:rows].repeat_interleave(fmt.block[1], 1)[:, :cols]
        return quantize_rows(weight.float() * scales)
    scale = reader.read(f"{name}.weight_scale").float().reshape(-1)
    return weight.view(FP8), scale.expand(rows).contiguous()
