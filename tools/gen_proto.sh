#!/usr/bin/env bash
# Regenerate the Python code for the wire protocol from src/distsgd/transport/proto/distsgd.proto.
# Needs grpcio-tools (pip install -e '.[dev]'). tests/test_wire.py fails when the checked-in
# code is out of date with the .proto. Works offline: it uses the project's .venv when there is
# one (else $PYTHON, else python on PATH), and grpcio-tools ships its own protoc.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python}"
if [ -z "${PYTHON:-}" ] && [ -x "$root/.venv/bin/python" ]; then
  python="$root/.venv/bin/python"
fi
cd "$root/src"
"$python" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
  distsgd/transport/proto/distsgd.proto
