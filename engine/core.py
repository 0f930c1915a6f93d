"""`EngineCore`: the engine's one job — schedule, execute, update — in the process that runs the
model. One `step()` = schedule, execute the model, update the scheduler; the token-level result
goes out as `EngineCoreOutputs`. Text never lives here: detokenization, stop strings and the
`RequestOutput` deltas belong to the front end's `OutputProcessor` (`engine.llm_engine` in one
process, `engine.async_llm` across a pipe), as in vLLM v1's `EngineCore`.

Owns: the scheduler (and through it every `Request` and the KV-cache bookkeeping), the model
runner (and the physical cache, and the speculative proposers), the grammar compiler and its
worker thread, and start-up: resolve device and dtype, find or convert the model, size the KV
cache in blocks, load weights and tokenizer (the grammars and the probe prompt need it).

In: `add_request(request_id, prompt_token_ids, SamplingParams)`, `abort_request(ids)`,
`finish_sequences(ids)` (a stop string the front end found), `abort_all()`.
A request with structured outputs whose grammar is not compiled yet waits in the scheduler
(WAITING_FOR_GRAMMAR: the scheduler asks `_compile_grammar`, which hands the compile to a worker
thread), so one slow compile never stalls the step loop; a grammar that fails to compile
finishes its request with an error output.
Out: `step() -> EngineCoreOutputs` (token ids, finish statuses, logprob ids, prompt logprobs,
the step's `StepStats`). The core reads the scheduler and the runner through their calls and
the runner's `ModelRunnerOutput`; it never writes a `Request`. Not thread-safe: one thread
drives it (`engine.core_proc`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from engine.accel import has_sliding_window
from engine.config import GIB, EngineConfig
from engine.device import check_kv_cache_dtype, resolve_device, resolve_dtype
from engine.distributed.executor import TensorParallelRunner, start_tensor_parallel
from engine.distributed.parallel import TensorParallelError, check_tensor_parallel
from engine.kv_quant import resolve_kv_cache_dtype
from engine.linear import LINEAR_PATH_NAMES
from engine.lora.errors import LoraError
from engine.lora.manager import LoraSpec, LoraUpdate
from engine.loader import resolve_model
from engine.model_runner import ModelRunner
from engine.models.llama import ModelConfig, load_model
from engine.quant import resolve_quantization
from engine.spec_decode.ngram import NgramProposer
from engine.structured.grammar import GrammarCompiler, grammar_text
from engine.tokenizer import eos_token_id, load_tokenizer
from engine.outputs import EngineCoreOutputs, StepStats
from scheduler.config import CacheConfig, SchedulerConfig
from scheduler.output import ModelRunnerOutput, RequestStepOutput, SchedulerOutput
from scheduler.request import (ParamError, Request, RequestStatus, SamplingParams,
                               StructuredOutputs)
from scheduler.scheduler import Scheduler
from scheduler.stats import SchedulerCounters

logger = logging.getLogger("continuum.engine")


class EngineCore:
    """See the module docstring. Construction raises ModelLoadError, DeviceUnavailableError,
    TensorParallelError (the ranks could not start) or ValueError (bad configuration) with a
    one-line message.

    With `tensor_parallel_size` N > 1 this process is rank 0 and starts ranks 1..N-1
    (`engine.distributed`); `on_fatal(message)` is then called from a monitor thread if a rank
    dies (the engine core process exits on it; the next `step` raises TensorParallelError in
    any case). Call `shutdown()` to stop the ranks."""

    def __init__(self, config: EngineConfig,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        self._started = time.perf_counter()
        self.config, self.on_fatal = config, on_fatal
        self.device = resolve_device(config.device)
        self.device.activate()
        self.quant = resolve_quantization(config.quantization, config.model, self.device,
                                          config.activation_quantization, config.dtype)
        self.dtype = resolve_dtype(config.dtype, self.device, self.quant.method != "none")
        check_kv_cache_dtype(config.kv_cache_dtype, self.device)
        self.kv_quant = resolve_kv_cache_dtype(config.kv_cache_dtype)
        self.model_dir = resolve_model(config.model)
        self._tokenizer, self._tokenizer_lock = None, threading.Lock()
        self.model_config = mcfg = ModelConfig.from_dir(self.model_dir)
        self.max_model_len = self._max_model_len(mcfg)
        self.runner = None
        self.lora_spec = LoraSpec(config.max_loras, config.max_lora_rank,
                                  config.max_cpu_loras or config.max_loras,
                                  config.lora_modules) if config.enable_lora else None
        self._tp = self._start_tensor_parallel(mcfg) if config.tensor_parallel_size > 1 else None
        try:
            self._build(config, mcfg)
        except BaseException:
            self.shutdown()
            raise

    @property
    def tokenizer(self):
        """The model's HF tokenizer (`engine.tokenizer.load_tokenizer`), loaded at its first use
        (thread-safe: the grammar thread may be first). A server's engine core starts without
        it: it needs the end-of-sequence id alone (`eos_token_id`), and transformers' import
        and the load are ~1.5 s on a 2-core host."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self.model_dir)
            return self._tokenizer

    def _start_tensor_parallel(self, mcfg: ModelConfig):
        """(group, workers) with ranks 1..N-1 started and joined (`engine.distributed`)."""
        check_tensor_parallel(mcfg, self.config.tensor_parallel_size, self.device)
        self.device.kernels(self.dtype)          # compiled once, before the ranks load it
        return start_tensor_parallel(self.config.tensor_parallel_size, self.device, self.dtype,
                                     str(self.model_dir), self.max_model_len, self._rank_died,
                                     self.quant, self.lora_spec)

    def _rank_died(self, message: str) -> None:
        logger.error("%s; the engine stops", message)
        if self.on_fatal is not None:
            self.on_fatal(message)

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do with one rank)."""
        if self._tp is not None:
            group, workers = self._tp
            workers.shutdown()
            group.destroy()
            self._tp = None

    def _build(self, config: EngineConfig, mcfg: ModelConfig) -> None:
        """Model (rank 0's shard under tensor parallelism), end-of-sequence ids, KV cache
        sizes, scheduler and runner (the tokenizer loads at its first use: `tokenizer`)."""
        group = self._tp[0] if self._tp is not None else None
        self.model = load_model(self.model_dir, self.device, self.dtype, self.max_model_len,
                                tp=group, quant=self.quant)
        eos = eos_token_id(self.model_dir)
        self.eos_token_id = eos if eos is not None else (mcfg.eos_token_ids or (None,))[0]
        self.extra_eos_ids = tuple(t for t in mcfg.eos_token_ids if t != self.eos_token_id)

        self.lora = self._lora_manager(config) if config.enable_lora else None
        draft = self._load_draft_model()
        kv = self.kv_quant
        block_bytes = (self.model.cfg.kv_bytes_per_token(self.dtype, kv) + (
            draft.cfg.kv_bytes_per_token(draft.dtype, kv) if draft is not None else 0)
        ) * config.block_size
        target = config.target_itl_ms
        sched = self._scheduler_config(None if target == "auto" else target)
        step_sizes = dict(max_num_tokens=sched.max_num_batched_tokens + sched.max_num_seqs * (
            sched.num_speculative_tokens + 1), max_num_seqs=sched.max_num_seqs)
        num_gpu_blocks = self._num_gpu_blocks(
            block_bytes, **step_sizes,
            logit_rows=sched.max_num_seqs * (sched.num_speculative_tokens + 1))
        num_cpu_blocks = (int(config.swap_space * GIB // block_bytes)
                          if config.preemption_mode in ("swap", "auto") else 0)
        self.grammars = GrammarCompiler(vocab_size=mcfg.vocab_size,
                                        load_tokenizer=lambda: self.tokenizer)
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.scheduler = Scheduler(
            sched, CacheConfig(config.block_size, num_gpu_blocks, num_cpu_blocks,
                               config.enable_prefix_caching, self._freed_window(mcfg, draft)),
            compile_grammar=self._compile_grammar)
        eos_ids = (self.eos_token_id,) + self.extra_eos_ids
        if self._tp is not None:     # the ranks' runners start with the same cache
            self.runner = TensorParallelRunner(*self._tp, self.model, self.device,
                                               config.block_size, num_gpu_blocks, num_cpu_blocks,
                                               eos_ids, config.seed, self.grammars,
                                               proposer=self._proposer(), kv_quant=kv,
                                               **step_sizes)
        else:
            self.runner = ModelRunner(self.model, self.device, config.block_size,
                                      num_gpu_blocks, num_cpu_blocks, eos_ids, config.seed,
                                      self.grammars, draft, proposer=self._proposer(),
                                      kv_quant=kv, **step_sizes)
        self.runner.lora = self.lora
        if self._tp is None and self.lora is None:      # CUDA graphs of the decode steps
            self.runner.capture_graphs(config.enforce_eager)
        if target == "auto":
            self._target_from_unloaded_decode()
        swap = self.runner.time_swap()
        if swap is not None:
            self.scheduler.observe_swap(*swap)
        self.load_time = time.perf_counter() - self._started
        cache_note = ("" if draft is None else ", with the draft model's") if self._tp is None \
            else f" per rank, tensor parallel over {config.tensor_parallel_size} ranks"
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        logger.info("engine ready in %.1f s: %s on %s (%s), %d KV blocks of %d tokens "
                    "(%s, %.2f GiB%s), max_model_len %d, attention: %s, linear: %s, cpu isa: %s",
                    self.load_time,
                    mcfg.architecture, self.device.kind, str(self.dtype).removeprefix("torch."),
                    num_gpu_blocks, config.block_size, self.kv_cache_dtype,
                    num_gpu_blocks * block_bytes / GIB, cache_note,
                    self.max_model_len,
                    self._attention_description(), self._linear_description(),
                    self._isa_description())

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's dtype as the ready log and `/metrics` name it: `int8`, `fp8_e4m3`,
        `fp8_e5m2`, or the model dtype's name."""
        kv = self.kv_quant
        return kv.name if kv is not None else str(self.dtype).removeprefix("torch.")

    def _lora_manager(self, config: EngineConfig):
        """The LoRA slots on the model (this rank's shard under tensor parallelism) and the
        manager with `--lora-modules` registered. Raises: LoraError (a bad adapter stops the
        start, naming it)."""
        from engine.lora.manager import build_lora
        manager = build_lora(self.model, self.model_config, self.device, self.dtype,
                             self.lora_spec, self._tp[0] if self._tp is not None else None)
        logger.info("LoRA: %d slots of rank <= %d (%.1f MiB%s), adapters: %s",
                    config.max_loras, config.max_lora_rank, manager.slots.nbytes / 2**20,
                    "" if self._tp is None else " per rank", ", ".join(manager.names) or "none")
        return manager

    def _attention_description(self) -> str:
        """The ready log's attention path: `compiled CPU kernels (avx512)`, `triton kernels,
        CUDA graphs for 20 decode batch sizes`, `npu fused operators` or `torch`."""
        runner = self.runner
        if runner.kernels is not None:
            return f"compiled CPU kernels ({runner.kernels.isa})"
        if runner.backend is None:
            return "torch"
        graphs = runner.graphs
        window = self.scheduler.cache_config.sliding_window
        return f"{runner.backend.name} kernels, " + (
            f"CUDA graphs for {len(graphs.buckets)} decode batch sizes" if graphs is not None
            else "eager") + (f", blocks behind the {window}-token window freed" if window else "")

    def _isa_description(self) -> str:
        """The ready log's `cpu isa: ...`: the kernels' level with the matmul extensions in use,
        e.g. `avx512 (vnni, bf16)` (`engine.kernels.isa.isa_label`); `n/a` off the CPU."""
        if self.device.cpu_isa() is None:
            return "n/a"
        from engine.kernels.isa import isa_label
        kernels = self.runner.kernels
        refused = self.device.cpu_isa() == "amx" and kernels is not None and not kernels.amx_rows
        return isa_label() + (", tiles refused" if refused else "")

    def _linear_description(self) -> str:
        """The ready log's linear path: e.g. `gguf Q4_1/Q8_0 kernels (avx512)` quantized."""
        if self.model.quant_types:
            kernels = self.runner.kernels
            if kernels is None:
                return self.quant.describe(self.model.quant_types, self.device.cpu_isa())
            return self.quant.describe(self.model.quant_types, kernels.quant_label,
                                       kernels.q8_label)
        return LINEAR_PATH_NAMES[self.model.linear_path]

    def _proposer(self) -> NgramProposer | None:
        spec = self.config.speculative_config
        if spec is None or spec.method != "ngram":
            return None
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                             spec.prompt_lookup_max)

    def _load_draft_model(self):
        """The draft model of `method: draft_model`, in its own dtype ("auto" = the target's),
        or None. Raises ValueError (one line, naming the key) when it cannot be a draft: not
        found or unreadable, another vocabulary, or shorter positions than max_model_len."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        try:
            draft_dir = resolve_model(spec.model)
            dcfg = ModelConfig.from_dir(draft_dir)
            vocab = load_tokenizer(draft_dir).get_vocab()
        except Exception as e:            # ModelLoadError, or the tokenizer's own errors
            raise ValueError(f"--speculative-config: model {spec.model!r} cannot be loaded: "
                             f"{e}") from None
        target = self.tokenizer.get_vocab()
        if vocab != target or dcfg.vocab_size != self.model_config.vocab_size:
            diff = sorted(set(vocab.items()) ^ set(target.items()))[:1]
            raise ValueError(
                f"--speculative-config: model {spec.model!r} has another vocabulary than the "
                f"target ({len(vocab)} vs {len(target)} tokens, {dcfg.vocab_size} vs "
                f"{self.model_config.vocab_size} logits{', e.g. ' + repr(diff[0]) if diff else ''}"
                "); a draft model must share the target's tokenizer")
        if dcfg.max_position_embeddings < self.max_model_len:
            raise ValueError(f"--speculative-config: model {spec.model!r} handles "
                             f"{dcfg.max_position_embeddings} positions, fewer than max_model_len "
                             f"{self.max_model_len}")
        dtype = self.dtype if spec.dtype == "auto" else resolve_dtype(spec.dtype, self.device)
        return load_model(draft_dir, self.device, dtype, self.max_model_len,
                          quant=resolve_quantization(None, spec.model, self.device))

    def _scheduler_config(self, target_itl_ms: float | None) -> SchedulerConfig:
        config = self.config
        spec = config.speculative_config
        batched = config.max_num_batched_tokens or (
            2048 if config.enable_chunked_prefill else max(2048, self.max_model_len))
        return SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=batched,
            max_model_len=self.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy, sjf_aging_ms_per_token=config.sjf_aging_ms_per_token,
            preemption_mode=config.preemption_mode,
            max_waiting_requests=config.max_waiting_requests, target_itl_ms=target_itl_ms,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            spec_adaptive=spec.adaptive if spec else True,
            spec_method=spec.method if spec else "ngram",
            max_loras=config.max_loras if config.enable_lora else 0)

    def _target_from_unloaded_decode(self, num_tokens: int = 16) -> None:
        """`--target-itl-ms auto`: time one request's decode steps alone (the median step,
        after two warm-up steps), then start a fresh scheduler whose target is twice that."""
        prompt = self.tokenizer.encode("Count from one to twenty: one, two,")
        self.add_request("target-itl-probe", prompt,
                         SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True))
        times = []
        while self.has_unfinished_requests():
            t0 = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t0)
        decode = sorted(times[3:])[len(times[3:]) // 2]       # skip the prefill + 2 warm-ups
        self.scheduler.set_target_itl(round(2000 * decode, 3))
        self.scheduler.counters = SchedulerCounters()          # the probe is not traffic
        logger.info("--target-itl-ms auto: unloaded decode step %.2f ms, target %.2f ms",
                    decode * 1000, self.scheduler.config.target_itl_ms)

    def _max_model_len(self, mcfg: ModelConfig) -> int:
        limit = mcfg.max_position_embeddings
        if mcfg.sliding_window and mcfg.sliding_window < limit \
                and not has_sliding_window(self.device.kind):
            limit = mcfg.sliding_window      # exact where attention has no windows
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"--max-model-len {wanted} exceeds the model's limit of {limit} "
                             "tokens")
        return wanted

    def _freed_window(self, mcfg: ModelConfig, draft) -> int:
        """The sliding window (tokens) whose slid-out blocks the KV cache frees, or 0: only
        where attention applies windows (`has_sliding_window`), every layer has one (a Qwen2
        with full layers still reads every block), and no draft model shares the block tables
        (its layers attend to everything)."""
        windows = mcfg.layer_windows
        if draft is not None or not windows or not all(windows) \
                or not has_sliding_window(self.device.kind):
            return 0
        return max(windows)

    def _num_gpu_blocks(self, block_bytes: int, max_num_tokens: int, max_num_seqs: int,
                        logit_rows: int) -> int:
        """KV blocks: `--num-gpu-blocks-override`, else `--kv-cache-memory`, else 2 GiB on the
        CPU, else (an accelerator) what `--gpu-memory-utilization` leaves after the weights
        and a profiled peak step (`engine.accel.memory`)."""
        cfg = self.config
        if cfg.num_gpu_blocks_override:
            return cfg.num_gpu_blocks_override
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory * GIB
        elif self.device.kind == "cpu":
            budget = 2 * GIB
        else:
            from engine.accel.memory import profiled_kv_budget
            budget = profiled_kv_budget(self.model, self.device, cfg.gpu_memory_utilization,
                                        max_num_tokens, max_num_seqs, cfg.block_size,
                                        logit_rows, tensor_parallel=self._tp is not None)
        return max(1, int(budget // block_bytes))

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a request.

        Raises: ParamError naming the field (a prompt, logit_bias, allowed_token_ids or
        stop_token_ids token id outside the vocabulary), ValueError (empty prompt, duplicate id), RequestTooLongError (→ HTTP 400),
        QueueFullError (→ HTTP 503).
        """
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ParamError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})",
                             "prompt")
        bad = next((t for t in params.logit_bias or {} if not 0 <= t < vocab), None)
        if bad is not None:
            raise ParamError(f"invalid key in logit_bias: {bad}; maximum value is {vocab - 1}",
                             "logit_bias")
        if any(not 0 <= t < vocab for t in params.allowed_token_ids or ()):
            raise ParamError("allowed_token_ids contains out-of-vocab token id!",
                             "allowed_token_ids")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:                                                      # vLLM's words
            raise ParamError(f"token_id(s) {bad} in stop_token_ids contain out-of-vocab token "
                             f"ids. Vocabulary size: {vocab}", "stop_token_ids")
        so = params.structured_outputs
        if so is not None and not self.grammars.cached(so):
            grammar_text(so)             # a malformed spec fails here; compiling comes later
        if self.extra_eos_ids and not params.ignore_eos:
            params = dataclasses.replace(
                params, stop_token_ids=tuple(params.stop_token_ids) + self.extra_eos_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if params.lora_name is not None and (self.lora is None
                                             or params.lora_name not in self.lora.paths):
            raise ParamError(f"LoRA adapter {params.lora_name!r} is not loaded", "model")
        # two salts, or two adapters, never share a cached block
        keys = tuple(k for k in (("cache_salt", params.cache_salt), ("lora", params.lora_name))
                     if k[1] is not None) or None
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_id, arrival,
                      priority, extra_keys=keys)
        self.scheduler.add_request(req)

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` from now on.
        Raises: LoraError (LoRA off, a bad adapter, a name already loaded)."""
        if self.lora is None:
            raise LoraError("LoRA is not enabled: start the server with --enable-lora")
        self.lora.register(name, path)
        if self._tp is not None:               # each rank reads it and keeps its shard
            self._tp[1].send(LoraUpdate("load", name, path))

    def remove_lora(self, name: str) -> None:
        """Stop serving adapter `name` to new requests (those running finish with it).
        Raises: LoraError (LoRA off, an unknown name)."""
        if self.lora is None:
            raise LoraError("LoRA is not enabled: start the server with --enable-lora")
        self.lora.unregister(name)
        if self._tp is not None:
            self._tp[1].send(LoraUpdate("unload", name))

    def _compile_grammar(self, so: StructuredOutputs) -> Future | None:
        """The scheduler's question at admission: None when `so`'s grammar is compiled already,
        else the future of its compile on the grammar thread (its request waits for it)."""
        if self.grammars.cached(so):
            return None
        return self._compile_pool.submit(self.grammars.compile, so)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Finish requests as aborted (any state); their blocks are free when this returns."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def finish_sequences(self, sequence_ids: Iterable[str]) -> None:
        """Finish sequences a stop string ended (the front end found it): the listed sequences
        only, not their sibling choices; unknown or finished ids are ignored."""
        self.scheduler.finish_requests(list(sequence_ids), RequestStatus.FINISHED_STOPPED,
                                       include_forks=False)

    def abort_all(self) -> list[str]:
        """Abort every unfinished request (a server shutting down); their blocks are free when
        this returns. Returns the ids of the requests aborted (parents, not forks)."""
        ids = list(dict.fromkeys(r.parent_id or r.request_id
                                 for r in self.scheduler.requests.values()))
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        return ids

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting, running or swapped."""
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ step
    def step(self) -> EngineCoreOutputs:
        """One iteration: schedule, execute, update. A runner error fails the step's requests
        alone (their outputs carry `error`); TensorParallelError stops the engine."""
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        t1 = time.perf_counter()
        try:
            runner_out = self.runner.execute(sched_out)
        except TensorParallelError:  # the ranks are out of step: the engine must stop
            raise
        except Exception as e:       # the step's requests fail; the engine keeps serving
            return self._fail(sched_out, e)
        t2 = time.perf_counter()
        updates = self.scheduler.update_from_output(sched_out, runner_out)
        t3 = time.perf_counter()
        self._observe(sched_out, runner_out, t3 - t0)
        return EngineCoreOutputs(updates, runner_out.prompt_logprobs,
                                 self._first_scheduled(sched_out),
                                 self._stats(sched_out, t0, t3 - t2 + t1 - t0))

    def _observe(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput,
                 seconds: float) -> None:
        """Feed the step's measured cost (and any swap's and draft's, which the runner's output
        carries) to the scheduler's cost models."""
        num_prefill = num_decodes = 0
        for s in sched_out.scheduled:
            if s.num_drafts:               # a draft row costs what a decode row does
                num_decodes += 1 + s.num_drafts
            elif len(s.token_ids) > 1:
                num_prefill += len(s.token_ids)
            else:
                num_decodes += 1
        if runner_out.swap is not None:
            self.scheduler.observe_swap(*runner_out.swap)
            seconds -= runner_out.swap[1]  # the step-cost model is per token, not per copy
        if runner_out.draft_passes is not None:   # the draft's passes: their own cost model
            self.scheduler.observe_draft(*runner_out.draft_passes)
        seconds -= runner_out.draft_seconds
        self.scheduler.observe_step(num_decodes, num_prefill, seconds)

    def _fail(self, sched_out: SchedulerOutput, error: Exception) -> EngineCoreOutputs:
        """The runner raised `error`: the step's requests fail with it. The step's update still
        runs, with no tokens, so that the grammars that failed before it are reported first."""
        logger.exception("model runner failed")
        parents = self.scheduler.fail_step(sched_out)
        updates = self.scheduler.update_from_output(sched_out, ModelRunnerOutput())
        message = f"{type(error).__name__}: {error}"
        updates += [RequestStepOutput(rid, [], RequestStatus.FINISHED_ERROR, error=message)
                    for rid in parents]
        return EngineCoreOutputs(updates)

    @staticmethod
    def _first_scheduled(sched_out: SchedulerOutput) -> list[tuple[str, float, int]]:
        """(request id, `time.monotonic()`, tokens already computed: prefix-cache hits) of the
        requests (re)started this step: the front end keeps the first as the request's
        `first_scheduled_time` and `num_cached_tokens`."""
        now = time.monotonic()
        return [(s.request_id, now, s.start_position) for s in sched_out.scheduled if s.is_new]

    @staticmethod
    def _stats(sched_out: SchedulerOutput, t0: float, scheduler_time: float) -> StepStats:
        """The step's `StepStats`, without what only the front end knows (generated tokens
        after stop strings, finished requests): `OutputProcessor.process_step` adds it."""
        return StepStats(
            batch_size=len(sched_out.scheduled), num_tokens=sched_out.num_scheduled_tokens,
            num_prefill_tokens=sum(len(s.token_ids) for s in sched_out.scheduled
                                   if len(s.token_ids) > 1 and not s.num_drafts),
            step_time=time.perf_counter() - t0, scheduler_time=scheduler_time)
