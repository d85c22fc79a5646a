"""grpcio's secure channel against rdma-rpc's grpcs:// server
(tests/tls.rs): trusting the test CA, unary and streaming calls are
answered; trusting another CA, the handshake fails (UNAVAILABLE). Prints
`ok <scenario>` for each and exits non-zero at the first that fails.

Usage: tls_client.py PORT CA_PEM OTHER_CA_PEM"""

import sys

import grpc

import stubs

pb, pb_grpc = stubs.load()


def check(condition, what):
    if not condition:
        raise AssertionError(what)


def main():
    port, ca, other = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(ca, "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
        stub = pb_grpc.InteropStub(channel)
        answer = stub.Unary(pb.Ask(body=b"over tls"), metadata=[("x-user", "ada")], timeout=30)
        check(answer.body == b"over tls", f"body {answer.body!r}")
        check(list(answer.seen_metadata) == ["x-user=ada"], f"seen {answer.seen_metadata}")
        answers = list(stub.ServerStream(pb.Ask(count=3, answer_size=70_000), timeout=30))
        check([a.index for a in answers] == [0, 1, 2], "stream")
        print("ok secure_calls", flush=True)
    with open(other, "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
        stub = pb_grpc.InteropStub(channel)
        try:
            stub.Unary(pb.Ask(body=b"x"), timeout=10)
        except grpc.RpcError as error:
            check(error.code() == grpc.StatusCode.UNAVAILABLE, f"code {error.code()} {error.details()}")
        else:
            raise AssertionError("a channel that trusts another CA was answered")
        print("ok untrusted_refused", flush=True)


if __name__ == "__main__":
    main()
