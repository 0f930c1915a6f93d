"""`continuum serve [MODEL] [flags]` — flag names follow `vllm serve`.

Builds the frozen `EngineConfig` once; a bad value fails at start with one clear line (exit 2).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from engine.profiles import PROFILE_FLAGS, TUNING_PROFILES, resolve_profile
from scheduler.config import POLICIES, PREEMPTION_MODES


def _target_itl(value: str) -> float | str:
    """`--target-itl-ms`: a number of milliseconds, `auto` or `off`."""
    if value in ("auto", "off"):
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, auto or off, got {value!r}")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF checkpoint directory or .gguf file (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the model's file or folder name)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="max tokens per sequence, prompt + output (default: the model's limit)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV-cache dtype; auto = float32 on CPU (default: auto)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or npu (default: auto)")
    p.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling (default: 0)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="max sequences per engine step (default: 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="max tokens per engine step (default: 2048 with chunked prefill)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="share KV blocks of equal prefixes (default: on)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True, help="split long prompts across steps (default: on)")
    p.add_argument("--swap-space", type=float, default=None,
                   help="CPU swap pool in GiB, used with --preemption-mode swap or auto "
                        "(default: 4)")
    p.add_argument("--preemption-mode", default=None, choices=PREEMPTION_MODES,
                   help="what preemption does with a request's KV blocks: recompute, swap, or "
                        "auto = the cheaper of the two by measured copy and prefill cost, "
                        "recompute when the swap pool is full (default: recompute)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV-cache size in blocks; overrides --kv-cache-memory")
    p.add_argument("--kv-cache-memory", type=float, default=None,
                   help="KV-cache size in GiB (default: 2 on CPU, 90%% of free device memory)")
    p.add_argument("--scheduling-policy", default=None, choices=POLICIES,
                   help="fcfs; priority: lower value first; sjf: shortest job (prompt + "
                        "max_tokens) first, with aging (default: fcfs)")
    p.add_argument("--sjf-aging-ms-per-token", type=float, default=1.0,
                   help="sjf aging: a waiting request gains one job token of rank per this "
                        "many ms; a request is never passed over by one arriving more than "
                        "its job x this later (default: 1.0)")
    p.add_argument("--target-itl-ms", type=_target_itl, default=None, metavar="MS|auto|off",
                   help="inter-token latency target: each step's prefill tokens are budgeted "
                        "from measured step costs so that a step with the running decodes "
                        "stays within MS (once a prefill has waited 256 steps, at least 32 prefill "
                        "tokens a step still run); auto = "
                        "twice the unloaded decode step, measured at start (default: off)")
    p.add_argument("--tuning-profile", default=None, choices=list(TUNING_PROFILES),
                   help="defaults for the scheduling flags, which explicit flags override. "
                        "high_throughput: fcfs, --max-num-seqs 256, --max-num-batched-tokens "
                        "8192, --preemption-mode auto. low_latency: sjf, --max-num-seqs 64, "
                        "--max-num-batched-tokens 2048, --target-itl-ms auto, "
                        "--preemption-mode auto. memory_constrained: --max-num-seqs 32, "
                        "--max-num-batched-tokens 512, --preemption-mode auto, --swap-space 1 "
                        "(default: none)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N ranks (processes; one device each on CUDA / "
                        "NPU) with torch.distributed: heads, KV heads and the MLP width must "
                        "divide by N; --kv-cache-memory and --swap-space are per rank "
                        "(default: 1)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, vLLM's keys: method (ngram or draft_model), "
                        "num_speculative_tokens (k, default 4), prompt_lookup_min / "
                        "prompt_lookup_max (ngram, default 2 / 5), model and dtype "
                        "(draft_model: a GGUF or HF directory with the target's vocabulary; "
                        "dtype defaults to the target's), adaptive (default true: k per "
                        "request and step by measured cost), e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
                        "(default: off)")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="waiting-queue bound; past it requests get HTTP 503 (default: 1024)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: the "
                        "CONTINUUM_API_KEY environment variable, else none)")
    p.add_argument("--shutdown-timeout", "--exit-timeout-secs", type=float, default=0.0,
                   metavar="SECONDS", dest="shutdown_timeout",
                   help="on SIGTERM / SIGINT, let in-flight requests run this long, then abort "
                        "the rest; a second signal stops at once (default: 0, abort at once)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: info)")
    p.add_argument("--http-max-input-size", type=int, default=64 << 20, metavar="BYTES",
                   help="largest request body on /v1 and /v2 (v2 infer: compressed or "
                        "inflated); larger ones get 413 (default: %(default)s)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template (a file, or the template itself) used instead of "
                        "the model's own, e.g. examples/tool_chat_template_smollm2.jinja")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto"); needs '
                        "--tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                   help="how tool calls are found in the model's text (hermes: <tool_call> "
                        "JSON blocks)")
    triton = p.add_argument_group("Triton / KServe v2 (the LLM is always a v2 model too)")
    triton.add_argument("--model-repository", default=None, metavar="DIR",
                        help="also serve the Triton model repository DIR on /v2 (default: "
                             "none: /v2 serves the LLM alone)")
    triton.add_argument("--model-control-mode", default="none", choices=["none", "explicit"],
                        help="none: load every model at start; explicit: load --load-model "
                             "names at start, then on /v2/repository requests (default: none)")
    triton.add_argument("--load-model", action="append", default=[], metavar="NAME",
                        help="explicit mode: model to load at start, repeatable; '*' = all")
    triton.add_argument("--http-restricted-api", action="append", default=[],
                        metavar="API[,API...]:KEY=VALUE",
                        help="Triton's endpoint restriction, repeatable: requests to these v2 "
                             "API categories (health, metadata, inference, shared-memory, "
                             "model-config, model-repository, statistics, trace, logging) need "
                             "header KEY: VALUE, else 403")
    triton.add_argument("--grpc-port", type=int, default=None, metavar="PORT",
                        help="KServe v2 gRPC (Triton's GRPCInferenceService) port; 0 turns "
                             "gRPC off (default: 8001 with --model-repository, else off)")
    triton.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                        help="also serve /metrics on PORT, as tritonserver does on 8002 "
                             "(default: 0, only on --port)")
    triton.add_argument("--grpc-address", default=None, metavar="HOST",
                        help="gRPC bind address (default: --host)")
    triton.add_argument("--grpc-restricted-protocol", action="append", default=[],
                        metavar="API[,API...]:KEY=VALUE",
                        help="Triton's gRPC restriction, repeatable: RPCs of these API "
                             "categories need metadata 'triton-grpc-protocol-KEY: VALUE', "
                             "else UNAVAILABLE")
    triton.add_argument("--allow-client-shm", nargs="?", const="true", default="false",
                        metavar="BOOL",
                        help="let clients register system / CUDA shared-memory regions and "
                             "use them for inputs and outputs (Triton's flag; default: false)")
    triton.add_argument("--no-llm", action="store_true",
                        help="serve only the model repository, no language model")
    from api.ray_serve.config import add_data_parallel_flags
    add_data_parallel_flags(p)


def build_parser() -> argparse.ArgumentParser:
    """The `continuum` argument parser: `serve` and `bench serve|compare`."""
    parser = argparse.ArgumentParser(prog="continuum", description="Continuum LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_engine_flags(sub.add_parser("serve", help="serve a model over the OpenAI API"))
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from benchmarks.servebench.serve_bench import add_arguments
    add_arguments(bench.add_parser("serve", help="load-test an OpenAI-compatible server"))
    bench.add_parser("compare", add_help=False,
                     help="Continuum vs the transformers baseline (see --help)")
    return parser


def engine_config(args: argparse.Namespace):
    """The frozen `EngineConfig` from parsed `serve` flags. Raises ValueError naming a bad flag."""
    from engine.config import EngineConfig

    tuned = resolve_profile(args.tuning_profile, {k: getattr(args, k) for k in PROFILE_FLAGS})
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
        max_model_len=args.max_model_len, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        sjf_aging_ms_per_token=args.sjf_aging_ms_per_token,
        max_waiting_requests=args.max_waiting_requests,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size, **tuned)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `continuum` console script; exits 2 with one line on a bad flag."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "compare"]:
        from benchmarks.servebench.compare import main as compare_main
        compare_main(argv[2:])
        return
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from benchmarks.servebench.serve_bench import main as bench_main
        bench_main(argv[2:])
        return
    from triton_compat.grpc.core_env import import_grpc
    import_grpc()                        # first, with C-core's I/O on the gRPC loop thread
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from api.ray_serve.config import data_parallel_config
    from api.serve_config import serve_config
    try:
        config = serve_config(args)
        data_parallel = data_parallel_config(args)
    except ValueError as e:
        print(f"continuum: error: {e}", file=sys.stderr)
        sys.exit(2)
    if data_parallel is not None:        # N replicas of this server behind Ray Serve
        from api.ray_serve.app import serve_ray
        serve_ray(argv[1:], config, data_parallel)
    serve(config)


def _bool_flag(flag: str, value: str) -> bool:
    """Triton's boolean flag values (true / false / 1 / 0 / on / off). Raises ValueError."""
    lowered = value.lower()
    if lowered in ("true", "1", "on", "yes"):
        return True
    if lowered in ("false", "0", "off", "no"):
        return False
    raise ValueError(f"{flag}: expected true or false, got {value!r}")


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


def build_server(config):
    """(uvicorn-based `Server`, `ServerState`) of `continuum serve` from its `ServeConfig`
    (api/serve_config.py), for config.host:config.port (the server binds there unless given
    sockets), with KServe v2 gRPC on config.grpc_host:grpc_port (port 0: none). The v2 layer
    always serves the LLM as a model, and the model repository when there is one."""
    import uvicorn

    from api.http_protocol import HttpToolsProtocol
    from api.lifecycle import Lifecycle, Server
    from api.server import ServerState, build_app

    lifecycle = Lifecycle(config.shutdown_timeout)
    state = ServerState(config, lifecycle=lifecycle)
    uv_config = uvicorn.Config(build_app(state), host=config.host, port=config.port,
                               log_level=config.uvicorn_log_level, timeout_graceful_shutdown=5,
                               http=HttpToolsProtocol,    # a response's writes as one send
                               # the access log logs at info: below that level it would only
                               # cost its formatting on every request
                               access_log=config.uvicorn_log_level in ("trace", "debug",
                                                                       "info"))
    return Server(uv_config, lifecycle), state


def serve(config) -> None:
    """Run the server of `config` (a `ServeConfig`) until it stops; exits with the lifecycle's
    status (0 after a drain, 1 if the engine died or failed to start)."""
    server, state = build_server(config)
    server.run()
    if state.llm is not None:            # after a forced stop the lifespan did not run
        state.llm.shutdown()
    if state.stuck:                      # a model's thread never returns: exit without it
        logging.shutdown()
        os._exit(server.lifecycle.exit_code)
    sys.exit(server.lifecycle.exit_code)


if __name__ == "__main__":
    main()
