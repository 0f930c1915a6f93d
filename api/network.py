"""Facing a network: TLS on HTTP (vLLM's `--ssl-*` flags, served by uvicorn's SSL) and on gRPC
(Triton's `--grpc-use-ssl*` flags, grpcio's server credentials), CORS (vLLM's `--allowed-*` and
`--allow-credentials`, Starlette's `CORSMiddleware`), `--root-path`, request logging
(`--enable-log-requests`, `--max-log-len`) and `--disable-uvicorn-access-log`.

In: parsed `continuum serve` flags. Out: a frozen `NetworkConfig` (checked: files exist, the
pairs that need each other are given), uvicorn's keyword arguments, the ASGI app wrapped in
CORS (outermost, so a preflight is answered before the API key is asked for, as in vLLM), the
gRPC server credentials, and one log line per request when asked.
"""

from __future__ import annotations

import argparse
import json
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

from engine.log_config import verbose

logger = logging.getLogger("continuum.api")


@dataclass(frozen=True)
class NetworkConfig:
    """The flags of this module, checked. Paths are PEM files; `ssl_cert_reqs` is an
    `ssl.VerifyMode` value (0 none, 1 optional, 2 required client certificates); the CORS
    lists hold origins / methods / headers ("*" = any); `max_log_len` in characters (and
    token ids) of a logged prompt, None = whole."""

    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = int(ssl.CERT_NONE)
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""
    enable_log_requests: bool = False
    max_log_len: int | None = None
    disable_uvicorn_access_log: bool = False
    otlp_traces_endpoint: str | None = None       # OpenAI spans (api/tracing.py)
    grpc_use_ssl: bool = False
    grpc_server_cert: str | None = None
    grpc_server_key: str | None = None
    grpc_root_cert: str | None = None
    grpc_use_ssl_mutual: bool = False


def _json_list(value: str) -> list[str]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not a JSON list: {value!r}") from None
    if not isinstance(parsed, list) or not all(isinstance(x, str) for x in parsed):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {value!r}")
    return parsed


def add_network_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's TLS / CORS / logging flags and Triton's gRPC TLS flags, under their names."""
    g = p.add_argument_group("network (TLS, CORS, request logging)")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="HTTPS private key (PEM)")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="HTTPS certificate chain (PEM); with --ssl-keyfile the HTTP port "
                        "speaks TLS only")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="CA certificates (PEM) that client certificates are checked against")
    g.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                   help="client certificates: 0 not asked, 1 optional, 2 required "
                        "(Python's ssl.CERT_*; default: 0)")
    g.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
                   help='CORS origins, a JSON list (default: ["*"])')
    g.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                   help='CORS methods, a JSON list (default: ["*"])')
    g.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                   help='CORS request headers, a JSON list (default: ["*"])')
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (cookies, authorization headers)")
    g.add_argument("--root-path", default="", metavar="PATH",
                   help="the path prefix a proxy serves this server under (ASGI root_path)")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's prompt and parameters (default: not logged)")
    g.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="with --enable-log-requests, log at most N prompt characters and "
                        "token ids (default: all)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access-log line per HTTP request")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send an OpenTelemetry span per OpenAI request to this OTLP endpoint "
                        "(gRPC; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf for HTTP), "
                        "as vLLM (default: off)")
    g.add_argument("--grpc-use-ssl", nargs="?", const="true", default="false", metavar="BOOL",
                   help="gRPC over TLS (Triton's flag; needs --grpc-server-cert and "
                        "--grpc-server-key)")
    g.add_argument("--grpc-server-cert", default=None, metavar="FILE",
                   help="gRPC server certificate (PEM)")
    g.add_argument("--grpc-server-key", default=None, metavar="FILE",
                   help="gRPC server private key (PEM)")
    g.add_argument("--grpc-root-cert", default=None, metavar="FILE",
                   help="gRPC: CA certificates (PEM) client certificates are checked against")
    g.add_argument("--grpc-use-ssl-mutual", nargs="?", const="true", default="false",
                   metavar="BOOL",
                   help="gRPC mutual TLS: clients must present a certificate signed by "
                        "--grpc-root-cert (Triton's flag)")


def bool_flag(flag: str, value: str) -> bool:
    """Triton's boolean flag values (true / false / 1 / 0 / on / off). Raises ValueError."""
    lowered = value.lower()
    if lowered in ("true", "1", "on", "yes"):
        return True
    if lowered in ("false", "0", "off", "no"):
        return False
    raise ValueError(f"{flag}: expected true or false, got {value!r}")


def network_config(args: argparse.Namespace) -> NetworkConfig:
    """The checked `NetworkConfig` of parsed flags. Raises ValueError naming the flag (a file
    that does not exist, a key without its certificate, mutual TLS without a root)."""
    net = NetworkConfig(
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
        allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
        root_path=args.root_path, enable_log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len, disable_uvicorn_access_log=args.disable_uvicorn_access_log,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        grpc_use_ssl=bool_flag("--grpc-use-ssl", args.grpc_use_ssl),
        grpc_server_cert=args.grpc_server_cert, grpc_server_key=args.grpc_server_key,
        grpc_root_cert=args.grpc_root_cert,
        grpc_use_ssl_mutual=bool_flag("--grpc-use-ssl-mutual", args.grpc_use_ssl_mutual))
    for flag, path in (("--ssl-keyfile", net.ssl_keyfile), ("--ssl-certfile", net.ssl_certfile),
                       ("--ssl-ca-certs", net.ssl_ca_certs),
                       ("--grpc-server-cert", net.grpc_server_cert),
                       ("--grpc-server-key", net.grpc_server_key),
                       ("--grpc-root-cert", net.grpc_root_cert)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{flag} {path}: no such file")
    if (net.ssl_keyfile is None) != (net.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    if net.ssl_cert_reqs not in (0, 1, 2):
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {net.ssl_cert_reqs}")
    if net.grpc_use_ssl_mutual and not net.grpc_use_ssl:
        raise ValueError("--grpc-use-ssl-mutual needs --grpc-use-ssl")
    if net.grpc_use_ssl and (net.grpc_server_cert is None or net.grpc_server_key is None):
        raise ValueError("--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key")
    if net.grpc_use_ssl_mutual and net.grpc_root_cert is None:
        raise ValueError("--grpc-use-ssl-mutual needs --grpc-root-cert")
    if net.max_log_len is not None and net.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {net.max_log_len}")
    return net


def uvicorn_kwargs(net: NetworkConfig) -> dict:
    """uvicorn.Config's TLS and root-path arguments."""
    return {"ssl_keyfile": net.ssl_keyfile, "ssl_certfile": net.ssl_certfile,
            "ssl_ca_certs": net.ssl_ca_certs, "ssl_cert_reqs": net.ssl_cert_reqs,
            "root_path": net.root_path}


def with_cors(app, net: NetworkConfig):
    """`app` behind Starlette's CORSMiddleware with the configured lists (vLLM's defaults:
    any origin, method and header, no credentials). A request without an Origin header passes
    straight through."""
    from starlette.middleware.cors import CORSMiddleware
    return CORSMiddleware(app, allow_origins=list(net.allowed_origins),
                          allow_methods=list(net.allowed_methods),
                          allow_headers=list(net.allowed_headers),
                          allow_credentials=net.allow_credentials)


def grpc_credentials(net: NetworkConfig):
    """`grpc.ServerCredentials` for --grpc-use-ssl (mutual: client certificates required and
    checked against --grpc-root-cert), or None for plaintext."""
    if not net.grpc_use_ssl:
        return None
    import grpc
    key = Path(net.grpc_server_key).read_bytes()
    cert = Path(net.grpc_server_cert).read_bytes()
    root = Path(net.grpc_root_cert).read_bytes() if net.grpc_root_cert else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=root,
                                       require_client_auth=net.grpc_use_ssl_mutual)


def log_request(net: NetworkConfig, request_id: str, prompts: list[list[int]], params,
                tokenizer) -> None:
    """With --enable-log-requests (or --log-verbose 1 or more, Triton's request logging), one
    line per prompt as vLLM writes it: the prompt's text and token ids (each cut to
    --max-log-len) and the sampling parameters."""
    if not (net.enable_log_requests or verbose()):
        return
    n = net.max_log_len
    for i, ids in enumerate(prompts):
        text = tokenizer.decode(ids)
        logger.info("Received request %s-%d: prompt: %r, params: %s, prompt_token_ids: %s",
                    request_id, i, text[:n] if n is not None else text, params,
                    ids[:n] if n is not None else ids)
