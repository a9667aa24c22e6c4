"""The gRPC port's protection on real loopback servers: the API key (health open, reflection off
unless asked for), TLS and mTLS with certificates made here, and the gateway dialling through them."""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from fastapi.testclient import TestClient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from forge_gateway.app import create_app
from forge_gateway.config import GatewayConfig
from forge_service.config import ServiceConfig
from forge_service.pb import forge_pb2 as pb
from forge_service.pb import forge_pb2_grpc as pb_grpc
from forge_service.server import ForgeService
from tests.unit.fakes import FakeEngine

pytestmark = pytest.mark.timeout(60)
KEY = "sk-grpc-test"
CONFIG = ServiceConfig(host="127.0.0.1", grpc_port=0, drain_timeout_s=5.0)
S = grpc.StatusCode


# ---- certificates ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # trusts nothing Forge serves

    def bytes(self, name: str) -> bytes:
        return getattr(self, name).read_bytes()


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key: Any, issuer: x509.Name | None, issuer_key: Any, *, ca: bool,
          usage: Any = None, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, *objects: Any) -> Path:
    parts = []
    for obj in objects:
        if isinstance(obj, x509.Certificate):
            parts.append(obj.public_bytes(serialization.Encoding.PEM))
        else:
            parts.append(obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    path.write_bytes(b"".join(parts))
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca_key, other_key = _key(), _key()
    ca = _cert("forge test ca", ca_key, None, ca_key, ca=True)
    other = _cert("another ca", other_key, None, other_key, ca=True)
    server_key, client_key = _key(), _key()
    server = _cert("localhost", server_key, ca.subject, ca_key, ca=False, usage=ExtendedKeyUsageOID.SERVER_AUTH,
                   server=True)
    client = _cert("gateway", client_key, ca.subject, ca_key, ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return Pki(_write(root / "ca.pem", ca), _write(root / "server.pem", server),
               _write(root / "server.key", server_key), _write(root / "client.pem", client),
               _write(root / "client.key", client_key),
               _write(root / "other.pem", other))


# ---- servers and channels ----------------------------------------------------------------------

def serve(config: ServiceConfig, body: Callable[[int], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        service = ForgeService(config, FakeEngine)
        port = await service.start()
        await service.load()
        try:
            return await asyncio.wait_for(body(port), 30)
        finally:
            await service.stop()

    return asyncio.run(main())


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def outcome(awaitable: Awaitable[Any]) -> S:
    try:
        await awaitable
    except grpc.aio.AioRpcError as error:
        return error.code()
    return S.OK


def request() -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hi", stopping=pb.StoppingParameters(max_tokens=2))


async def probes(channel: grpc.aio.Channel) -> tuple[Any, Any]:
    check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="forge.v1.Forge"))
    return check.status, (await pb_grpc.ForgeStub(channel).Health(pb.HealthRequest())).ready


async def reflection_services(channel: grpc.aio.Channel, metadata: Any = None) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                     metadata=metadata)
    return {s.name for r in [r async for r in call] for s in r.list_services_response.service}


# ---- the API key -----------------------------------------------------------------------------

def test_calls_need_the_key_and_health_does_not() -> None:
    async def body(port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ForgeStub(channel)
            assert await outcome(stub.Generate(request())) == S.UNAUTHENTICATED
            assert await outcome(stub.Generate(request(), metadata=bearer("sk-wrong"))) == S.UNAUTHENTICATED
            assert await outcome(stub.Generate(request(), metadata=(("authorization", KEY),))) == S.UNAUTHENTICATED
            assert await outcome(_drain(stub.Stream(request()))) == S.UNAUTHENTICATED
            assert await outcome(stub.ListModels(pb.ListModelsRequest())) == S.UNAUTHENTICATED
            assert await outcome(stub.Tokenize(request())) == S.UNAUTHENTICATED
            assert await outcome(stub.Detokenize(pb.DetokenizeRequest(token_ids=[1]))) == S.UNAUTHENTICATED
            # A refused call's request is not even parsed: invalid bytes still answer UNAUTHENTICATED.
            raw = channel.unary_unary("/forge.v1.Forge/Generate")
            assert await outcome(raw(b"\x1a\x01\xff")) == S.UNAUTHENTICATED
            assert await probes(channel) == (health_pb2.HealthCheckResponse.SERVING, True)
            answer = await stub.Generate(request(), metadata=bearer(KEY))
            assert answer.choices[0].text == "hi"
            assert await outcome(reflection_services(channel, bearer(KEY))) == S.UNIMPLEMENTED  # off with a key

    serve(replace(CONFIG, grpc_api_key=KEY), body)


def test_the_gateway_key_protects_grpc_unless_another_is_set() -> None:
    async def body(port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ForgeStub(channel)
            assert await outcome(stub.Generate(request())) == S.UNAUTHENTICATED
            assert await outcome(stub.Generate(request(), metadata=bearer("sk-gateway"))) == S.OK

    serve(replace(CONFIG, api_key="sk-gateway"), body)
    assert replace(CONFIG, api_key="sk-gateway", grpc_api_key="").grpc_key is None  # explicitly open


def test_reflection_with_a_key_only_when_asked_for_and_behind_the_key() -> None:
    async def body(port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await outcome(reflection_services(channel)) == S.UNAUTHENTICATED
            assert "forge.v1.Forge" in await reflection_services(channel, bearer(KEY))

    serve(replace(CONFIG, grpc_api_key=KEY, enable_reflection=True), body)


# ---- TLS and mTLS ----------------------------------------------------------------------------

def test_tls_port_refuses_plaintext_and_serves_tls(pki: Pki) -> None:
    async def body(port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
            assert await outcome(pb_grpc.ForgeStub(plain).Health(pb.HealthRequest(), timeout=3)) == S.UNAVAILABLE
        untrusted = grpc.ssl_channel_credentials(pki.bytes("other_ca"))
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", untrusted) as channel:
            assert await outcome(pb_grpc.ForgeStub(channel).Health(pb.HealthRequest(), timeout=3)) == S.UNAVAILABLE
        trusted = grpc.ssl_channel_credentials(pki.bytes("ca"))
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", trusted) as channel:
            assert (await pb_grpc.ForgeStub(channel).Generate(request())).choices[0].text == "hi"

    serve(replace(CONFIG, tls_cert=str(pki.server_cert), tls_key=str(pki.server_key)), body)


def test_mtls_needs_a_client_certificate_from_the_client_ca(pki: Pki) -> None:
    async def body(port: int) -> None:
        no_cert = grpc.ssl_channel_credentials(pki.bytes("ca"))
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", no_cert) as channel:
            assert await outcome(pb_grpc.ForgeStub(channel).Health(pb.HealthRequest(), timeout=3)) == S.UNAVAILABLE
        with_cert = grpc.ssl_channel_credentials(pki.bytes("ca"), pki.bytes("client_key"), pki.bytes("client_cert"))
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", with_cert) as channel:
            assert (await pb_grpc.ForgeStub(channel).Generate(request(), metadata=bearer(KEY))).choices[0].text == "hi"

    serve(replace(CONFIG, tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_client_ca=str(pki.ca),
                  grpc_api_key=KEY), body)


def test_tls_flags_must_come_in_pairs(pki: Pki) -> None:
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key"):
        serve(replace(CONFIG, tls_cert=str(pki.server_cert)), lambda port: asyncio.sleep(0))
    with pytest.raises(ValueError, match="cannot read"):
        serve(replace(CONFIG, tls_cert=str(pki.server_cert), tls_key="/nonexistent.key"), lambda port: asyncio.sleep(0))


# ---- the gateway through TLS, mTLS and the key -----------------------------------------------

@pytest.fixture
def background_service(pki: Pki) -> Iterator[Callable[[ServiceConfig], int]]:
    """Runs a ForgeService on its own event loop in a thread (the gateway's TestClient has its own)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    services: list[ForgeService] = []

    def start(config: ServiceConfig) -> int:
        async def up() -> int:
            service = ForgeService(config, FakeEngine)
            services.append(service)
            port = await service.start()
            await service.load()
            return port

        return asyncio.run_coroutine_threadsafe(up(), loop).result(10)

    yield start
    for service in services:
        asyncio.run_coroutine_threadsafe(service.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_while_a_key_is_rotated_every_key_in_its_list_is_accepted(background_service: Callable[..., int]) -> None:
    port = background_service(replace(CONFIG, grpc_api_key="sk-old, sk-new"))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ForgeStub(channel)
        for key, ok in (("sk-old", True), ("sk-new", True), ("sk-other", False), ("sk-old, sk-new", False)):
            try:
                stub.Generate(request(), metadata=bearer(key), timeout=10)
                assert ok, key
            except grpc.RpcError as error:
                assert not ok and error.code() == S.UNAUTHENTICATED, (key, error)
    # The gateway accepts any of its clients' keys and presents the first of its gRPC keys.
    gateway = GatewayConfig(target=f"127.0.0.1:{port}", api_key="cl-new,cl-old", grpc_api_key="sk-new,sk-gone")
    body = {"model": "fake-model", "prompt": "hey", "max_tokens": 2}
    with TestClient(create_app(gateway)) as http:
        for key, status in (("cl-new", 200), ("cl-old", 200), ("cl-other", 401), ("cl-new,cl-old", 401)):
            answer = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == status, (key, answer.text)
    with TestClient(create_app(replace(gateway, grpc_api_key="sk-gone,sk-new"))) as http:
        answer = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer cl-new"})
        assert answer.status_code == 401, answer.text


@pytest.mark.parametrize("make", [lambda key: replace(CONFIG, grpc_api_key=key),
                                  lambda key: replace(CONFIG, api_key=key),
                                  lambda key: GatewayConfig(api_key=key), lambda key: GatewayConfig(grpc_api_key=key)])
def test_an_empty_key_in_a_list_is_a_setting_error(make: Callable[[str], Any]) -> None:
    for key in ("a,,b", "a,", ",a", " , "):
        with pytest.raises(ValueError, match="an empty key in the list"):
            make(key)
    make("a, b")


def test_the_gateway_dials_through_mtls_with_the_key(pki: Pki, background_service: Callable[..., int]) -> None:
    port = background_service(replace(CONFIG, tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                                      tls_client_ca=str(pki.ca), grpc_api_key=KEY))
    good = GatewayConfig(target=f"localhost:{port}", grpc_api_key=KEY, grpc_ca_file=str(pki.ca),
                         grpc_client_cert=str(pki.client_cert), grpc_client_key=str(pki.client_key))
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hey"}], "max_tokens": 3}
    with TestClient(create_app(good)) as http:
        answer = http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == "<us"  # the fake echoes its template
        streamed = http.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        assert http.get("/health").status_code == 200
    with TestClient(create_app(replace(good, grpc_api_key="sk-wrong"))) as http:
        refused = http.post("/v1/chat/completions", json=body)
        assert refused.status_code == 401, refused.text
        assert http.get("/health").status_code == 200  # probes need no key
    with TestClient(create_app(replace(good, grpc_client_cert=None, grpc_client_key=None))) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 503  # the handshake fails


async def _drain(call: Any) -> None:
    async for _ in call:
        pass
