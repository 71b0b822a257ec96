"""The checked-in generated code is exactly what grpcio-tools makes from the .proto files."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_current(tmp_path):
    protos = sorted(p.relative_to(ROOT) for p in (ROOT / "protos").glob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT), f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *map(str, protos)],
        check=True, cwd=ROOT,
    )
    generated = sorted((tmp_path / "protos").iterdir())
    assert generated, "protoc produced nothing"
    for path in generated:
        checked_in = ROOT / "protos" / path.name
        assert checked_in.exists(), f"{path.name} is generated but not checked in"
        assert checked_in.read_text() == path.read_text(), f"{path.name} is stale: run protos/gen.sh"
