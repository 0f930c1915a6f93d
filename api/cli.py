"""The `continuum` command: `serve [MODEL] [flags]` (flag names follow `vllm serve`; the flags
are api/serve_flags.py's, their checks api/serve_config.py's), `run-batch -i IN -o OUT [MODEL]
[flags]` (api/run_batch.py) and `bench serve|compare` (benchmarks/servebench/).

A bad flag value fails at start with one clear line (exit 2); `serve` then runs
`api/launch.py:serve`, alone, as N API processes over one engine core (`--api-server-count`,
api/api_servers.py) or as N Ray Serve replicas (`--data-parallel-backend ray`).
"""

from __future__ import annotations

import argparse
import sys

from api.serve_flags import add_serve_flags


class _OneLineParser(argparse.ArgumentParser):
    """argparse with its errors (an unknown flag, a value not among a flag's choices) as one
    line, `<prog>: error: <what>`, exit 2 — as the checks of api/serve_config.py report — in
    place of the usage text before it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(bench_flags: bool = True) -> argparse.ArgumentParser:
    """The `continuum` argument parser: `serve` and `bench serve|compare`. `bench_flags=False`
    leaves `bench serve`'s own flags out (they import the load generator: ~0.2 s that a
    `serve` start, or its one-line refusal of a bad flag, does not need)."""
    parser = _OneLineParser(prog="continuum", description="Continuum LLM server")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    add_serve_flags(sub.add_parser("serve", help="serve a model over the OpenAI API"))
    run_batch = sub.add_parser("run-batch", help="answer a file of requests in OpenAI's batch "
                                                 "format (vllm run-batch)")
    add_serve_flags(run_batch)
    from api.run_batch import add_run_batch_flags
    add_run_batch_flags(run_batch)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bench_serve = bench.add_parser("serve", help="load-test an OpenAI-compatible server")
    if bench_flags:
        from benchmarks.servebench.serve_bench import add_arguments
        add_arguments(bench_serve)
    bench.add_parser("compare", add_help=False,
                     help="Continuum vs the transformers baseline (see --help)")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `continuum` console script; exits 2 with one line on a bad flag."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "compare"]:
        from benchmarks.servebench.compare import main as compare_main
        compare_main(argv[2:])
        return
    args = build_parser(bench_flags=argv[:1] == ["bench"]).parse_args(argv)
    if args.command == "run-batch":
        from api.run_batch import main as run_batch_main
        run_batch_main(args, argv[1:])
        return
    if args.command == "bench":
        from benchmarks.servebench.serve_bench import main as bench_main
        bench_main(argv[2:])
        return
    from triton_compat.frontend.grpc.core_env import import_grpc
    import_grpc()                        # first, with C-core's I/O on the gRPC loop thread
    from engine.log_config import configure
    configure()                          # Triton's defaults until the flags are read
    from api.ray_serve.config import data_parallel_config
    from api.serve_config import check_model, serve_config
    started = None
    try:
        config = serve_config(args, model_checks=False)
        data_parallel = data_parallel_config(args)
        configure(config.log)
        started = _start_engine_early(config, data_parallel)
        if started is not None:             # this process's imports while the child checks
            _import_server_modules()
        check_model(args, config, started)
    except (ValueError, OSError, KeyboardInterrupt) as e:
        # a bad flag; a --log-file that cannot be opened; Ctrl-C before the server is up (its
        # handlers take over from there): the early child goes too, without a traceback
        if started is not None:
            from engine.async_llm import stop_engine_core
            stop_engine_core(started)
        if isinstance(e, KeyboardInterrupt):
            sys.exit(130)
        print(f"continuum: error: {e}", file=sys.stderr)
        sys.exit(2)
    if data_parallel is not None:        # N replicas of this server behind Ray Serve
        from api.ray_serve.app import serve_ray
        serve_ray(argv[1:], config, data_parallel)
    if config.api_server_count > 1:      # N API processes over one engine core
        from api.api_servers import serve_api_servers
        sys.exit(serve_api_servers(config))
    from api.launch import serve
    serve(config, started)


def _start_engine_early(config, data_parallel):
    """One API process over a one-rank engine: its engine core's process started now
    (`engine.async_llm.spawn_engine_core`), so that the child's imports and model load overlap
    this process's own (the app's modules, the tokenizer), and the child checks the flags that
    need torch (`engine.flag_checks`), which this process then never imports. The port is
    checked first (taken: exit 1, no child left). None where the engine starts elsewhere
    (--no-llm, Ray Serve replicas, several API processes, tensor parallelism, whose ranks the
    core spawns)."""
    if config.no_llm or data_parallel is not None or config.api_server_count > 1 or \
            config.engine.tensor_parallel_size > 1:
        return None
    from api.launch import check_port
    from engine.async_llm import spawn_engine_core
    check_port(config.host, config.port)
    return spawn_engine_core(config.engine, check_flags=True)


def _import_server_modules() -> None:
    """The server's modules and transformers' tokenizer (`api.launch.build_server`,
    `engine.tokenizer`), imported while the early engine core imports torch and checks the
    flags (`api.serve_config.check_model` waits for its verdict next): on 2 cores the two
    processes' imports run side by side."""
    import uvicorn  # noqa: F401

    import api.server  # noqa: F401
    import transformers.tokenization_utils_tokenizers  # noqa: F401


if __name__ == "__main__":
    main()
