"""One serve configuration: `continuum serve`'s flags as a frozen `ServeConfig`, validated once.

Owns: `ServeConfig` (everything a server needs to start, the engine's `EngineConfig` inside)
and `serve_config(args)`, the one place the serve flags are checked. `continuum serve`
(api/cli.py) and every Ray Serve replica (api/ray_serve/replica.py) build their server from
it, through `api/launch.py:build_server`, so a replica refuses what the CLI refuses.
Flows in: the parsed `serve` flags (api/serve_flags.py); flows out: a `ServeConfig`.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from api.lora_flags import engine_lora_settings
from api.network import NetworkConfig, bool_flag, network_config
from engine.config import EngineConfig
from engine.log_config import LogSettings
from engine.profiles import PROFILE_FLAGS, resolve_profile


@dataclass(frozen=True)
class ServeConfig:
    """A server's settings, checked (`serve_config`). Ports are TCP ports (gRPC 0: off);
    `http_max_input_size` bytes; `shutdown_timeout` seconds; restrictions map an API category
    to the (header, value) a request must carry."""

    engine: EngineConfig
    no_llm: bool
    served_model_name: str
    api_key: str | None
    host: str
    port: int
    shutdown_timeout: float
    http_max_input_size: int
    uvicorn_log_level: str
    chat_template: str | None                 # the template's text (--chat-template)
    enable_auto_tool_choice: bool
    model_repository: str | None              # None: /v2 serves the LLM alone
    model_control_mode: str
    load_models: tuple[str, ...]
    http_restrictions: dict = field(default_factory=dict)
    grpc_restrictions: dict = field(default_factory=dict)
    grpc_host: str = "0.0.0.0"
    grpc_port: int = 0
    allow_client_shm: bool = False
    metrics_port: int = 0                     # also /metrics here (Triton's 8002); 0: off
    strict_openai: bool = False               # unknown request fields: 400, not ignored
    trust_request_chat_template: bool = False  # a request's chat_template may be used
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    enable_server_load_tracking: bool = False   # GET /load counts requests in flight
    network: NetworkConfig = field(default_factory=NetworkConfig)   # TLS, CORS, request logs
    log: LogSettings = field(default_factory=LogSettings)          # --log-* (Triton's)
    trace: dict = field(default_factory=dict)   # --trace-config, TraceManager's arguments
    api_server_count: int = 1                 # API processes over one engine core


def serve_config(args: argparse.Namespace, model_checks: bool = True) -> ServeConfig:
    """The `ServeConfig` of parsed `serve` flags. Raises ValueError naming the bad flag.
    `model_checks` False leaves out `check_model` (the checks that import torch), for a caller
    that runs them itself after starting the engine's process."""
    from triton_compat.frontend.restricted import parse_restrictions
    from triton_compat.trace import parse_trace_config

    config = engine_config(args)
    _check_numbers(args)
    grpc_port = args.grpc_port
    if grpc_port is None:            # Triton's port with a repository; else only when asked
        grpc_port = 8001 if args.model_repository is not None else 0
    if not 0 <= grpc_port < 65536:
        raise ValueError(f"--grpc-port must be in 0..65535, got {grpc_port}")
    if grpc_port == args.port:
        raise ValueError(f"--grpc-port {grpc_port} is also --port")
    if not 0 <= args.metrics_port < 65536 or args.metrics_port in (args.port, grpc_port) \
            and args.metrics_port:
        raise ValueError(f"--metrics-port must be a free port in 1..65535 (or 0: off), got "
                         f"{args.metrics_port}")
    if args.no_llm and args.model_repository is None:
        raise ValueError("--no-llm needs --model-repository (there would be nothing to "
                         "serve)")
    if args.model_repository is not None and not Path(args.model_repository).is_dir():
        raise ValueError(f"--model-repository {args.model_repository}: not a directory")
    _check_api_servers(args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    name = args.served_model_name or (Path(args.model).stem if args.model
                                      else "SmolLM2-135M-Instruct")
    api_key = args.api_key if args.api_key is not None else os.environ.get("CONTINUUM_API_KEY")
    serve = ServeConfig(
        engine=config, no_llm=args.no_llm, served_model_name=name, api_key=api_key or None,
        host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout,
        http_max_input_size=args.http_max_input_size, strict_openai=args.strict_openai,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_server_load_tracking=args.enable_server_load_tracking,
        network=network_config(args),
        uvicorn_log_level=args.uvicorn_log_level,
        chat_template=_chat_template(args.chat_template),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        model_repository=args.model_repository, model_control_mode=args.model_control_mode,
        load_models=tuple(args.load_model),
        http_restrictions=parse_restrictions(args.http_restricted_api),
        grpc_restrictions=parse_restrictions(args.grpc_restricted_protocol,
                                             "--grpc-restricted-protocol"),
        grpc_host=args.grpc_address or args.host, grpc_port=grpc_port,
        allow_client_shm=bool_flag("--allow-client-shm", args.allow_client_shm),
        metrics_port=args.metrics_port, log=log_settings(args),
        trace=parse_trace_config(args.trace_config), api_server_count=getattr(args, "api_server_count", 1))
    if model_checks:
        check_model(args, serve)
    return serve


def _check_api_servers(args: argparse.Namespace) -> None:
    """--api-server-count N: N >= 1; above 1, the LLM alone (a model repository's models and
    Triton's instance and sequence state live in one process) and /metrics on --port only."""
    n = getattr(args, "api_server_count", 1)
    if n < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {n}")
    if n == 1:
        return
    for flag, value in (("--model-repository", args.model_repository),
                        ("--metrics-port", args.metrics_port),
                        ("--data-parallel-backend ray",
                         getattr(args, "data_parallel_backend", "none") == "ray")):
        if value:
            raise ValueError(f"--api-server-count {n} cannot be used with {flag} (one API "
                             "process serves those)")


def log_settings(args: argparse.Namespace) -> LogSettings:
    """The `--log-*` flags as `LogSettings`. Raises ValueError naming the flag."""
    if args.log_verbose < 0:
        raise ValueError(f"--log-verbose must be >= 0, got {args.log_verbose}")
    return LogSettings(log_file=args.log_file,
                       log_info=bool_flag("--log-info", args.log_info),
                       log_warning=bool_flag("--log-warning", args.log_warning),
                       log_error=bool_flag("--log-error", args.log_error),
                       log_verbose_level=args.log_verbose, log_format=args.log_format)


def _check_numbers(args: argparse.Namespace) -> None:
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.http_max_input_size < 1:
        raise ValueError(f"--http-max-input-size must be >= 1, got "
                         f"{args.http_max_input_size}")


def check_model(args: argparse.Namespace, serve: ServeConfig, started: tuple | None = None
                ) -> None:
    """The LLM's device, dtype, weights and tensor-parallel split (none with --no-llm); last,
    as they need torch (seconds: a bad flag checked before is refused sooner). With `started`,
    the engine core spawned early with `check_flags` (`engine.async_llm.spawn_engine_core`), its
    verdict on the flags that need torch (`engine.flag_checks`), waited for here: this process
    then never imports torch. Raises ValueError naming the bad flag."""
    if args.no_llm:
        return
    config = serve.engine
    if args.model is not None and not Path(args.model).exists():
        raise ValueError(f"model {args.model!r} is not a local path "
                         "(Continuum never downloads weights)")
    if started is not None:
        from engine.async_llm import flags_checked
        error = flags_checked(started)
    else:
        from engine.flag_checks import flag_error
        error = flag_error(config)
    if error is not None:
        raise ValueError(error)
    if config.tensor_parallel_size > 1:
        from engine.device import resolve_device
        from engine.distributed.parallel import check_tensor_parallel
        from engine.loader import resolve_model
        from engine.models.llama import ModelConfig
        check_tensor_parallel(ModelConfig.from_dir(resolve_model(config.model)),
                              config.tensor_parallel_size, resolve_device(config.device))


def engine_config(args: argparse.Namespace):
    """The frozen `EngineConfig` from parsed `serve` flags. Raises ValueError naming a bad flag."""
    tuned = resolve_profile(args.tuning_profile, {k: getattr(args, k) for k in PROFILE_FLAGS})
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
        max_model_len=args.max_model_len, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, num_gpu_blocks_override=args.num_gpu_blocks_override,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        sjf_aging_ms_per_token=args.sjf_aging_ms_per_token,
        max_waiting_requests=args.max_waiting_requests,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
        activation_quantization=args.activation_quantization,
        kv_cache_dtype=args.kv_cache_dtype, **engine_lora_settings(args), **tuned)


def _chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's text, or the value itself when it is a template (vLLM's
    rule). Raises ValueError for a path that does not exist."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{" in value:
        return value
    raise ValueError(f"--chat-template {value}: no such file")
