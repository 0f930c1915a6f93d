"""Tuning profiles (`--tuning-profile`): named sets of defaults for the scheduling flags.

In: a profile name and the flags the user gave explicitly. Out: the `EngineConfig` keyword
arguments, explicit flags winning over the profile and the profile over `EngineConfig`'s own
defaults. Each profile is documented here, in `--help` and in the README.

- high_throughput: large steps and a full batch; no latency target. fcfs, 256 sequences,
  8192 tokens per step, `--preemption-mode auto`.
- low_latency: short jobs first and steps kept near the inter-token-latency target. sjf,
  64 sequences, 2048 tokens per step, `--target-itl-ms auto` (twice the unloaded decode step,
  measured at start), `--preemption-mode auto`.
- memory_constrained: small steps and few sequences, so activations and the KV working set
  stay small; preemption picks swap or recompute by cost, and the swap pool is kept to 1 GiB
  (on a CPU device the pool is host memory too). 32 sequences, 512 tokens per step,
  `--preemption-mode auto`, `--swap-space 1`. Pair it with `--kv-cache-memory`.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

TUNING_PROFILES: dict[str, dict[str, Any]] = {
    "high_throughput": {"scheduling_policy": "fcfs", "max_num_seqs": 256,
                        "max_num_batched_tokens": 8192, "preemption_mode": "auto",
                        "target_itl_ms": None},
    "low_latency": {"scheduling_policy": "sjf", "max_num_seqs": 64,
                    "max_num_batched_tokens": 2048, "preemption_mode": "auto",
                    "target_itl_ms": "auto"},
    "memory_constrained": {"max_num_seqs": 32, "max_num_batched_tokens": 512,
                           "preemption_mode": "auto", "swap_space": 1.0},
}
# The flags a profile may set: `None` on the command line means "not given".
PROFILE_FLAGS = ("scheduling_policy", "max_num_seqs", "max_num_batched_tokens",
                 "preemption_mode", "target_itl_ms", "swap_space")


def resolve_profile(profile: str | None, explicit: dict[str, Any]) -> dict[str, Any]:
    """`EngineConfig` keyword arguments for PROFILE_FLAGS: `explicit` values that are not None,
    else the profile's, else `EngineConfig`'s defaults.

    Raises ValueError for an unknown profile name.
    """
    from engine.config import EngineConfig

    if profile is not None and profile not in TUNING_PROFILES:
        raise ValueError(f"--tuning-profile must be one of {', '.join(TUNING_PROFILES)}, "
                         f"got {profile!r}")
    chosen = TUNING_PROFILES.get(profile, {})
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    out = {}
    for name in PROFILE_FLAGS:
        value = explicit.get(name)
        out[name] = value if value is not None else chosen.get(name, defaults[name])
    if out["target_itl_ms"] == "off":          # `--target-itl-ms off` undoes a profile's target
        out["target_itl_ms"] = None
    return out
