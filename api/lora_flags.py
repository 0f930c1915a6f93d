"""vLLM's LoRA flags on `continuum serve`, and their `EngineConfig` settings.

Owns: `--enable-lora`, `--lora-modules`, `--max-loras`, `--max-lora-rank`, `--max-cpu-loras`
(argparse definitions and their parsing). Kept apart from `api.lora`'s routes so that reading
the flags imports neither FastAPI nor torch: a bad flag is reported before any of them load.

In: the `serve` parser, parsed flags. Out: `EngineConfig` keyword arguments. Errors: a bad
`--lora-modules` value is a ValueError naming it (the server does not start).
"""

from __future__ import annotations

import argparse
import json


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags on the `serve` parser."""
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters on the base model (the request's model field "
                        "names one)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="adapters served from the start: NAME=PATH (a PEFT directory) or "
                        "vLLM's JSON '{\"name\": ..., \"path\": ...}'")
    p.add_argument("--max-loras", type=int, default=1,
                   help="adapters in one batch: device slots (default: %(default)s)")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="highest adapter rank served (default: %(default)s)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory (default: --max-loras)")


def parse_lora_modules(values: list[str]) -> tuple[tuple[str, str], ...]:
    """(name, path) pairs of `--lora-modules` values. Raises ValueError naming a bad one."""
    out = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {value}: JSON needs \"name\" and \"path\"") \
                    from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value}: expected NAME=PATH")
        if name in dict(out):
            raise ValueError(f"--lora-modules: {name!r} is given twice")
        out.append((name, path))
    return tuple(out)


def engine_lora_settings(args: argparse.Namespace) -> dict:
    """`EngineConfig` keyword arguments of the LoRA flags."""
    return dict(enable_lora=args.enable_lora, lora_modules=parse_lora_modules(args.lora_modules),
                max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                max_cpu_loras=args.max_cpu_loras)
