"""grpcio as a client that compresses (tests/compression.rs): against an
rdma-rpc server that accepts gzip, compressed unary and streaming calls
are answered byte for byte; against one that does not (the default), a
compressed call gets UNIMPLEMENTED. Prints `ok <scenario>` for each and
exits non-zero at the first that fails.

Usage: compression_client.py GZIP_HOST:PORT DEFAULT_HOST:PORT"""

import sys

import grpc

import stubs

pb, pb_grpc = stubs.load()

LIMIT = 32 << 20


def check(condition, what):
    if not condition:
        raise AssertionError(what)


def main():
    options = [("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)]
    with grpc.insecure_channel(sys.argv[1], options=options) as channel:
        stub = pb_grpc.InteropStub(channel)
        body = b"compressible " * 200_000  # 2.6 MB: inflated off the runtime threads
        answer = stub.Unary(pb.Ask(body=body), compression=grpc.Compression.Gzip, timeout=30)
        check(answer.body == body, f"unary body of {len(answer.body)} bytes")
        print("ok gzip_unary", flush=True)
        answers = list(
            stub.ServerStream(pb.Ask(count=3, answer_size=100_000), compression=grpc.Compression.Gzip, timeout=30)
        )
        check([a.index for a in answers] == [0, 1, 2], f"indices {[a.index for a in answers]}")
        check(all(a.body == b"a" * 100_000 for a in answers), "stream bodies")
        print("ok gzip_server_stream", flush=True)
        asks = (pb.Ask(body=bytes([i]) * 50_000) for i in range(4))
        answer = stub.ClientStream(asks, compression=grpc.Compression.Gzip, timeout=30)
        check(answer.index == 4, f"count {answer.index}")
        check(answer.body == b"".join(bytes([i]) * 50_000 for i in range(4)), "joined body")
        print("ok gzip_client_stream", flush=True)
    with grpc.insecure_channel(sys.argv[2]) as channel:
        stub = pb_grpc.InteropStub(channel)
        try:
            stub.Unary(pb.Ask(body=b"x" * 1000), compression=grpc.Compression.Gzip, timeout=10)
        except grpc.RpcError as error:
            check(error.code() == grpc.StatusCode.UNIMPLEMENTED, f"code {error.code()} {error.details()}")
        else:
            raise AssertionError("a server that accepts no compression answered a gzip call")
        answer = stub.Unary(pb.Ask(body=b"plain"), timeout=10)
        check(answer.body == b"plain", "uncompressed call")
        print("ok refused_by_default", flush=True)


if __name__ == "__main__":
    main()
