"""Iteration-level (continuous-batching) scheduler for the LLM engine.

Owns: the waiting queue, the running list, the swapped list, and the KV-cache manager. Its
interface is four calls (vLLM v1's): `add_request`, `schedule`, `update_from_output`,
`finish_requests`.

One rule, no phases (vLLM v1 engine core): each scheduled request's `num_computed_tokens`
catches up with its token count within the step's budgets (`max_num_seqs`,
`max_num_batched_tokens`). A prompt longer than the remaining budget is split across steps
(chunked prefill); prefix-cache hits start a request past its cached prefix; a decode is the
case where one token is missing. Order within a step: running requests, then swapped ones being
resumed, then waiting ones — and nothing is resumed or admitted in a step that preempted.

Running, swapped and waiting requests are kept in policy order: `fcfs` by (arrival, admission
sequence), `priority` by (priority, arrival, sequence), `sjf` by (arrival + aging x job,
sequence), job = prompt tokens + `max_tokens` (else up to `max_model_len`). That key is linear
aging (a job's rank improves by one token per `sjf_aging_ms_per_token` it waits) in a form that
never changes while a request waits, so the heap stays valid. Bound: a request X is never
passed over by a request that arrived more than aging x job(X) after X. The job is known at
arrival and is the same when a preempted request is queued again (it recomputes its output as
prompt); prefix-cache hits are not subtracted. When the KV pool has no room for a
running request, the *last* request of the running list (lowest priority, then latest arrival)
is preempted: `swap` moves its blocks to the CPU pool (or falls back to recompute when that is
full); `recompute` frees them and re-queues the request with its generated tokens kept, to be
recomputed as prompt; `auto` picks, per preemption, the cheaper of the two by measured cost
(`scheduler.slo.PreemptionCost`). Because victims come from the back and scheduling goes front
to back, a victim was never scheduled in the same step.

Target ITL (`target_itl_ms`): prefill chunks (steps of more than one token of a request) share
a per-step prefill budget chosen from the measured step costs (`scheduler.slo`), so that a step
carrying the current decodes stays within the target; decodes are never held back by it. The
engine feeds the measurements in (`observe_step`, `observe_swap`); the scheduler stays clock-free.

n > 1: the request is computed once up to its last prompt token, then forked into n sequences
that share its blocks by reference count; each computes the last prompt token itself (so
each samples from the same logits), copying the shared partial block first (copy-on-write).

Speculative decoding (`scheduler.spec_decode`): a running request in decode carries the drafts
the engine proposed (`Request.spec_token_ids`); `plan_drafts` chooses how many it verifies this
step, and it is scheduled for 1 + d tokens, d capped by the step's remaining token budget. Draft
slots are lookahead: `num_computed_tokens` advances past the drafts only as far as the runner
accepted them (`update_from_output`), and the whole blocks that held only rejected drafts go
back to the pool in the same call.

Structured outputs: a waiting request with `grammar_pending` (its grammar still compiling off
the step loop, vLLM's WAITING_FOR_FSM) is passed over, keeping its place, until the engine
clears the flag.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections.abc import Iterable
from dataclasses import dataclass

from kvcache.manager import KVCacheManager
from scheduler.config import CacheConfig, SchedulerConfig
from scheduler.output import ModelRunnerOutput, RequestStepOutput, ScheduledRequest, SchedulerOutput
from scheduler.request import QueueFullError, Request, RequestStatus, RequestTooLongError
from scheduler.slo import AdaptivePrefillBudget, LatencyHistory, PreemptionCost
from scheduler.spec_decode import AcceptanceWindow, DraftCost, SpecDecodeCounters, plan_drafts

RUNNING = RequestStatus.RUNNING


@dataclass
class SchedulerCounters:
    """Cumulative counters since start (for Prometheus counters). Tokens and blocks are counts."""

    prefix_cache_queries: int = 0   # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0      # of those, tokens found cached
    num_preemptions: int = 0
    num_preemptions_swap: int = 0       # of those, by the mode actually used
    num_preemptions_recompute: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0


class Scheduler:
    """Decides, every engine step, which requests compute how many tokens.

    Raises (at construction): ValueError if one sequence of `max_model_len` tokens could not fit
    in the KV cache — it could then never finish.
    """

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig) -> None:
        capacity = cache_config.num_gpu_blocks * cache_config.block_size
        if capacity < config.max_model_len + config.num_lookahead_tokens:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) is larger than the KV cache can hold "
                f"({capacity} tokens = {cache_config.num_gpu_blocks} blocks x "
                f"{cache_config.block_size}); decrease --max-model-len or give the cache more memory")
        self.config = config
        self.cache_config = cache_config
        self.kv = KVCacheManager(cache_config.num_gpu_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching, cache_config.num_cpu_blocks)
        self.requests: dict[str, Request] = {}     # every unfinished request, by id
        self.waiting: list[tuple] = []             # heap of (key, request)
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
        if config.policy == "priority":
            self._key = lambda r: (r.priority, r.arrival_time, r.seq)
        elif config.policy == "sjf":
            aging_s, limit = config.sjf_aging_ms_per_token / 1000, config.max_model_len
            self._key = lambda r: (r.arrival_time + aging_s * (
                r.num_prompt_tokens + (r.sampling_params.max_tokens or
                                       limit - r.num_prompt_tokens)), r.seq)
        else:
            self._key = lambda r: (r.arrival_time, r.seq)

    # ------------------------------------------------------------------ admission
    def add_request(self, request: Request) -> None:
        """Queue a new request.

        Raises: RequestTooLongError if the prompt (plus `max_tokens`) exceeds `max_model_len`;
        QueueFullError if `max_waiting_requests` are already waiting; ValueError for a duplicate
        id or `n` above `max_num_seqs`.
        """
        cfg = self.config
        num_prompt = request.num_prompt_tokens
        max_tokens = request.sampling_params.max_tokens
        if num_prompt >= cfg.max_model_len:
            raise RequestTooLongError(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                f"your prompt has {num_prompt} tokens, leaving no room for output.")
        if max_tokens is not None and num_prompt + max_tokens > cfg.max_model_len:
            raise RequestTooLongError(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, you "
                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                f"{max_tokens} in the completion).", "max_tokens")
        if request.sampling_params.n > cfg.max_num_seqs:
            raise ValueError(f"n ({request.sampling_params.n}) exceeds max_num_seqs "
                             f"({cfg.max_num_seqs})")
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if len(self.waiting) >= cfg.max_waiting_requests:
            raise QueueFullError(f"the waiting queue is full ({cfg.max_waiting_requests} "
                                 "requests); retry later")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        request.arrival_step = self._num_steps
        heapq.heappush(self.waiting, (self._key(request), request))

    # ------------------------------------------------------------------ schedule
    def _adaptive_prefill_budget(self) -> int:
        """This step's prefill tokens under --target-itl-ms (`scheduler.slo`): from the running
        decodes, keeping the floor once a request with prompt tokens still to compute (waiting,
        or running with a partial prefill) was added `patience` or more steps ago. A step with
        no prompt tokens to compute keeps the last budget: refitting the step costs (~0.3 ms)
        would buy nothing there."""
        oldest = self._num_steps - self.prefill_budgeter.patience
        num_decodes, starved, prefilling = 0, False, False
        for r in self.running:
            pending = len(r.all_token_ids) - 1 - r.num_computed_tokens
            if pending == 0:
                num_decodes += self._seats(r)
            elif pending > 0:
                prefilling = True
                starved = starved or r.arrival_step <= oldest
        if not (prefilling or self.waiting or self.swapped):
            return self.prefill_budgeter.last_budget
        starved = starved or any(r.arrival_step <= oldest for _, r in self.waiting)
        return self.prefill_budgeter.prefill_budget(num_decodes, starved)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch; advances `num_computed_tokens` of every scheduled request."""
        cfg = self.config
        out = SchedulerOutput(finished_request_ids=self._finished_ids,
                              num_lookahead_tokens=cfg.num_lookahead_tokens)
        self._finished_ids = []
        budget = cfg.max_num_batched_tokens
        self._prefill_left = budget
        self._num_steps += 1
        if self.prefill_budgeter is not None:
            self._prefill_left = self._adaptive_prefill_budget()
        if cfg.num_speculative_tokens:
            self._drafts = plan_drafts(self.running, cfg, self.latency, self.spec_counters,
                                      self.draft_cost, self.spec_pooled)
        budget = self._schedule_running(out, budget)
        if not out.preempted_request_ids and (self.swapped or self.waiting):
            seats = self._seats_taken()
            budget, seats = self._resume_swapped(out, budget, seats)
            if not self.swapped:
                self._admit_waiting(out, budget, seats)
        out.blocks_to_copy = self.kv.take_blocks_to_copy()
        return out

    @staticmethod
    def _seats(req: Request) -> int:
        """Sequences the request will occupy: n for a parent not yet forked, else 1."""
        return 1 if req.forked else req.sampling_params.n

    def _seats_taken(self) -> int:
        return sum(map(self._seats, self.running))

    def _target(self, req: Request) -> int:
        """Tokens the request must have computed before it can sample (fork point if unforked)."""
        return req.num_tokens if req.forked else req.num_prompt_tokens - 1

    def _num_new(self, req: Request, budget: int) -> int:
        """Tokens to compute this step within `budget` and the prefill budget; -1 if it must
        wait (no chunking, or no prefill budget left)."""
        num_new = self._target(req) - req.num_computed_tokens
        limit = min(budget, self._prefill_left) if num_new > 1 else budget
        if num_new > limit:
            return limit if limit > 0 and self.config.enable_chunked_prefill else -1
        return num_new

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        kv, running, lookahead = self.kv, self.running, self.config.num_lookahead_tokens
        chunked, drafts_of = self.config.enable_chunked_prefill, self._drafts
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if not req.forked and req.num_computed_tokens == req.num_prompt_tokens - 1:
                self._fork(req)
            # = self._num_new(req, budget), inlined: this loop runs for every request, every step.
            num_new = (len(req.all_token_ids) if req.forked else req.num_prompt_tokens - 1) \
                - req.num_computed_tokens
            limit = min(budget, self._prefill_left) if num_new > 1 else budget
            if num_new > limit:
                num_new = limit if chunked else -1
            if num_new <= 0:
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
            self._emit(out, req, num_new, start, is_new, drafts)
            budget -= num_new + drafts
            i += 1
        return budget

    def _resume_swapped(self, out: SchedulerOutput, budget: int, seats: int) -> tuple[int, int]:
        lookahead = self.config.num_lookahead_tokens
        while self.swapped and budget > 0:
            req = self.swapped[0]
            if seats + self._seats(req) > self.config.max_num_seqs:
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
            seats += self._seats(req)
            self._start_running(out, req, num_new)
            budget -= num_new
        return budget, seats

    def _admit_waiting(self, out: SchedulerOutput, budget: int, seats: int) -> None:
        kv, cfg = self.kv, self.config
        deferred = []               # requests whose grammar is still compiling keep their place
        while self.waiting and budget > 0:
            req = self.waiting[0][1]
            if req.grammar_pending:
                deferred.append(heapq.heappop(self.waiting))
                continue
            if seats + self._seats(req) > cfg.max_num_seqs:
                break
            hit_blocks, num_hit = kv.get_computed_blocks(req.request_id, req.all_token_ids,
                                                         req.extra_keys)
            req.num_computed_tokens = num_hit
            num_new = self._num_new(req, budget)
            start = None
            if num_new >= 0:
                start = kv.allocate_slots(req.request_id, req.all_token_ids, 0, num_new,
                                          cfg.num_lookahead_tokens, hit_blocks, req.extra_keys)
            if start is None:
                req.num_computed_tokens = 0
                break
            heapq.heappop(self.waiting)
            self.counters.prefix_cache_queries += req.num_tokens
            self.counters.prefix_cache_hits += num_hit
            seats += self._seats(req)
            self._start_running(out, req, num_new)
            budget -= num_new
        for entry in deferred:
            heapq.heappush(self.waiting, entry)

    def _start_running(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        req.status = RUNNING
        bisect.insort(self.running, req, key=self._key)
        if num_new:
            self._emit(out, req, num_new, 0, True)
        else:                       # at its fork point: forked and scheduled next step
            self._unsent.add(req.request_id)

    def _emit(self, out: SchedulerOutput, req: Request, num_new: int, table_start: int,
              is_new: bool, drafts: int = 0) -> None:
        """Schedule `num_new` tokens of `req` (+ `drafts` speculative drafts after them; their
        slots are lookahead: `num_computed_tokens` counts only verified tokens)."""
        start = req.num_computed_tokens
        end = start + num_new
        tokens = req.all_token_ids
        out.scheduled.append(ScheduledRequest(
            req.request_id, tokens[start:end] + req.spec_token_ids[:drafts] if drafts
            else tokens[start:end], start, table_start,
            self.kv.block_ids(req.request_id, table_start), is_new, end == len(tokens),
            req.sampling_params, len(tokens) - req.num_prompt_tokens, req.index,
            req.prompt_token_ids if is_new else None,
            req.output_token_ids if is_new else None, drafts))
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
        heapq.heappush(self.waiting, (self._key(req), req))

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
        """Append sampled tokens, apply stop conditions, free finished requests' blocks.

        Tokens for requests that were aborted or preempted since `schedule` are dropped.
        Returns one `RequestStepOutput` per request that received tokens.
        """
        outputs = []
        logprobs = runner_output.logprobs or {}
        requests = self.requests
        drafted = ({s.request_id: s.num_drafts for s in scheduler_output.scheduled
                    if s.num_drafts} if scheduler_output.num_draft_tokens else None)
        for rid, tokens in runner_output.sampled_token_ids.items():
            req = requests.get(rid)
            if req is None or req.status != RUNNING:
                continue
            num_drafts = drafted.get(rid, 0) if drafted else 0
            if num_drafts:
                self._record_verification(req, num_drafts, len(tokens) - 1)
            if len(tokens) == 1:
                req.all_token_ids.append(tokens[0])
                status = self._check_stop(req, tokens[0])
            else:                   # accepted speculative tokens already have their K/V
                req.num_computed_tokens += len(tokens) - 1
                for n, token in enumerate(tokens, 1):
                    req.all_token_ids.append(token)
                    status = self._check_stop(req, token)
                    if status is not RUNNING:
                        tokens = tokens[:n]
                        break
            if status is not RUNNING:
                self._finish(req, status)
            elif num_drafts:            # rejected drafts' whole blocks go back to the pool
                self.kv.trim(rid, len(req.all_token_ids))
            outputs.append(RequestStepOutput(rid, tokens, status, req.stop_reason,
                                             logprobs.get(rid), req.parent_id, req.index))
        return outputs

    def _record_verification(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        if req.spec_window is None:
            req.spec_window = AcceptanceWindow()
        req.spec_window.record(num_drafts, num_accepted)
        self.spec_counters.record(num_drafts, num_accepted)
        self.spec_pooled.record(num_drafts, num_accepted)

    def _check_stop(self, req: Request, token: int) -> RequestStatus:
        """The one place stop conditions live (stop strings are the detokenizer's, engine side).

        EOS (unless `ignore_eos`) and `stop_token_ids` count only once `min_tokens` are out;
        `max_tokens` and `max_model_len` cap the length.
        """
        params = req.sampling_params
        num_out = len(req.all_token_ids) - req.num_prompt_tokens
        if num_out >= params.min_tokens:
            if token == req.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if (params.max_tokens is not None and num_out >= params.max_tokens) \
                or len(req.all_token_ids) >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return RUNNING

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

    def _finish(self, req: Request, status: RequestStatus) -> None:
        prior = req.status
        req.status = status
        if prior == RUNNING:
            self.running.remove(req)
        elif prior == RequestStatus.SWAPPED:
            self.swapped.remove(req)
        else:
            self.waiting = [e for e in self.waiting if e[1] is not req]
            heapq.heapify(self.waiting)
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
        """Requests in the waiting queue (new or preempted by recompute)."""
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
