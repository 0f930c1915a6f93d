"""Scheduler and cache configuration: frozen, validated once at start-up.

User mistakes (from CLI flags) raise `ValueError` with the flag's name.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.manager import cdiv

POLICIES = ("fcfs", "priority", "sjf")
PREEMPTION_MODES = ("recompute", "swap", "auto")


def check_preemption_mode(mode: str) -> None:
    """Raises ValueError (naming the flag) for an unknown preemption mode."""
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"--preemption-mode must be one of {', '.join(PREEMPTION_MODES)}, "
                         f"got {mode!r}")


def check_policy(policy: str, sjf_aging_ms_per_token: float) -> None:
    """Raises ValueError (naming the flag) for an unknown policy or a non-positive aging."""
    if policy not in POLICIES:
        raise ValueError(f"--scheduling-policy must be one of {', '.join(POLICIES)}, "
                         f"got {policy!r}")
    if not sjf_aging_ms_per_token > 0:
        raise ValueError("--sjf-aging-ms-per-token must be positive, "
                         f"got {sjf_aging_ms_per_token}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budgets and policies (names follow `vllm serve`).

    max_num_seqs: most requests in one step's batch (and running at once).
    max_num_batched_tokens: most tokens computed in one step, over all requests.
    max_model_len: most tokens (prompt + output) in one sequence.
    enable_chunked_prefill: split prompts longer than the remaining token budget across steps;
        when off, a prompt is admitted only if it fits the budget whole.
    policy: "fcfs" (arrival order), "priority" (lower value first, FCFS within a level) or
        "sjf" (shortest job first with aging: ordered by arrival time + `sjf_aging_ms_per_token`
        x the request's job, its prompt plus `max_tokens`; see `Scheduler`).
    sjf_aging_ms_per_token: the aging rate of `sjf`, milliseconds per job token.
    preemption_mode: "recompute" (free blocks, recompute later), "swap" (to the CPU pool,
        recompute when that pool is full) or "auto" (per preemption, the cheaper of the two by
        measured cost; see `scheduler.slo`).
    target_itl_ms: None = off; else each step's prefill tokens are budgeted so that a step with
        the current decodes takes about this many milliseconds (`scheduler.slo`). Needs
        chunked prefill.
    max_waiting_requests: bound on the waiting queue; admission past it raises QueueFullError.
    num_lookahead_tokens: extra slots reserved per running request.
    num_speculative_tokens: the most speculative drafts a request verifies per step (0 = no
        speculative decoding); each draft is a token of the step's budget.
    spec_adaptive: choose each request's drafts per step by measured cost
        (`scheduler.spec_decode`); False = verify every proposed draft.
    spec_method: "ngram" (drafts proposed after the step before, `Request.spec_token_ids`) or
        "draft_model" (the runner drafts during the step: every decoding request may verify up
        to `num_speculative_tokens`).
    max_loras: most distinct LoRA adapters among the running requests (0 = LoRA off); a
        request of another adapter waits until one of them has no running request.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    sjf_aging_ms_per_token: float = 1.0
    preemption_mode: str = "recompute"
    max_waiting_requests: int = 1024
    num_lookahead_tokens: int = 0
    target_itl_ms: float | None = None
    num_speculative_tokens: int = 0
    spec_adaptive: bool = True
    spec_method: str = "ngram"
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "max_waiting_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, "
                                 f"got {getattr(self, name)}")
        if self.num_lookahead_tokens < 0 or self.num_speculative_tokens < 0:
            raise ValueError("num_lookahead_tokens and num_speculative_tokens must be "
                             "non-negative")
        if self.spec_method not in ("ngram", "draft_model"):
            raise ValueError(f"spec_method must be ngram or draft_model, got {self.spec_method!r}")
        check_policy(self.policy, self.sjf_aging_ms_per_token)
        check_preemption_mode(self.preemption_mode)
        if self.target_itl_ms is not None:
            if not self.target_itl_ms > 0:
                raise ValueError(f"--target-itl-ms must be positive, got {self.target_itl_ms}")
            if not self.enable_chunked_prefill:
                raise ValueError("--target-itl-ms needs chunked prefill (it budgets prefill "
                                 "chunks); drop --no-enable-chunked-prefill")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
                f"--max-model-len ({self.max_model_len}) when chunked prefill is disabled")


@dataclass(frozen=True)
class CacheConfig:
    """KV-cache geometry in blocks.

    block_size: tokens per block. num_gpu_blocks: device blocks. num_cpu_blocks: swap-pool
    blocks (0 = no swap pool). enable_prefix_caching: share full blocks across requests.
    sliding_window: tokens; > 0 when every layer attends to a window of that size and the
    attention applies it: blocks that slid out of it are freed (`kvcache.manager`); 0 = keep
    every block of a sequence.
    """

    block_size: int = 16
    num_gpu_blocks: int = 1024
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = True
    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a positive power of two, got {self.block_size}")
        if self.num_gpu_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {self.num_gpu_blocks}")
        if self.num_cpu_blocks < 0:
            raise ValueError(f"--swap-space must be non-negative, got {self.num_cpu_blocks} blocks")


def check_cache_fits(config: SchedulerConfig, cache_config: CacheConfig) -> None:
    """Raises ValueError if one sequence of `max_model_len` tokens (plus lookahead) could not
    fit in the KV cache: it could then never finish. With a sliding window W a sequence holds
    at most the blocks of W - 1 tokens before a step's first query plus the step's tokens
    (`max_num_batched_tokens` at most), one more for alignment, and the null block."""
    bs, blocks = cache_config.block_size, cache_config.num_gpu_blocks
    lookahead = config.num_lookahead_tokens
    need = cdiv(config.max_model_len + lookahead, bs)
    window = cache_config.sliding_window
    if window:
        step = min(config.max_num_batched_tokens, config.max_model_len)
        need = min(need, cdiv(window - 2 + step + lookahead, bs) + 1) + 1
    if blocks < need:
        raise ValueError(
            f"max_model_len ({config.max_model_len}) is larger than the KV cache can hold "
            f"({blocks * bs} tokens = {blocks} blocks x {bs}; one sequence needs {need} blocks"
            f"{f' with its {window}-token window' if window else ''}); decrease "
            "--max-model-len or give the cache more memory")
