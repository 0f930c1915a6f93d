"""Iteration-level (continuous-batching) scheduler for the LLM engine.

Owns: every unfinished `Request` (the only code that writes one), the waiting queue
(`scheduler.waiting`, with the grammar compiles some requests wait for), the running and
swapped lists, the KV-cache manager, and the measured costs its rules read. Its interface is
four calls (vLLM v1's): `add_request`, `schedule`, `update_from_output`, `finish_requests`;
`snapshot` is what the metrics read.

In: `Request`s; each step's `ModelRunnerOutput` (sampled tokens, and the drafts proposed for the
next step); measured step, swap and draft costs (`observe_*`: the engine feeds them, the
scheduler stays clock-free). Out: a `SchedulerOutput` per step, and a `RequestStepOutput` per
request that got tokens in it or failed before it ran.

One rule, no phases (vLLM v1 engine core): each scheduled request's `num_computed_tokens`
catches up with its token count within the step's budgets (`max_num_seqs`,
`max_num_batched_tokens`); `_num_new` computes it for running, swapped and waiting requests
alike. A prompt longer than the remaining budget is split across steps (chunked prefill);
prefix-cache hits start a request past its cached prefix; a decode is the case where one token
is missing. Order within a step: running requests, then swapped ones being resumed, then waiting
ones — and nothing is resumed or admitted in a step that preempted.

Running, swapped and waiting requests are kept in policy order (`scheduler.policy`). When the
KV pool has no room for a running request, the *last* request of the running list (lowest
priority, then latest arrival) is preempted: `swap` moves its blocks to the CPU pool (or falls
back to recompute when that is full); `recompute` frees them and re-queues the request with its
generated tokens kept, to be recomputed as prompt; `auto` picks, per preemption, the cheaper of
the two by measured cost (`scheduler.slo.PreemptionCost`). Because victims come from the back
and scheduling goes front to back, a victim was never scheduled in the same step.

Target ITL (`target_itl_ms`): prefill chunks (steps of more than one token of a request) share
a per-step prefill budget chosen from the measured step costs (`scheduler.slo`), so that a step
carrying the current decodes stays within the target; decodes are never held back by it.

n > 1: the request is computed once up to its last prompt token, then forked into n sequences
that share its blocks by reference count; each computes the last prompt token itself (so
each samples from the same logits), copying the shared partial block first (copy-on-write).

Speculative decoding (`scheduler.spec_decode`): `update_from_output` keeps the runner's drafts
on the request (`Request.spec_token_ids`); `plan_drafts` chooses how many a request in decode
verifies next step: 1 + d tokens, d within the remaining token budget. Draft slots are
lookahead: `num_computed_tokens` advances past the drafts only as far as the runner accepted
them, and the whole blocks that held only rejected drafts go back to the pool in the same call.

Structured outputs: a request whose grammar the injected `compile_grammar` is still compiling
waits as WAITING_FOR_GRAMMAR (others pass it); `schedule` lets it in once compiled, or finishes
it as FINISHED_ERROR with the compile's message. A step that schedules nothing while grammars
compile waits up to `GRAMMAR_WAIT_S` for one, so an idle engine loop does not spin.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from kvcache.manager import KVCacheManager
from scheduler import stats
from scheduler.config import CacheConfig, SchedulerConfig, check_cache_fits
from scheduler.output import ModelRunnerOutput, RequestStepOutput, ScheduledRequest, SchedulerOutput
from scheduler.policy import policy_key
from scheduler.request import (QueueFullError, Request, RequestStatus, StructuredOutputs,
                               check_admission, check_stop)
from scheduler.slo import AdaptivePrefillBudget, LatencyHistory, PreemptionCost
from scheduler.spec_decode import (AcceptanceWindow, DraftCost, SpecDecodeCounters, plan_drafts,
                                   record_verification)
from scheduler.stats import SchedulerCounters
from scheduler.waiting import WaitingQueue

RUNNING = RequestStatus.RUNNING
WAITING_FOR_GRAMMAR = RequestStatus.WAITING_FOR_GRAMMAR
GRAMMAR_WAIT_S = 0.05          # the longest an empty step waits for a compiling grammar


class Scheduler:
    """Decides, every engine step, which requests compute how many tokens.

    `compile_grammar(structured_outputs)`, when given, is asked at admission about a request
    with structured outputs: None if its grammar is ready, else the future of its compile (the
    request waits for it; see the module docstring).

    Raises (at construction): ValueError if one sequence of `max_model_len` tokens could not fit
    in the KV cache (`check_cache_fits`) — it could then never finish.
    """

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig,
                 compile_grammar: Callable[[StructuredOutputs], Future | None] | None = None
                 ) -> None:
        check_cache_fits(config, cache_config)
        self.config = config
        self.cache_config = cache_config
        self.kv = KVCacheManager(cache_config.num_gpu_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching, cache_config.num_cpu_blocks,
                                 cache_config.sliding_window)
        self.requests: dict[str, Request] = {}     # every unfinished request, by id
        self._key = policy_key(config)
        self.waiting = WaitingQueue(self._key)     # new, preempted, waiting for a grammar
        self.running: list[Request] = []           # policy order
        self.swapped: list[Request] = []           # policy order
        self.counters = SchedulerCounters()
        self._finished_ids: list[str] = []         # finished since the last schedule()
        self._unsent: set[str] = set()             # running but unknown to the runner (forks)
        self.latency = LatencyHistory()            # measured step costs (fed by the engine)
        self.preemption_cost = PreemptionCost(self.latency)
        self.prefill_budgeter = (AdaptivePrefillBudget(config.target_itl_ms / 1000,
                                                       config.max_num_batched_tokens,
                                                       history=self.latency)
                                 if config.target_itl_ms is not None else None)
        self._prefill_left = 0                     # this step's prefill tokens still allowed
        self._num_steps = 0                        # schedule() calls so far
        self.spec_counters = SpecDecodeCounters()
        self.draft_cost = DraftCost()              # a draft model's drafting passes (measured)
        self.spec_pooled = AcceptanceWindow.pooled()   # every request's recent acceptance
        self._drafts: dict[str, int] = {}          # this step's speculative drafts per request
        self.compile_grammar = compile_grammar
        self._failed: list[tuple[str, str]] = []   # (id, why): grammars failed since the update

    # ------------------------------------------------------------------ admission
    def add_request(self, request: Request) -> None:
        """Queue a new request.

        Raises: RequestTooLongError if the prompt (plus `max_tokens`) exceeds `max_model_len`;
        QueueFullError if `max_waiting_requests` are already waiting; ValueError for a duplicate
        id or `n` above `max_num_seqs`. Only once admitted is its grammar's compile asked for.
        """
        cfg = self.config
        check_admission(request, cfg.max_model_len, cfg.max_num_seqs)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if len(self.waiting) >= cfg.max_waiting_requests:
            raise QueueFullError(f"the waiting queue is full ({cfg.max_waiting_requests} "
                                 "requests); retry later")
        so = request.sampling_params.structured_outputs
        grammar = (self.compile_grammar(so) if so is not None and self.compile_grammar
                   else None)
        self.requests[request.request_id] = request
        request.arrival_step = self._num_steps
        if grammar is None:
            request.status = RequestStatus.WAITING
            self.waiting.push(request)
        else:
            request.status = WAITING_FOR_GRAMMAR
            self.waiting.park(request, grammar)

    def _release_grammars(self) -> None:
        """Requests whose grammar compiled become WAITING (in the queue, in policy order); those
        whose grammar failed finish as FINISHED_ERROR, their message kept for the update."""
        for req, error in self.waiting.compiled():
            if error is None:
                req.status = RequestStatus.WAITING
            else:
                self._finish(req, RequestStatus.FINISHED_ERROR)
                self._failed.append((req.request_id, str(error)))

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch; advances `num_computed_tokens` of every scheduled request.

        First, requests whose grammar is done compiling leave WAITING_FOR_GRAMMAR; a step that
        schedules nothing while grammars compile waits up to `GRAMMAR_WAIT_S` for one.
        """
        if self.waiting.parked:
            self._release_grammars()
        cfg = self.config
        out = SchedulerOutput(finished_request_ids=self._finished_ids,
                              num_lookahead_tokens=cfg.num_lookahead_tokens)
        self._finished_ids = []
        budget = cfg.max_num_batched_tokens
        self._prefill_left = budget
        self._num_steps += 1
        if self.prefill_budgeter is not None:
            self._prefill_left = self.prefill_budgeter.for_step(
                self.running, self.waiting, self.swapped, self._num_steps)
        if cfg.num_speculative_tokens:
            self._drafts = plan_drafts(self.running, cfg, self.latency, self.spec_counters,
                                      self.draft_cost, self.spec_pooled)
        budget = self._schedule_running(out, budget)
        if not out.preempted_request_ids and (self.swapped or self.waiting):
            num_seqs = sum(r.max_num_running_seqs for r in self.running)
            budget, num_seqs = self._resume_swapped(out, budget, num_seqs)
            if not self.swapped:
                self._admit_waiting(out, budget, num_seqs)
        out.blocks_to_copy = self.kv.take_blocks_to_copy()
        if not out.scheduled:                  # only compiles pending: do not spin
            self.waiting.wait_for_grammar(GRAMMAR_WAIT_S)
        return out

    def _num_new(self, req: Request, budget: int) -> int:
        """The one new-token rule, for running, swapped and waiting requests alike: the tokens
        `req` computes this step to catch up with its token count (an unforked n > 1 request:
        with its fork point, all but its last prompt token), within `budget` and, for more than
        one token, the step's prefill budget. 0: nothing to compute (at its fork point); -1: it
        must wait (it does not fit and chunking is off, or no budget is left)."""
        num_new = (len(req.all_token_ids) if req.forked else req.num_prompt_tokens - 1) \
            - req.num_computed_tokens
        limit = min(budget, self._prefill_left) if num_new > 1 else budget
        if num_new > limit:
            return limit if limit > 0 and self.config.enable_chunked_prefill else -1
        return num_new

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        kv, running, lookahead = self.kv, self.running, self.config.num_lookahead_tokens
        drafts_of = self._drafts
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if not req.forked and req.num_computed_tokens == req.num_prompt_tokens - 1:
                self._fork(req)
            num_new = self._num_new(req, budget)
            if num_new <= 0:        # nothing to compute, or it waits: the others may still run
                i += 1
                continue
            drafts = 0              # speculative drafts ride on a decode, within the budget
            if num_new == 1 and drafts_of and req.request_id in drafts_of:
                drafts = min(drafts_of[req.request_id], budget - 1)
            while True:
                start = kv.allocate_slots(req.request_id, req.all_token_ids,
                                          req.num_computed_tokens, num_new, lookahead + drafts,
                                          extra_keys=req.extra_keys)
                if start is not None:
                    break
                victim = running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            if start is None:
                break
            is_new = req.request_id in self._unsent
            if is_new:
                self._unsent.discard(req.request_id)
                start = 0
            self._schedule_tokens(out, req, num_new, start, is_new, drafts)
            budget -= num_new + drafts
            i += 1
        return budget

    def _resume_swapped(self, out: SchedulerOutput, budget: int, num_seqs: int) -> tuple[int, int]:
        lookahead = self.config.num_lookahead_tokens
        while self.swapped and budget > 0:
            req = self.swapped[0]
            if (num_seqs + req.max_num_running_seqs > self.config.max_num_seqs
                    or self._lora_full(req)):
                break
            num_new = self._num_new(req, budget)
            if num_new < 0:
                break
            mapping = self.kv.swap_in(req.request_id, req.all_token_ids, req.num_computed_tokens,
                                      num_new, lookahead, req.extra_keys)
            if mapping is None:
                break
            del self.swapped[0]
            out.blocks_to_swap_in.extend(mapping)
            self.counters.swap_in_blocks += len(mapping)
            num_seqs += req.max_num_running_seqs
            self._start_running(out, req, num_new)
            budget -= num_new
        return budget, num_seqs

    def _admit_waiting(self, out: SchedulerOutput, budget: int, num_seqs: int) -> None:
        kv, cfg = self.kv, self.config
        while budget > 0 and (req := self.waiting.first()) is not None:
            if num_seqs + req.max_num_running_seqs > cfg.max_num_seqs or self._lora_full(req):
                break
            if req.sampling_params.prompt_logprobs is None:
                hit_blocks, num_hit = kv.get_computed_blocks(req.request_id, req.all_token_ids,
                                                             req.extra_keys)
            else:     # every prompt position's logits are needed: no cache read (as vLLM)
                hit_blocks, num_hit = [], 0
            req.num_computed_tokens = num_hit
            num_new = self._num_new(req, budget)
            start = None
            if num_new >= 0:
                start = kv.allocate_slots(req.request_id, req.all_token_ids, 0, num_new,
                                          cfg.num_lookahead_tokens, hit_blocks, req.extra_keys)
            if start is None:
                req.num_computed_tokens = 0
                break
            self.waiting.pop()
            self.counters.prefix_cache_queries += req.num_tokens
            self.counters.prefix_cache_hits += num_hit
            num_seqs += req.max_num_running_seqs
            self._start_running(out, req, num_new)
            budget -= num_new

    def _lora_full(self, req: Request) -> bool:
        """Whether `req` must wait because its LoRA adapter would be one more than
        `max_loras` among the running requests (in arrival order: it waits at the head)."""
        lora = req.sampling_params.lora_name
        if lora is None or not self.config.max_loras:
            return False
        active = {r.sampling_params.lora_name for r in self.running}
        active.discard(None)
        return lora not in active and len(active) >= self.config.max_loras

    def _start_running(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        req.status = RUNNING
        bisect.insort(self.running, req, key=self._key)
        if num_new:
            self._schedule_tokens(out, req, num_new, 0, True)
        else:                       # at its fork point: forked and scheduled next step
            self._unsent.add(req.request_id)

    def _schedule_tokens(self, out: SchedulerOutput, req: Request, num_new: int,
                         table_start: int, is_new: bool, drafts: int = 0) -> None:
        """Schedule `num_new` tokens of `req` (+ `drafts` speculative drafts after them; their
        slots are lookahead: `num_computed_tokens` counts only verified tokens)."""
        start = req.num_computed_tokens
        end = start + num_new
        tokens = req.all_token_ids
        out.scheduled.append(ScheduledRequest(
            request_id=req.request_id,
            token_ids=(tokens[start:end] + req.spec_token_ids[:drafts] if drafts
                       else tokens[start:end]),
            start_position=start, block_table_start=table_start,
            new_block_ids=self.kv.block_ids(req.request_id, table_start), is_new=is_new,
            sample=end == len(tokens), sampling_params=req.sampling_params,
            output_index=len(tokens) - req.num_prompt_tokens, choice_index=req.index,
            prompt_token_ids=req.prompt_token_ids if is_new else None,
            output_token_ids=req.output_token_ids if is_new else None, num_drafts=drafts))
        out.num_scheduled_tokens += num_new + drafts
        out.num_draft_tokens += drafts
        if num_new > 1:
            self._prefill_left -= num_new
        req.num_computed_tokens = end

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Take a running request off the device (it was not scheduled in this step)."""
        rid = req.request_id
        req.num_preemptions += 1
        self.counters.num_preemptions += 1
        out.preempted_request_ids.append(rid)
        self._unsent.discard(rid)
        mode = self.config.preemption_mode
        if mode == "swap" or (mode == "auto" and self.preemption_cost.prefer_swap(
                len(self.kv.block_ids(rid)), req.num_computed_tokens)):
            mapping = self.kv.swap_out(rid)
            if mapping is not None:
                out.blocks_to_swap_out.extend(mapping)
                self.counters.swap_out_blocks += len(mapping)
                self.counters.num_preemptions_swap += 1
                req.status = RequestStatus.SWAPPED
                bisect.insort(self.swapped, req, key=self._key)
                return
        self.counters.num_preemptions_recompute += 1
        self.kv.free(rid, keep_hashes=True)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.push(req)

    def _fork(self, parent: Request) -> None:
        """Split an n > 1 request into its n sequences (parent = choice 0)."""
        parent.forked = True
        for index in range(1, parent.sampling_params.n):
            child = parent.fork(index)
            self.kv.fork(parent.request_id, child.request_id, parent.num_computed_tokens)
            self.requests[child.request_id] = child
            self._unsent.add(child.request_id)
            bisect.insort(self.running, child, key=self._key)

    # ------------------------------------------------------------------ update
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[RequestStepOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests' blocks, and
        keep the drafts proposed for each running request's next step.

        Tokens and drafts for requests that were aborted or preempted since `schedule` are
        dropped. Returns a `RequestStepOutput` per request whose grammar failed to compile since
        the last call (`error` set), then one per request that received tokens.
        """
        outputs = [RequestStepOutput(request_id=rid, new_token_ids=[],
                                     status=RequestStatus.FINISHED_ERROR, error=why)
                   for rid, why in self._failed]
        self._failed = []
        logprobs = runner_output.logprobs or {}
        proposed = runner_output.draft_token_ids or {}
        requests, max_len = self.requests, self.config.max_model_len
        drafted = ({s.request_id: s.num_drafts for s in scheduler_output.scheduled
                    if s.num_drafts} if scheduler_output.num_draft_tokens else None)
        for rid, tokens in runner_output.sampled_token_ids.items():
            req = requests.get(rid)
            if req is None or req.status != RUNNING:
                continue
            num_drafts = drafted.get(rid, 0) if drafted else 0
            if num_drafts:
                record_verification(req, num_drafts, len(tokens) - 1, self.spec_counters,
                                    self.spec_pooled)
            if len(tokens) == 1:
                req.all_token_ids.append(tokens[0])
                status = check_stop(req, tokens[0], max_len)
            else:                   # accepted speculative tokens already have their K/V
                req.num_computed_tokens += len(tokens) - 1
                for n, token in enumerate(tokens, 1):
                    req.all_token_ids.append(token)
                    status = check_stop(req, token, max_len)
                    if status is not RUNNING:
                        tokens = tokens[:n]
                        break
            if status is not RUNNING:
                self._finish(req, status)
            else:
                if num_drafts:          # rejected drafts' whole blocks go back to the pool
                    self.kv.trim(rid, len(req.all_token_ids))
                if rid in proposed:
                    req.spec_token_ids = proposed[rid]
            # Positional on purpose: by keyword this costs ~60 us a step at 256 decodes.
            outputs.append(RequestStepOutput(rid, tokens, status, req.stop_reason,
                                             logprobs.get(rid), req.parent_id, req.index))
        return outputs

    # ------------------------------------------------------------------ finish
    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus,
                        include_forks: bool = True) -> list[str]:
        """Finish requests in any state (waiting, mid-prefill, running, swapped) with a final
        `status`, and free everything they hold in this call. With `include_forks`, the forked
        choices of a listed id are finished too (an abort); without, only the listed sequences
        (a stop string ending one choice). Unknown or already finished ids are ignored.

        Returns: the ids actually finished.
        Raises: ValueError if `status` is not a finished status.
        """
        if not status.is_finished:
            raise ValueError(f"{status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        ids = set(request_ids)
        targets = [r for r in self.requests.values()
                   if r.request_id in ids or (include_forks and r.parent_id in ids)]
        for req in targets:
            self._finish(req, status)
        return [r.request_id for r in targets]

    def fail_step(self, scheduler_output: SchedulerOutput) -> list[str]:
        """The runner failed `scheduler_output`'s step: finish every request scheduled in it,
        with all the choices of its parent, as FINISHED_ERROR, and forget the prefix cache
        (blocks cached this step were never written). Returns the finished (parent) ids."""
        requests = self.requests
        parents = [requests[s.request_id].parent_id or s.request_id
                   for s in scheduler_output.scheduled if s.request_id in requests]
        self.finish_requests(parents, RequestStatus.FINISHED_ERROR)
        self.kv.reset_prefix_cache()
        return parents

    def _finish(self, req: Request, status: RequestStatus) -> None:
        prior = req.status
        req.status = status
        if prior == RUNNING:
            self.running.remove(req)
        elif prior == RequestStatus.SWAPPED:
            self.swapped.remove(req)
        else:
            self.waiting.remove(req)
        rid = req.request_id
        if self.kv.holds_blocks(rid):
            self.kv.free(rid)
        else:
            self.kv.forget(rid)
        self._unsent.discard(rid)
        del self.requests[rid]
        self._finished_ids.append(rid)

    # ------------------------------------------------------------------ measurements
    def observe_step(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        """The engine's measured wall time of a step with D decodes and P prefill tokens."""
        self.latency.observe(num_decodes, num_prefill_tokens, seconds)

    def observe_swap(self, num_blocks: int, seconds: float) -> None:
        """The engine's measured time to copy `num_blocks` blocks to or from the swap pool."""
        self.preemption_cost.observe_swap(num_blocks, seconds)

    def observe_draft(self, rows: int, seconds: float) -> None:
        """The runner's measured drafting passes of a draft model: `rows` rows in `seconds`."""
        self.draft_cost.observe(rows, seconds)

    def set_target_itl(self, target_itl_ms: float) -> None:
        """Turn the adaptive prefill budget on (or move its target), keeping the measurements
        so far. Raises ValueError as `SchedulerConfig` does."""
        self.config = dataclasses.replace(self.config, target_itl_ms=target_itl_ms)
        self.prefill_budgeter = AdaptivePrefillBudget(
            target_itl_ms / 1000, self.config.max_num_batched_tokens, history=self.latency)

    @property
    def prefill_budget(self) -> int:
        """Prefill tokens allowed in the last step (the fixed token budget without a target)."""
        if self.prefill_budgeter is None:
            return self.config.max_num_batched_tokens
        return self.prefill_budgeter.last_budget

    # ------------------------------------------------------------------ introspection
    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue (new, preempted by recompute, or waiting for their
        grammar)."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding device KV blocks and being scheduled."""
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        """Requests whose KV blocks are in the CPU swap pool."""
        return len(self.swapped)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting, running or swapped."""
        return bool(self.requests)

    def snapshot(self, step_cost: bool = True) -> dict:
        """What the metrics read, as plain data (it crosses the engine's pipe): requests
        running, waiting (grammar compiles included) and swapped; the fractions of device and
        CPU KV blocks in use; the prefill budget; the cumulative `counters`; the speculative-
        decoding counters (None without speculation); with `step_cost`, the fitted step-cost
        coefficients (a least-squares fit, ~70 us, unless a rule fitted this window already)."""
        kv = self.kv
        return stats.snapshot(
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_swapped=len(self.swapped), kv_cache_usage=kv.usage(),
            cpu_kv_cache_usage=kv.cpu_pool.usage() if kv.cpu_pool is not None else 0.0,
            prefill_budget=self.prefill_budget, counters=self.counters,
            spec_counters=self.spec_counters if self.config.num_speculative_tokens else None,
            step_cost=self.latency.coefficients() if step_cost else None)
