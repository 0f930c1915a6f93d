"""A server that faces a network (api/network.py): HTTPS for the OpenAI SDK, gRPC over TLS and
mutual TLS for tritonclient, CORS preflights, the API key behind TLS, request logging — with a
throwaway CA and certificates made here (the `cryptography` package)."""

from __future__ import annotations

import datetime
import ipaddress

import httpx
import openai
import pytest

from tests.conftest import MODEL, free_port, ssl_context, start_server, stop_server

KEY = "tls-key"
GOOD, EVIL = "https://app.example", "https://evil.example"


def _cert(name: str, key, issuer_name, issuer_key, ca: bool):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def trust(pki):
    """httpx's `verify` trusting the test CA."""
    return ssl_context(pki["ca"])


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """{"ca", "server.crt", "server.key", "client.crt", "client.key"}: PEM file paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "continuum test CA")])
    ca = _cert("continuum test CA", ca_key, ca_name, ca_key, ca=True)
    files = {"ca": d / "ca.crt"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for who in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        (d / f"{who}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        (d / f"{who}.crt").write_bytes(_cert(who, key, ca_name, ca_key, ca=False)
                                       .public_bytes(serialization.Encoding.PEM))
        files[f"{who}.crt"], files[f"{who}.key"] = d / f"{who}.crt", d / f"{who}.key"
    return {k: str(v) for k, v in files.items()}


@pytest.fixture(scope="module")
def tls_server(pki, tmp_path_factory):
    """(HTTPS base URL, gRPC address, log path): HTTPS with an API key, mutual-TLS gRPC, CORS
    for GOOD only, request logging with prompts cut to 12 characters."""
    grpc_port = free_port()
    log = tmp_path_factory.mktemp("tls") / "server.log"
    proc, base = start_server(
        ["--api-key", KEY, "--max-model-len", "512", "--kv-cache-memory", "0.25",
         "--ssl-keyfile", pki["server.key"], "--ssl-certfile", pki["server.crt"],
         "--grpc-port", str(grpc_port), "--grpc-use-ssl", "true",
         "--grpc-server-cert", pki["server.crt"], "--grpc-server-key", pki["server.key"],
         "--grpc-root-cert", pki["ca"], "--grpc-use-ssl-mutual", "true",
         "--allowed-origins", f'["{GOOD}"]', "--enable-log-requests", "--max-log-len", "12"],
        "/health/ready", log, https_ca=pki["ca"])
    yield base, f"localhost:{grpc_port}", log
    stop_server(proc)


def test_openai_sdk_over_https_with_the_key_enforced(tls_server, pki):
    base, _, log = tls_server
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY,
                           http_client=httpx.Client(verify=trust(pki)))
    out = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                         messages=[{"role": "user", "content": "Hi there"}])
    assert out.usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong",
                      http_client=httpx.Client(verify=trust(pki))).models.list()
    with pytest.raises(httpx.TransportError):                  # plaintext is not served
        httpx.get(base.replace("https", "http") + "/health", timeout=5)
    with pytest.raises(httpx.ConnectError):                    # a client without the CA refuses
        httpx.get(base + "/health", timeout=5)
    logged = log.read_text()
    assert "Received request chatcmpl-" in logged and "prompt_token_ids" in logged
    line = next(x for x in logged.splitlines() if "Received request" in x)
    assert "prompt: '" in line and len(line.split("prompt: '")[1].split("'")[0]) <= 12
    assert httpx.get(base + "/health", verify=trust(pki), timeout=5).status_code == 200


def test_cors_preflight_only_for_an_allowed_origin(tls_server, pki):
    base, _, _ = tls_server
    ask = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(base + "/v1/chat/completions", headers={"Origin": GOOD, **ask},
                       verify=trust(pki), timeout=5)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == GOOD
    bad = httpx.options(base + "/v1/chat/completions", headers={"Origin": EVIL, **ask},
                        verify=trust(pki), timeout=5)
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    simple = httpx.get(base + "/v1/models", headers={"Origin": GOOD,
                                                     "Authorization": f"Bearer {KEY}"},
                       verify=trust(pki), timeout=5)
    assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == GOOD
    assert httpx.get(base + "/health", verify=trust(pki), timeout=5).status_code == 200


def test_grpc_over_mutual_tls(tls_server, pki):
    """tritonclient with ssl=True and its client certificate is served; without a client
    certificate the handshake is refused; the server stays live."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    _, address, _ = tls_server
    client = grpcclient.InferenceServerClient(
        address, ssl=True, root_certificates=pki["ca"], private_key=pki["client.key"],
        certificate_chain=pki["client.crt"])
    assert client.is_server_live() and client.is_server_ready()
    anonymous = grpcclient.InferenceServerClient(address, ssl=True,
                                                 root_certificates=pki["ca"])
    with pytest.raises(InferenceServerException):
        anonymous.is_server_live(client_timeout=5)
    plaintext = grpcclient.InferenceServerClient(address)
    with pytest.raises(InferenceServerException):
        plaintext.is_server_live(client_timeout=5)
    assert client.is_server_live()


def test_bad_network_flags_are_start_errors(pki):
    """A key without its certificate, mutual TLS without a root: one-line start errors."""
    import subprocess
    import sys

    for args, flag in ((["--ssl-keyfile", pki["server.key"]], "--ssl-certfile"),
                       (["--grpc-use-ssl", "true", "--grpc-server-cert", pki["server.crt"],
                         "--grpc-server-key", pki["server.key"], "--grpc-use-ssl-mutual",
                         "true"], "--grpc-root-cert"),
                       (["--allowed-origins", "*"], "--allowed-origins")):
        r = subprocess.run([sys.executable, "-m", "api", "serve", *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and flag in r.stderr, r.stderr[-500:]


@pytest.mark.extended          # a second TLS server: client certificates on HTTP too
def test_https_client_certificates_required(pki, tmp_path):
    """`--ssl-cert-reqs 2 --ssl-ca-certs CA`: a client with a certificate from CA is served,
    one without is refused in the handshake. A pooled keep-alive client left idle (it never
    answers the server's TLS close) does not hold the stop: under 3 s, no error line (it
    took uvicorn's 5 s graceful timeout and logged "timeout graceful shutdown exceeded")."""
    import time

    log = tmp_path / "log"
    proc, base = start_server(
        ["--max-model-len", "256", "--kv-cache-memory", "0.1", "--ssl-keyfile",
         pki["server.key"], "--ssl-certfile", pki["server.crt"], "--ssl-ca-certs", pki["ca"],
         "--ssl-cert-reqs", "2"], "/health", log,
        https_ca=pki["ca"], client_cert=(pki["client.crt"], pki["client.key"]))
    try:
        ctx = ssl_context(pki["ca"], (pki["client.crt"], pki["client.key"]))
        assert httpx.get(base + "/health", verify=ctx, timeout=5).status_code == 200
        with pytest.raises(httpx.TransportError):
            httpx.get(base + "/health", verify=trust(pki), timeout=5).raise_for_status()
        idle = httpx.Client(verify=ctx, timeout=5)
        assert idle.get(base + "/health").status_code == 200
        t0 = time.monotonic()
        stop_server(proc)
        assert time.monotonic() - t0 < 3
        assert "graceful shutdown exceeded" not in log.read_text()
        idle.close()
    finally:
        if proc.poll() is None:
            stop_server(proc)


def test_a_taken_port_is_one_line_and_no_traceback():
    """`continuum serve --port P` with P taken by another listener exits 1 with one line naming
    the port, before the engine starts (no traceback from its process)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "api", "serve", "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
