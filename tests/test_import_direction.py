"""The house in one direction: the CLI on top, the services below it, tracing/ and the foundation kiln/ at the
bottom. Read from the source with ast (every import, module level or inside a function), so it stays true."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kiln_cli", "compile_service", "exec_service", "tracing", "kiln")
# What each package may import of the others (protos/, the wire contract, is open to all).
ALLOWED = {
    "kiln_cli": {"compile_service", "exec_service", "tracing", "kiln"},
    "compile_service": {"tracing", "kiln"},
    "exec_service": {"tracing", "kiln"},
    "tracing": {"kiln"},
    "kiln": set(),
}


def top_level_imports(path: Path) -> set[str]:
    """The top-level names of every module ``path`` imports, however and wherever it imports them."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def package_imports() -> dict[str, dict[str, set[Path]]]:
    """package -> imported package -> the files that import it."""
    graph: dict[str, dict[str, set[Path]]] = {package: {} for package in PACKAGES}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for imported in top_level_imports(path) & set(PACKAGES) - {package}:
                graph[package].setdefault(imported, set()).add(path.relative_to(ROOT))
    return graph


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_what_lies_below_it(package):
    wrong = {imported: sorted(map(str, files)) for imported, files in package_imports()[package].items()
             if imported not in ALLOWED[package]}
    assert not wrong, f"{package} imports upward: {wrong}"


def test_no_cycle_between_packages():
    graph = {package: set(edges) for package, edges in package_imports().items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start])

    assert not [package for package in PACKAGES if reaches(package, package, set())]


def test_the_engine_core_knows_no_wire_types():
    """Scheduler, blocks, sequences, sampler, runner, request stream: Python types only; protobuf is made at the
    API edge (exec_service/api/)."""
    core = ROOT / "exec_service" / "engine"
    wired = sorted(str(p.relative_to(ROOT)) for p in core.rglob("*.py")
                   if {"protos", "grpc", "google"} & top_level_imports(p))
    assert not wired, f"the engine core imports wire types: {wired}"


_WIRE_GUARD = """
import importlib, pkgutil, sys, traceback

class WireGuard:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("protos", "grpc") or name.startswith("google.protobuf"):
            sys.exit("loaded " + name + " through:\\n" + "".join(traceback.format_stack(limit=12)))

sys.meta_path.insert(0, WireGuard())
import exec_service.engine as engine
for module in pkgutil.walk_packages(engine.__path__, "exec_service.engine."):
    importlib.import_module(module.name)
"""


def test_importing_the_engine_loads_no_wire_module():
    """Transitively, not just its own imports: every engine module imported in a fresh interpreter, with any
    import of protos, grpc or google.protobuf (at any depth: kiln/, tracing/, a library) failing the run."""
    done = subprocess.run([sys.executable, "-c", _WIRE_GUARD], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_check_sees_imports():
    """The parser finds what is there: kiln_cli imports each of the four packages below it."""
    assert set(package_imports()["kiln_cli"]) == ALLOWED["kiln_cli"]
