"""The artifact key: sha256 over the canonical JSON of every input of code generation, and of nothing else.

Factor groups: the model config fields the forward reads and the dtype (``model_factors``), the compile config, the
compiler's effective settings with the request's Inductor patches (``compiler_settings``), the versions and hardware
of this process, and Kiln's own code that the trace and the compile run (``code_hash``). Paths, hosts, ports, cache
directories and weights are not factors. The factors are stored beside each bundle, so a miss or a refused load can
be explained factor by factor.
"""

import hashlib
import json
import platform

import torch
import transformers

from kiln.compilation.code_hash import kiln_code_hash
from kiln.compilation.compiler_settings import compiler_settings
from kiln.compilation.config import CompileConfig
from kiln.model.factors import model_config_factors
from kiln.model.spec import ResolvedModel


def environment_factors(device: str) -> dict:
    """Versions and hardware of this process: what the compiled code was built for."""
    factors = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "transformers": transformers.__version__,
        "device_type": device,
    }
    try:
        import triton

        factors["triton"] = triton.__version__
    except ImportError:
        factors["triton"] = None
    if device == "cuda":
        factors["cuda"] = torch.version.cuda
        factors["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        factors["gpu_name"] = torch.cuda.get_device_name()
    else:
        from kiln.compilation.compiler_caches import partition_factors

        isa = partition_factors(device)
        factors["cpu_isa"] = isa["cpu_capability"]
        factors["inductor_vec_isa"] = isa["inductor_vec_isa"]
        factors["cpu_threads"] = torch.get_num_threads()
        factors["machine"] = isa["machine"]
    return factors


def compile_config_factors(config: CompileConfig) -> dict:
    """The compile config less its Inductor patches, which count through the settings they produce."""
    return {k: v for k, v in config.factors().items() if k != "inductor_config_patches"}


def key_factors(model: ResolvedModel, config: CompileConfig) -> dict:
    return {
        "model_config": model_config_factors(model),
        "dtype": model.dtype_name,
        "compile_config": compile_config_factors(config),
        "compiler": compiler_settings(config.inductor_config_patches),
        "environment": environment_factors(config.device),
        "kiln_code": kiln_code_hash(),
    }


def digest(factors: dict) -> str:
    canonical = json.dumps(factors, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def differences(stored: object, expected: object) -> list[tuple[str, object, object]]:
    """(dotted factor name, stored value, expected value) for every leaf that differs, in sorted order."""
    return _differences(_plain(stored), _plain(expected), "")


def _differences(stored: object, expected: object, path: str) -> list[tuple[str, object, object]]:
    if isinstance(stored, dict) and isinstance(expected, dict):
        out = []
        for name in sorted(set(stored) | set(expected)):
            out += _differences(stored.get(name), expected.get(name), f"{path}.{name}" if path else name)
        return out
    return [] if stored == expected else [(path, stored, expected)]


def _plain(value: object) -> object:
    """The value as it reads back from key_factors.json (tuples become lists, objects their str)."""
    return json.loads(json.dumps(value, default=str))
