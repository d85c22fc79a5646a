"""grpcio as a client of an interop.v1.Interop server (rdma-rpc's on grpc://,
in the interop tests). Runs every scenario, prints `ok <scenario>` for each,
and exits non-zero at the first that fails (with what it got).

Usage: interop_client.py HOST:PORT [OVER_LIMIT_CODE [SERVER]]

OVER_LIMIT_CODE is the status code number the server answers a request
over its message limit with: 8 (RESOURCE_EXHAUSTED, the specification's;
the default) or 11 (OUT_OF_RANGE, tonic's). SERVER names the server; for
"tonic", a deadline may also end CANCELLED: tonic's server answers its own
timer's expiry so ("Timeout expired") when it fires before the client's."""

import sys
import threading
import time

import grpc

import stubs

pb, pb_grpc = stubs.load()

LIMIT = 32 << 20
ODD_MESSAGE = "100% wrong: «ünïcode», tab\tand newline\n"


def check(condition, what):
    if not condition:
        raise AssertionError(what)


def unary_metadata(stub):
    answer, call = stub.Unary.with_call(
        pb.Ask(body=b"hello"),
        metadata=[("x-user", "ada"), ("x-blob-bin", bytes([0, 255, 10]))],
    )
    check(answer.body == b"hello", f"body {answer.body!r}")
    check(list(answer.seen_metadata) == ["x-user=ada", "x-blob-bin=00ff0a"], f"seen {answer.seen_metadata}")
    headers = dict(call.initial_metadata())
    check(headers.get("x-answered") == "yes", f"headers {headers}")
    check(headers.get("x-answered-bin") == bytes([0, 159, 146, 150]), f"headers {headers}")


def every_status_code(stub):
    for code in grpc.StatusCode:
        if code == grpc.StatusCode.OK:
            continue
        number = code.value[0]
        try:
            stub.Unary(pb.Ask(fail_with_code=number, fail_message=ODD_MESSAGE))
        except grpc.RpcError as error:
            check(error.code() == code, f"code {error.code()} for {code}")
            check(error.details() == ODD_MESSAGE, f"details {error.details()!r}")
            trailers = dict(error.trailing_metadata())
            check(trailers.get("x-failure") == "as-asked", f"trailers {trailers}")
            check(trailers.get("x-failure-bin") == bytes([0, 1, 254, 255]), f"trailers {trailers}")
        else:
            raise AssertionError(f"{code} did not fail")


def deadline(stub):
    started = time.monotonic()
    try:
        stub.Unary(pb.Ask(sleep_ms=5000), timeout=0.3)
    except grpc.RpcError as error:
        expected = [grpc.StatusCode.DEADLINE_EXCEEDED]
        if SERVER == "tonic":
            expected.append(grpc.StatusCode.CANCELLED)
        check(error.code() in expected, f"code {error.code()}")
    else:
        raise AssertionError("no deadline")
    check(time.monotonic() - started < 2, "the deadline took too long")


def cancellation(stub):
    future = stub.Unary.future(pb.Ask(sleep_ms=10000))
    time.sleep(0.3)
    check(future.cancel(), "could not cancel")


def large_messages(stub):
    big = bytes([7]) * (16 << 20)
    answer = stub.Unary(pb.Ask(body=big))
    check(answer.body == big, "the 16 MiB echo differs")
    sized = stub.Unary(pb.Ask(answer_size=16 << 20))
    check(len(sized.body) == 16 << 20, f"answer of {len(sized.body)} bytes")
    try:
        stub.Unary(pb.Ask(body=bytes(LIMIT + 1)))
    except grpc.RpcError as error:
        check(error.code().value[0] == OVER_LIMIT_CODE, f"code {error.code()}")
    else:
        raise AssertionError("over the server's limit, and accepted")
    check(stub.Unary(pb.Ask(body=b"still")).body == b"still", "not serving after the refusal")


def streams(stub):
    indexes = [answer.index for answer in stub.ServerStream(pb.Ask(count=1000))]
    check(indexes == list(range(1000)), "server stream out of order or short")
    got = []
    try:
        for answer in stub.ServerStream(pb.Ask(count=5, fail_with_code=10, fail_message="after five")):
            got.append(answer.index)
    except grpc.RpcError as error:
        check(error.code() == grpc.StatusCode.ABORTED and error.details() == "after five", f"{error}")
    else:
        raise AssertionError("no error after five")
    check(got == [0, 1, 2, 3, 4], f"before the error: {got}")
    summary = stub.ClientStream(iter([pb.Ask(body=b"ab")] * 100))
    check(summary.index == 100 and len(summary.body) == 200, f"summary {summary}")
    # Bidirectional in lock step: the next ask goes only after the answer.
    asks = []
    ready = threading.Condition()

    def ask_stream():
        for round_ in range(50):
            with ready:
                ready.wait_for(lambda: len(asks) > round_, timeout=5)
            yield pb.Ask(body=round_.to_bytes(4, "little"))

    with ready:
        asks.append(0)
        ready.notify_all()
    for answer in stub.Bidi(ask_stream()):
        check(answer.body == answer.index.to_bytes(4, "little"), f"answer {answer}")
        with ready:
            asks.append(answer.index + 1)
            ready.notify_all()
    check(len(asks) == 51, f"{len(asks) - 1} answers of 50")


SCENARIOS = [unary_metadata, every_status_code, deadline, cancellation, large_messages, streams]


OVER_LIMIT_CODE = int(sys.argv[2]) if len(sys.argv) > 2 else 8
SERVER = sys.argv[3] if len(sys.argv) > 3 else ""


def main():
    address = sys.argv[1]
    options = [
        ("grpc.max_receive_message_length", 2 * LIMIT),
        ("grpc.max_send_message_length", 2 * LIMIT),
    ]
    with grpc.insecure_channel(address, options=options) as channel:
        stub = pb_grpc.InteropStub(channel)
        for scenario in SCENARIOS:
            scenario(stub)
            print(f"ok {scenario.__name__}", flush=True)


if __name__ == "__main__":
    main()
