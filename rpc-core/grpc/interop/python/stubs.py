"""interop.v1 stubs for grpcio, generated from proto/interop.proto at import
time with grpcio-tools into a temporary folder (nothing generated is kept in
the repository)."""

import importlib
import os
import sys
import tempfile

from grpc_tools import protoc

_PROTO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "proto")


def load():
    """Returns the (messages, services) modules of interop.proto."""
    out = tempfile.mkdtemp(prefix="interop-stubs-")
    status = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{_PROTO_DIR}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            os.path.join(_PROTO_DIR, "interop.proto"),
        ]
    )
    if status != 0:
        raise RuntimeError(f"protoc failed on interop.proto ({status})")
    sys.path.insert(0, out)
    return importlib.import_module("interop_pb2"), importlib.import_module("interop_pb2_grpc")
