"""The engine flags that only torch can check: `--device`, `--dtype`, `--kv-cache-dtype`,
`--quantization` / `--activation-quantization` and `CONTINUUM_CPU_ISA`, checked before a model
loads so that a bad one is one line at start, never a kernel's stack trace.

In: an `EngineConfig`. Out: None, or the one-line reason. `continuum serve` asks it in its
engine core's process, spawned before the server's own imports (`engine.async_llm.
spawn_engine_core(check_flags=True)`: the server then never imports torch, ~2 s of a 2-core
host's start); where the engine starts elsewhere (tensor parallelism, several API processes,
Ray Serve), in the server's process (`api.serve_config.check_model`).
"""

from __future__ import annotations

from engine.config import EngineConfig


def flag_error(config: EngineConfig) -> str | None:
    """The first flag of `config` this host cannot run, as one line (the ValueError's or the
    DeviceUnavailableError's message), or None. Imports torch."""
    from engine.device import DeviceUnavailableError, check_device_dtype, resolve_device

    try:
        check_device_dtype(config.device, config.dtype, config.kv_cache_dtype)
        if config.quantization not in (None, "none") or \
                config.activation_quantization == "int8":
            from engine.quant import resolve_quantization

            resolve_quantization(config.quantization, config.model,
                                 resolve_device(config.device), config.activation_quantization)
    except (ValueError, DeviceUnavailableError) as e:
        return str(e)
    return None
