"""grpcio as a client of an rdma-rpc interop.v1.Interop server whose
service runs an interceptor (tests/interceptors.rs): a call without the
token is refused UNAUTHENTICATED before the handler runs; one with it is
answered, and the handler saw the metadata the interceptor added. Prints
`ok <scenario>` for each and exits non-zero at the first that fails.

Usage: interceptor_client.py HOST:PORT"""

import sys

import grpc

import stubs

pb, pb_grpc = stubs.load()


def check(condition, what):
    if not condition:
        raise AssertionError(what)


def main():
    with grpc.insecure_channel(sys.argv[1]) as channel:
        stub = pb_grpc.InteropStub(channel)
        try:
            stub.Unary(pb.Ask(body=b"no token"), timeout=10)
        except grpc.RpcError as error:
            check(error.code() == grpc.StatusCode.UNAUTHENTICATED, f"code {error.code()}")
            check(error.details() == "x-token is required", f"details {error.details()!r}")
        else:
            raise AssertionError("a call without the token was answered")
        print("ok refused", flush=True)
        answer = stub.Unary(pb.Ask(body=b"with token"), metadata=[("x-token", "let-me-in")], timeout=10)
        check(answer.body == b"with token", f"body {answer.body!r}")
        check(
            list(answer.seen_metadata) == ["x-token=let-me-in", "x-intercepted=yes"],
            f"seen {answer.seen_metadata}",
        )
        print("ok admitted", flush=True)


if __name__ == "__main__":
    main()
