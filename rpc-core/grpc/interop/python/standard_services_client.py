"""grpcio's own stubs for the standard services (grpcio-health-checking,
grpcio-reflection) against a server: health Check and Watch, and reflection
(list the services, fetch a service's descriptor through a descriptor pool).
Prints `ok <part>` for each, and `watching` when its Watch has the first
status: the test then sets the service NOT_SERVING, which the Watch must see.

Usage: standard_services_client.py HOST:PORT"""

import sys

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

SERVICE = "interop.v1.Interop"


def check(condition, what):
    if not condition:
        raise AssertionError(what)


def health(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    whole = stub.Check(health_pb2.HealthCheckRequest(service=""))
    check(whole.status == serving, f"server: {whole}")
    one = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE))
    check(one.status == serving, f"{SERVICE}: {one}")
    try:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    except grpc.RpcError as error:
        check(error.code() == grpc.StatusCode.NOT_FOUND, f"unknown service: {error.code()}")
    else:
        raise AssertionError("an unknown service has a status")
    print("ok health", flush=True)
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=30)
    first = next(watch)
    check(first.status == serving, f"watch: {first}")
    print("watching", flush=True)
    second = next(watch)
    check(second.status == health_pb2.HealthCheckResponse.NOT_SERVING, f"watch: {second}")
    watch.cancel()
    print("ok watch", flush=True)


def reflection(channel):
    database = ProtoReflectionDescriptorDatabase(channel)
    services = set(database.get_services())
    for expected in [SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"]:
        check(expected in services, f"{expected} not listed: {services}")
    pool = descriptor_pool.DescriptorPool(database)
    service = pool.FindServiceByName(SERVICE)
    methods = [method.name for method in service.methods]
    check(methods == ["Unary", "ServerStream", "ClientStream", "Bidi"], f"methods {methods}")
    ask = pool.FindMessageTypeByName("interop.v1.Ask")
    check("fail_with_code" in ask.fields_by_name, f"fields {list(ask.fields_by_name)}")
    print("ok reflection", flush=True)


def main():
    with grpc.insecure_channel(sys.argv[1]) as channel:
        reflection(channel)
        health(channel)


if __name__ == "__main__":
    main()
