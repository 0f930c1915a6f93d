"""The flags of `continuum serve`: names and defaults follow `vllm serve`, and tritonserver's
for the v2 layer, with the data-parallel (Ray Serve) group. `add_serve_flags` adds them to a
parser (`continuum`'s `serve` subcommand, api/cli.py); `serve_parser` is a parser of them
alone, for Ray Serve replicas that rebuild a server from the same argv. The checks of their
values are api/serve_config.py's (one `ServeConfig`) and api/ray_serve/config.py's
(`DataParallelConfig`).
"""

from __future__ import annotations

import argparse

from engine.config import KV_CACHE_DTYPES
from engine.profiles import TUNING_PROFILES
from api.lora_flags import add_lora_flags
from api.network import add_network_flags
from engine.quant import ACTIVATION_METHODS
from engine.quant import METHODS as QUANTIZATION_METHODS
from scheduler.config import POLICIES, PREEMPTION_MODES

ROUTERS = ("prefix-aware", "power-of-two", "random")


def _target_itl(value: str) -> float | str:
    """`--target-itl-ms`: a number of milliseconds, `auto` or `off`."""
    if value in ("auto", "off"):
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, auto or off, got {value!r}")


def add_serve_flags(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache dtype: auto = the activation dtype; int8 (a scale per token "
                        "and head) or fp8 (= fp8_e4m3), fp8_e5m2 (a scale per tensor) hold "
                        "about twice the tokens of bfloat16 in the same memory; CPU only "
                        "(default: auto)")
    p.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                   help="weights served quantized by the CPU kernels: gguf (the GGUF file's "
                        "blocks), int8 (per-channel int8 made at load), none (the --dtype "
                        "weights); default: gguf for a .gguf model on the CPU, else none")
    p.add_argument("--activation-quantization", default="auto", choices=ACTIVATION_METHODS,
                   help="int8: quantize the activations of the quantized linears to int8 per "
                        "block of 32 (AVX-512 VNNI and AVX2 hosts; faster, slightly less "
                        "exact: docs/quantization.md); auto: int8 where there are no bfloat16 "
                        "matmul units and VNNI exists or the level is AVX2, unless --dtype "
                        "float32; default: auto")
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
                   help="KV-cache size in GiB (default: 2 on CPU; on a GPU / NPU what "
                        "--gpu-memory-utilization leaves after the weights and a profiled step)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU's / NPU's memory the engine may use: the KV cache "
                        "takes what is left of it after the weights and a profiled peak step; "
                        "unused on the CPU (default: 0.9)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: decode steps run eagerly (default: graphs on CUDA)")
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
    add_lora_flags(p)
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="waiting-queue bound; past it requests get HTTP 503 (default: 1024)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: the "
                        "CONTINUUM_API_KEY environment variable, else none)")
    p.add_argument("--shutdown-timeout", "--exit-timeout-secs", type=float, default=0.0,
                   metavar="SECONDS", dest="shutdown_timeout",
                   help="on SIGTERM / SIGINT, let in-flight requests run this long, then abort "
                        "the rest; a second signal stops at once (default: 0, abort at once)")
    p.add_argument("--api-server-count", "-asc", type=int, default=1, metavar="N",
                   help="API processes (HTTP parsing, tokenization, detokenization, response "
                        "bodies) over one engine core, sharing --port; not with "
                        "--model-repository or --metrics-port (default: 1)")
    p.add_argument("--strict-openai", action="store_true",
                   help="refuse request fields the server does not know with HTTP 400, as "
                        "OpenAI does (default: accept and ignore them with a warning, as vLLM "
                        "does)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a chat request's own chat_template replace the server's (default: "
                        "refused with HTTP 400, as vLLM does)")
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
    p.add_argument("--enable-server-load-tracking", action="store_true",
                   help="count the model-running requests in flight for GET /load "
                        "({\"server_load\": N}; 0 without this flag), as vLLM's flag")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens in chat and completions "
                        "answers (prompt tokens read from the prefix cache; /v1/messages: "
                        "cache_read_input_tokens), as vLLM's flag")
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
    triton.add_argument("--trace-config", action="append", default=[],
                        metavar="[MODE,]SETTING=VALUE",
                        help="tritonserver's tracing of v2 requests, repeatable: level=OFF|"
                             "TIMESTAMPS|TENSORS, rate=N (every N-th request), count=N (-1: no "
                             "end), mode=triton|opentelemetry, triton,file=PATH, "
                             "triton,log-frequency=N, opentelemetry,url=URL, "
                             "opentelemetry,resource=KEY=VALUE (default: level=OFF)")
    triton.add_argument("--no-llm", action="store_true",
                        help="serve only the model repository, no language model")
    add_network_flags(p)
    add_logging_flags(p)
    add_data_parallel_flags(p)


def add_logging_flags(p: argparse.ArgumentParser) -> None:
    """Add tritonserver's logging flags (the server's whole log; `/v2/logging` changes them at
    run time, all but the file)."""
    g = p.add_argument_group("Logging (tritonserver's flags)")
    for level in ("info", "warning", "error"):
        g.add_argument(f"--log-{level}", default="true", metavar="BOOL",
                       help=f"log {level} messages (default: true)")
    g.add_argument("--log-verbose", type=int, default=0, metavar="LEVEL",
                   help="verbose (debug) logging; 1 or more also logs each v2 infer request "
                        "(default: 0, off)")
    g.add_argument("--log-format", default="default", choices=["default", "ISO8601"],
                   help="tritonserver's layouts: default '<level><MMDD> <hh:mm:ss.uuuuuu> "
                        "<pid> <file>:<line>] message', ISO8601 '<YYYY-MM-DDThh:mm:ssZ> <level> "
                        "<pid> <file>:<line>] message'; the message a JSON string unless "
                        "TRITON_SERVER_ESCAPE_LOG_MESSAGES=0 (default: %(default)s)")
    g.add_argument("--log-file", default="", metavar="FILE",
                   help="append the log to FILE instead of the console (default: console)")


def add_data_parallel_flags(p: argparse.ArgumentParser) -> None:
    """Add the "Data parallel (Ray Serve)" flag group to the `serve` parser."""
    g = p.add_argument_group("Data parallel (Ray Serve)")
    g.add_argument("--data-parallel-backend", default="none", choices=["none", "ray"],
                   help="ray: run --num-replicas full servers (engine, OpenAI API, v2 HTTP) as "
                        "Ray Serve replicas behind one ingress on --host/--port (default: none)")
    g.add_argument("--num-replicas", default=None, metavar="N|auto",
                   help="replicas, or auto: Ray Serve autoscales between --min-replicas and "
                        "--max-replicas (default: 1)")
    g.add_argument("--min-replicas", type=int, default=None,
                   help="with --num-replicas auto: fewest replicas (default: 1)")
    g.add_argument("--max-replicas", type=int, default=None,
                   help="with --num-replicas auto: most replicas (default: 4)")
    g.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="with --num-replicas auto: requests in flight per replica that "
                        "autoscaling aims at (default: 16)")
    g.add_argument("--request-router", default="prefix-aware", choices=ROUTERS,
                   help="prefix-aware: requests sharing a prompt prefix go to the replica that "
                        "served it while queue lengths differ by at most "
                        "--router-imbalanced-threshold, else the least loaded; power-of-two: "
                        "Ray Serve's default; random: a random replica (default: "
                        "%(default)s)")
    g.add_argument("--router-imbalanced-threshold", type=float, default=8.0,
                   help="prefix-aware: queue-length difference past which the least loaded "
                        "replica wins over prefix affinity (default: %(default)s)")
    g.add_argument("--replica-num-cpus", type=float, default=1.0,
                   help="Ray CPUs per replica; also its torch threads (OMP_NUM_THREADS, "
                        "rounded up) unless OMP_NUM_THREADS is set (default: %(default)s)")
    g.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                   help="Ray cluster to join (default: start a local one on 127.0.0.1)")


def serve_parser() -> argparse.ArgumentParser:
    """A parser of `continuum serve`'s flags alone (what follows `serve` on the command line),
    for Ray Serve replicas; `continuum` itself adds the same flags to its `serve` subcommand."""
    parser = argparse.ArgumentParser(prog="continuum serve")
    add_serve_flags(parser)
    return parser
