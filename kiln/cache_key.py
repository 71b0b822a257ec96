"""The artifact key: sha256 over the canonical JSON of everything that changes the generated code.

Paths, hosts, ports and weights are deliberately absent. The factors are stored beside each bundle, so a miss
or a refused load can be explained factor by factor.
"""

import hashlib
import json
import platform
from pathlib import Path

import torch
import transformers

from kiln.compile_config import CompileConfig
from kiln.model_spec import ResolvedModel

# Kiln's own code that Dynamo traces or the loader needs: a change to it changes the graph.
_TRACED_SOURCES = ("attention.py", "model.py", "piecewise.py")


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
        factors["cpu_isa"] = torch.backends.cpu.get_cpu_capability()
        factors["cpu_threads"] = torch.get_num_threads()
        factors["machine"] = platform.machine()
    return factors


def kiln_code_hash() -> str:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in _TRACED_SOURCES:
        digest.update(name.encode())
        digest.update((here / name).read_bytes())
    return digest.hexdigest()


def key_factors(model: ResolvedModel, config: CompileConfig) -> dict:
    return {
        "model_config": model.normalized_config(),
        "dtype": model.dtype_name,
        "compile_config": config.factors(),
        "environment": environment_factors(config.device),
        "kiln_code": kiln_code_hash(),
    }


def digest(factors: dict) -> str:
    canonical = json.dumps(factors, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def mismatched_environment(stored: dict, device: str) -> list[tuple[str, object, object]]:
    """(factor, bundle's value, this process's value) for every environment factor that differs."""
    here = environment_factors(device)
    return [(k, stored.get(k), here.get(k)) for k in sorted(set(stored) | set(here)) if stored.get(k) != here.get(k)]
