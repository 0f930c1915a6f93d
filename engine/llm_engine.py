"""`LLMEngine`: the engine in one process, for offline use, tests and benchmarks — an
`EngineCore` (schedule, execute, update) and the front end's `OutputProcessor` (detokenize,
stop strings, `RequestOutput` deltas), stepped together. vLLM v1's `LLMEngine` is the same pair
(its core behind a client); the server runs the two halves in two processes instead
(`engine.async_llm.ProcessAsyncLLM`).

In: `add_request(request_id, prompt_token_ids, SamplingParams)`, `abort_request(ids)`.
Out: `step() -> list[RequestOutput]` (deltas), and a `StepStats` per step to each stat logger.
The core's attributes (`scheduler`, `runner`, `model`, `tokenizer`, `model_config`, `config`,
...) read through this object. Not thread-safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput, StepStats
from scheduler.request import SamplingParams


class LLMEngine:
    """See the module docstring. Construction raises what `EngineCore` raises
    (ModelLoadError, DeviceUnavailableError, TensorParallelError, ValueError: one line).
    Call `shutdown()` to stop tensor-parallel ranks."""

    def __init__(self, config: EngineConfig,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        self.core = EngineCore(config, on_fatal)
        self.output_processor = OutputProcessor(self.core.tokenizer)
        self.stat_loggers: list[Callable[[StepStats], None]] = []

    def __getattr__(self, name: str):
        """The core's attributes (`scheduler`, `runner`, `model`, ...), read through."""
        if name == "core":                 # not built yet: no recursion
            raise AttributeError(name)
        return getattr(self.core, name)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a request. Raises what `EngineCore.add_request` raises (ParamError,
        ValueError, RequestTooLongError, QueueFullError)."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.core.add_request(request_id, prompt_token_ids, params, arrival, priority)
        self.output_processor.add_request(request_id, list(prompt_token_ids), params, arrival)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Finish requests as aborted (any state); their blocks are free when this returns."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.core.abort_request(ids)
        for rid in ids:
            self.output_processor.remove(rid)

    def abort_all(self) -> list[RequestOutput]:
        """Abort every unfinished request; returns each one's final output, finish_reason
        "abort"."""
        self.core.abort_all()
        return self.output_processor.finish(list(self.output_processor.requests), "abort")

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting, running or swapped."""
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One iteration: the core's step, then its outputs as `RequestOutput` deltas; the
        sequences a stop string ended are finished in the core before this returns."""
        core_out = self.core.step()
        outputs, stopped = self.output_processor.process_step(core_out)
        if stopped:
            self.core.finish_sequences(stopped)
        if core_out.stats is not None:
            for log in self.stat_loggers:
                log(core_out.stats)
        return outputs

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do with one rank)."""
        self.core.shutdown()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 ) -> list[list[list[int]]]:
        """Offline helper: run `prompts` (token ids) to completion; returns, per prompt, the
        generated token ids of each choice. Used by tests and benchmarks."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        results: dict[str, dict[int, list[int]]] = {rid: {} for rid in ids}
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        while self.has_unfinished_requests():
            for out in self.step():
                for c in out.outputs:
                    results[out.request_id].setdefault(c.index, []).extend(c.token_ids)
        return [[results[rid].get(i, []) for i in range(p.n)] for rid, p in zip(ids, plist)]
