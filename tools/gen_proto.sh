#!/usr/bin/env bash
# Regenerate the Python code for the wire protocol from src/distsgd/transport/proto/distsgd.proto.
# Needs grpcio-tools (pip install -e '.[dev]'). tests/test_wire.py fails when the checked-in
# code is out of date with the .proto.
set -euo pipefail
cd "$(dirname "$0")/../src"
python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
  distsgd/transport/proto/distsgd.proto
