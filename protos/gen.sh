#!/usr/bin/env bash
# Regenerate the checked-in Python code from the .proto files (repo root as proto path).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. protos/*.proto
