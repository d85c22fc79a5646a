"""grpcio as an interop.v1.Interop server, with the same behaviour as the
Rust implementations (rpc-core/grpc/interop/src/lib.rs). Prints
`LISTENING <port>` once it serves.

One addition for the tests: a unary call whose body is `__abandoned__` is
answered with `index` = the number of handlers that ended because their
call was cancelled or timed out (grpcio's handlers run in threads and are
not dropped; they see it through the context).

Usage: interop_server.py [PORT]"""

import os
import sys
import threading
import time
from concurrent import futures

import grpc

import stubs

pb, pb_grpc = stubs.load()

LIMIT = 32 << 20
abandoned = 0
lock = threading.Lock()


def seen(context):
    entries = []
    for key, value in context.invocation_metadata():
        if not key.startswith("x-"):
            continue
        if key.endswith("-bin"):
            entries.append(f"{key}={value.hex()}")
        else:
            entries.append(f"{key}={value}")
    return entries


def fail(context, ask):
    if ask.fail_with_code == 0:
        return
    code = next(c for c in grpc.StatusCode if c.value[0] == ask.fail_with_code)
    context.set_trailing_metadata([("x-failure", "as-asked"), ("x-failure-bin", bytes([0, 1, 254, 255]))])
    context.abort(code, ask.fail_message)


def pause(context, ask):
    """Sleeps sleep_ms unless the call ends first; True when it did."""
    global abandoned
    deadline = time.monotonic() + ask.sleep_ms / 1000
    while time.monotonic() < deadline:
        if not context.is_active():
            with lock:
                abandoned += 1
            return True
        time.sleep(0.01)
    return False


def body(ask):
    return bytes([ord("a")]) * ask.answer_size if ask.answer_size else ask.body


class Interop(pb_grpc.InteropServicer):
    def Unary(self, ask, context):
        if ask.body == b"__abandoned__":
            with lock:
                return pb.Answer(index=abandoned)
        if pause(context, ask):
            return pb.Answer()
        fail(context, ask)
        context.send_initial_metadata([("x-answered", "yes"), ("x-answered-bin", bytes([0, 159, 146, 150]))])
        return pb.Answer(body=body(ask), seen_metadata=seen(context))

    def ServerStream(self, ask, context):
        global abandoned
        # Ended (or counted by pause) unless grpcio closed the generator
        # at a yield: the client went away between answers.
        ended = False
        try:
            for index in range(ask.count):
                if pause(context, ask):
                    ended = True
                    return
                yield pb.Answer(body=body(ask), index=index, seen_metadata=seen(context))
            ended = True
            fail(context, ask)
        finally:
            if not ended:
                with lock:
                    abandoned += 1

    def ClientStream(self, asks, context):
        joined, count, last = b"", 0, pb.Ask()
        for ask in asks:
            joined += ask.body
            count += 1
            last = ask
        fail(context, last)
        return pb.Answer(body=joined, index=count, seen_metadata=seen(context))

    def Bidi(self, asks, context):
        for index, ask in enumerate(asks):
            fail(context, ask)
            yield pb.Answer(body=body(ask), index=index)


def main():
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    options = [
        ("grpc.max_receive_message_length", LIMIT),
        ("grpc.max_send_message_length", 2 * LIMIT),
    ]
    # INTEROP_COMPRESSION=gzip: every response compressed (when the client accepts it).
    compression = grpc.Compression.Gzip if os.environ.get("INTEROP_COMPRESSION") == "gzip" else None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=options, compression=compression)
    pb_grpc.add_InteropServicer_to_server(Interop(), server)
    # INTEROP_TLS_CERT / INTEROP_TLS_KEY (PEM files): a secure port instead.
    cert, key = os.environ.get("INTEROP_TLS_CERT"), os.environ.get("INTEROP_TLS_KEY")
    if cert and key:
        with open(cert, "rb") as c, open(key, "rb") as k:
            credentials = grpc.ssl_server_credentials([(k.read(), c.read())])
        port = server.add_secure_port(f"127.0.0.1:{port}", credentials)
    else:
        port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(f"LISTENING {port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
