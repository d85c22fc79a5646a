"""A Python gRPC client (grpcio) of echo.v1.Echo: what any gRPC user already
has. Stubs are generated from proto/echo.proto by grpcio-tools at start.

Usage: python3 examples/python/echo_client.py HOST:PORT [MESSAGE]
Needs: pip install grpcio grpcio-tools"""

import importlib
import os
import sys
import tempfile

import grpc
from grpc_tools import protoc

PROTO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "proto")


def stubs():
    out = tempfile.mkdtemp(prefix="echo-stubs-")
    status = protoc.main(
        ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--grpc_python_out={out}",
         os.path.join(PROTO_DIR, "echo.proto")]
    )
    if status != 0:
        raise RuntimeError(f"protoc failed on echo.proto ({status})")
    sys.path.insert(0, out)
    return importlib.import_module("echo_pb2"), importlib.import_module("echo_pb2_grpc")


def main():
    address = sys.argv[1]
    message = sys.argv[2] if len(sys.argv) > 2 else "hello from Python"
    pb, pb_grpc = stubs()
    with grpc.insecure_channel(address) as channel:
        reply, call = pb_grpc.EchoStub(channel).Say.with_call(
            pb.EchoRequest(message=message, payload=b"\x00\x01"),
            metadata=[("x-caller", "python")],
            timeout=10,
        )
    print(f"python grpcio: Say({message!r}) -> {reply.message!r}, {len(reply.payload)} payload bytes")


if __name__ == "__main__":
    main()
