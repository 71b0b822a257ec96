"""Kiln's own code as a key factor: every Kiln module the trace or the compile runs, hashed by its syntax tree.

The modules are found, not listed: the Kiln imports reachable from the compile pipeline (function-level imports too),
so a module the compile starts to use is hashed without anyone remembering to add it. Hashing the syntax tree with
docstrings dropped means a comment, a docstring or a reformatting keeps the key; a changed statement does not.
The sources are read as files, never imported, so the execute service computes the same hash from the same install.
"""

import ast
import functools
import hashlib
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the directory holding the kiln and compile_service packages
KILN_PACKAGES = ("kiln", "compile_service", "tracing", "protos")
ENTRY = "compile_service.pipeline"  # compile_model: key, trace, split, Inductor, save

# Reached from the compile but unable to change the generated code, and why.
NOT_CODE_MODULES = {
    "kiln.errors": "status codes of failures",
    "kiln.store.artifact_store": "where bundles are stored",
    "kiln.store.bundle": "how bundles are written and moved",
    "kiln.compilation.cache_key": "computes the key over the factors",
    "kiln.compilation.code_hash": "computes this factor",
    "kiln.compilation.compiler_caches": "where Inductor's and Triton's caches live",
    "kiln.compilation.inductor_options": "which Inductor options a client may set (their values are factors of "
                                         "their own)",
    "kiln.model.roots": "which directories a model may be read from",
    "kiln.store.signing": "signs and verifies bundles",
    "kiln.model.checkpoint": "checks a checkpoint's tensors against the model",
    "kiln.model.device_memory": "whether the weights fit the device",
    "kiln.model.features": "which configs are refused; a served config's fields are factors of their own",
    "kiln.model.presets": "preset configs, whose fields are factors of their own",
    "kiln.attention.reference": "the attention kernel that runs between compiled pieces, never traced",
    "kiln.attention.triton_kernels": "the attention kernel that runs between compiled pieces, never traced",
    "kiln.attention.forward_context": "the runtime metadata of the attention op, never traced",
    "tracing": "spans and metrics",
    "protos": "the wire format",
}


# One parse at a time: CPython 3.11's ast.parse keeps its recursion depth per interpreter, not per thread, so two
# threads parsing at once fail with "SystemError: AST constructor recursion depth mismatch" (concurrent Compile and
# LoadModel calls computing their first key did). The servers also compute the hash before they serve.
_PARSING = threading.Lock()


def kiln_code_hash(root: Path = ROOT) -> str:
    """sha256 over (module name, syntax tree) of every module in ``code_modules(root)``."""
    with _PARSING:
        return _hash(str(root))


def code_modules(root: Path = ROOT) -> list[str]:
    """The Kiln modules the compile pipeline reaches, minus those that cannot change the generated code."""
    with _PARSING:
        return _modules(str(root))


@functools.lru_cache(maxsize=8)
def _hash(root: str) -> str:
    digest = hashlib.sha256()
    for name in _modules(root):
        digest.update(name.encode())
        digest.update(ast.dump(_without_docstrings(_parse(Path(root), name))).encode())
    return digest.hexdigest()


@functools.lru_cache(maxsize=8)
def _modules(root: str) -> list[str]:
    seen, todo = set(), [ENTRY]
    while todo:
        name = todo.pop()
        if name in seen or _excluded(name):
            continue
        seen.add(name)
        todo.extend(_kiln_imports(_parse(Path(root), name), name, Path(root)))
    return sorted(seen)


def _excluded(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in NOT_CODE_MODULES)


def _source_path(root: Path, name: str) -> Path:
    base = root.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _parse(root: Path, name: str) -> ast.Module:
    return ast.parse(_source_path(root, name).read_text(), filename=name)


def _kiln_imports(tree: ast.Module, name: str, root: Path) -> list[str]:
    """Kiln modules that ``tree`` imports anywhere in its body; ``from kiln import x`` names module x."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return [m for m in found if m.split(".")[0] in KILN_PACKAGES and _source_path(root, m).is_file()]


def _without_docstrings(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return tree
