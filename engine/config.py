"""Engine configuration: one frozen dataclass built once from the CLI (`vllm serve` flag names).

Validated in `__post_init__`; a bad value raises `ValueError` naming the flag, which the CLI
prints as one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.quant import ACTIVATION_METHODS
from engine.quant import METHODS as QUANTIZATION_METHODS
from scheduler.config import check_policy, check_preemption_mode
from scheduler.spec_decode import SpeculativeConfig

GIB = 1 << 30
# `--kv-cache-dtype` values (engine.kv_quant reads them; here so that the flags need no torch)
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


def check_kv_cache_dtype_name(name: str) -> None:
    """Raises ValueError (one line, naming the flag) unless `name` is a `--kv-cache-dtype`."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {name!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLMEngine` needs. Sizes: `kv_cache_memory` and `swap_space` in GiB;
    `max_model_len`, `max_num_batched_tokens`, `block_size` in tokens.

    model: HF checkpoint directory or .gguf file; None = the embedded SmolLM2-135M-Instruct.
    max_model_len: None = the model's `max_position_embeddings`.
    kv_cache_memory: device memory for the KV cache; None = 2 GiB on CPU; on an accelerator
        what is left of `gpu_memory_utilization` of the device's memory after the weights and
        a profiled peak step (`engine.accel.memory`). `num_gpu_blocks_override` wins over both.
    gpu_memory_utilization: fraction (0, 1] of the accelerator's memory this engine may use
        (vLLM's flag; unused on the CPU).
    enforce_eager: no CUDA graphs (vLLM's flag): decode steps run eagerly as every other step.
    preemption_mode: "recompute", "swap" or "auto" (a swap pool of `swap_space` GiB exists
        with swap and auto).
    target_itl_ms: None = off; milliseconds, or "auto" = twice the unloaded decode step,
        measured at start; the step's prefill budget follows it (`scheduler.slo`).
    speculative_config: None = off; a `SpeculativeConfig`, or its JSON text / dict
        (`--speculative-config`, vLLM's keys), parsed here.
    quantization: `--quantization` (`engine.quant.resolve_quantization`): None = gguf for a
        GGUF model on a CPU with the kernels, else none; "gguf", "int8" or "none".
    kv_cache_dtype: `--kv-cache-dtype` (`engine.kv_quant`): "auto" (the activation dtype), or
        an 8-bit cache: "int8" (a scale per token and head), "fp8" / "fp8_e4m3" / "fp8_e5m2"
        (a scale per tensor, 1.0); the CPU kernels and the torch path read it.
    activation_quantization: `--activation-quantization`: "none" (the activations' dtype),
        "int8" (per block of 32, in the quantized products; AVX-512 VNNI or AVX2) or "auto"
        (int8 without bfloat16 matmul units where VNNI exists or the level is AVX2:
        `engine.quant.auto_int8_activations`).
    tensor_parallel_size: ranks the model is split over (`engine.distributed`); each rank holds
        `kv_cache_memory` / `swap_space` of its own KV heads (per-device sizes, as in vLLM).
    enable_lora / lora_modules / max_loras / max_lora_rank / max_cpu_loras: vLLM's LoRA flags
        (`engine.lora`): adapters (name, PEFT directory) served at start, device slots, the
        highest rank, adapters kept in host memory (None = `max_loras`).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: float | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    swap_space: float = 4.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    sjf_aging_ms_per_token: float = 1.0
    max_waiting_requests: int = 1024
    target_itl_ms: float | str | None = None
    speculative_config: SpeculativeConfig | dict | str | None = None
    tensor_parallel_size: int = 1
    quantization: str | None = None
    activation_quantization: str = "auto"
    kv_cache_dtype: str = "auto"
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, (str, dict)):
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.parse(self.speculative_config))
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a positive power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be positive (GiB), got {self.kv_cache_memory}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("--num-gpu-blocks-override must be at least 1, "
                             f"got {self.num_gpu_blocks_override}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.swap_space < 0:
            raise ValueError(f"--swap-space must be non-negative (GiB), got {self.swap_space}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be at least 1, "
                             f"got {self.max_num_batched_tokens}")
        check_preemption_mode(self.preemption_mode)
        if self.target_itl_ms is not None:
            if self.target_itl_ms != "auto" and not (
                    isinstance(self.target_itl_ms, (int, float)) and self.target_itl_ms > 0):
                raise ValueError("--target-itl-ms must be a positive number of milliseconds, "
                                 f"auto or off, got {self.target_itl_ms!r}")
            if not self.enable_chunked_prefill:
                raise ValueError("--target-itl-ms needs chunked prefill (it budgets prefill "
                                 "chunks); drop --no-enable-chunked-prefill")
        check_policy(self.scheduling_policy, self.sjf_aging_ms_per_token)
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be at least 1, "
                             f"got {self.tensor_parallel_size}")
        spec = self.speculative_config
        if self.tensor_parallel_size > 1 and spec is not None and spec.method == "draft_model":
            raise ValueError("--speculative-config: method draft_model is not supported with "
                             "--tensor-parallel-size > 1 (use method ngram)")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                             f"got {self.quantization!r}")
        if self.activation_quantization not in ACTIVATION_METHODS:
            raise ValueError("--activation-quantization must be one of "
                             f"{', '.join(ACTIVATION_METHODS)}, got {self.activation_quantization!r}")
        check_kv_cache_dtype_name(self.kv_cache_dtype)
        self._check_lora()
        if self.max_waiting_requests < 1:
            raise ValueError("--max-waiting-requests must be at least 1, "
                             f"got {self.max_waiting_requests}")

    def _check_lora(self) -> None:
        if isinstance(self.lora_modules, dict):
            object.__setattr__(self, "lora_modules", tuple(self.lora_modules.items()))
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"--max-loras and --max-lora-rank must be at least 1, got "
                             f"{self.max_loras} and {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least "
                             f"--max-loras ({self.max_loras})")
