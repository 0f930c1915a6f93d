"""A model runner over an integer KV cache, for testing the scheduler without torch.

Each slot of the fake cache holds `(position, token_id)` — what real K/V would encode. The fake
runner executes a `SchedulerOutput` exactly as the real one must (swap out, swap in,
copy-on-write, then write every scheduled token through its slot mapping, then "attend"), keeps
its own per-request block tables from the diffs, and when a request samples it reads the whole
context back through its block table. That context must equal the request's true tokens, and the
next token is a deterministic function of the context read back — so a bookkeeping error either
trips an assertion or changes the output.

With a sliding window (`CacheConfig.sliding_window` W) a query at position p reads positions
p - W + 1 .. p only, as a windowed model's attention does: the runner checks every scheduled
request's window back through its table (the blocks before it may have been freed and their
entries pointed at the null block, which nothing may write), and the "model" sees the true
tokens there (`next_token` reads only the last six, so W >= 6 changes no output).

With `draft_rng` it proposes drafts, as the engine's n-gram proposer does: for each request that
sampled, in the step's `ModelRunnerOutput.draft_token_ids` (the scheduler keeps them).

With `cost=StepCost(...)` it also reports a synthetic measured cost of each step (and of each
swap) to the scheduler, as the engine reports real timings, so the adaptive prefill budget and
`--preemption-mode auto` can be driven without a clock.
"""

from __future__ import annotations

from typing import NamedTuple

from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.scheduler import Scheduler


class StepCost(NamedTuple):
    """Synthetic costs in seconds: a step costs base + per_decode x D + per_token x P."""

    base: float = 0.01
    per_decode: float = 0.001
    per_token: float = 0.0005
    per_block: float = 0.0001          # one block copied to or from the swap pool

    def step(self, num_decodes: int, num_prefill: int) -> float:
        return self.base + self.per_decode * num_decodes + self.per_token * num_prefill

VOCAB = 97


def next_token(context: list[int], choice_index: int) -> int:
    """Deterministic 'model': depends on the last tokens, the length and the choice index."""
    h = len(context) * 7919 + choice_index * 104729
    for t in context[-6:]:
        h = (h * 31 + t) % 1_000_003
    return h % VOCAB


class FakeRunner:
    """Runs `SchedulerOutput`s against an integer cache; see the module docstring."""

    def __init__(self, scheduler: Scheduler, cost: StepCost | None = None,
                 draft_rng=None) -> None:
        cache = scheduler.cache_config
        self.scheduler = scheduler
        self.cost = cost
        self.draft_rng = draft_rng        # random.Random: propose drafts, some of them wrong
        self.block_size = cache.block_size
        self.gpu = [[None] * cache.block_size for _ in range(cache.num_gpu_blocks)]
        self.cpu = [[None] * cache.block_size for _ in range(cache.num_cpu_blocks)]
        self.tables: dict[str, list[int]] = {}
        self.steps = 0
        self.window = cache.sliding_window
        null = scheduler.kv.null_block
        self.null_id = null.block_id if null is not None else None

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.steps += 1
        for rid in out.finished_request_ids + out.preempted_request_ids:
            self.tables.pop(rid, None)
        for g, c in out.blocks_to_swap_out:
            self.cpu[c] = list(self.gpu[g])
        for c, g in out.blocks_to_swap_in:
            self.gpu[g] = list(self.cpu[c])
        for src, dst in out.blocks_to_copy:
            self.gpu[dst] = list(self.gpu[src])
        bs = self.block_size
        # Write every scheduled token's K/V first (the runner contract), then read.
        for s in out.scheduled:
            if s.is_new:
                assert s.block_table_start == 0, "a new request must carry its whole table"
                self.tables[s.request_id] = list(s.new_block_ids)
            else:
                assert s.request_id in self.tables, f"{s.request_id} unknown to the runner"
                table = self.tables[s.request_id]
                del table[s.block_table_start:]
                table.extend(s.new_block_ids)
            table = self.tables[s.request_id]
            assert table == self.scheduler.kv.block_ids(s.request_id), \
                f"{s.request_id}: the runner's block table differs from the manager's"
            for i, tok in enumerate(s.token_ids):
                pos = s.start_position + i
                assert table[pos // bs] != self.null_id, \
                    f"{s.request_id}: position {pos} written into the null block"
                self.gpu[table[pos // bs]][pos % bs] = (pos, tok)
        sampled: dict[str, list[int]] = {}
        proposed: dict[str, list[int]] = {}
        for s in out.scheduled:
            end = s.start_position + len(s.token_ids)
            seen = max(0, s.start_position - self.window + 1) if self.window else 0
            truth = self.scheduler.requests[s.request_id].all_token_ids
            context = list(truth[:seen])         # before the first query's window: not read
            table = self.tables[s.request_id]
            for pos in range(seen, end):
                entry = self.gpu[table[pos // bs]][pos % bs]
                assert entry is not None and entry[0] == pos, \
                    f"{s.request_id}: slot for position {pos} holds {entry}"
                context.append(entry[1])
            if not s.sample:
                continue
            if s.num_drafts:        # verify: sample at every position, keep the agreeing prefix
                drafts = s.token_ids[1:]
                end -= s.num_drafts
                context = context[:end]
            truth = truth[:end]
            assert context == truth, f"{s.request_id}: cache holds {context}, expected {truth}"
            emitted = [next_token(context, s.choice_index)]
            for j in range(s.num_drafts):
                if drafts[j] != emitted[-1]:
                    break
                emitted.append(next_token(context + drafts[:j + 1], s.choice_index))
            sampled[s.request_id] = emitted
            if self.draft_rng is not None and self.scheduler.config.num_speculative_tokens:
                proposed[s.request_id] = self._propose(context + emitted, s.choice_index)
        if self.cost is not None:
            self._report_cost(out)
        return ModelRunnerOutput(sampled_token_ids=sampled, draft_token_ids=proposed or None)

    def _propose(self, context: list[int], choice_index: int) -> list[int]:
        """Drafts for the next step of a request whose tokens are `context`: a random number
        of right tokens, then wrong ones."""
        k = self.scheduler.config.num_speculative_tokens
        right = self.draft_rng.randint(0, k)
        context, drafts = list(context), []
        for j in range(self.draft_rng.randint(0, k)):
            tok = next_token(context, choice_index)
            tok = tok if j < right else (tok + 1) % VOCAB
            drafts.append(tok)
            context.append(tok)
        return drafts

    def _report_cost(self, out: SchedulerOutput) -> None:
        blocks = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        if blocks:
            self.scheduler.observe_swap(blocks, blocks * self.cost.per_block)
        prefill = sum(len(s.token_ids) for s in out.scheduled
                      if len(s.token_ids) > 1 and not s.num_drafts)
        decodes = sum(len(s.token_ids) for s in out.scheduled
                      if len(s.token_ids) == 1 or s.num_drafts)
        self.scheduler.observe_step(decodes, prefill, self.cost.step(decodes, prefill))


def run_steps(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000,
              check=None) -> dict[str, list[int]]:
    """Step until no request is unfinished; returns output token ids of every finished request.

    `check(scheduler, out)` runs after every schedule and every update (invariants).
    Raises AssertionError if requests remain after `max_steps`.
    """
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        out = scheduler.schedule()
        if check:
            check(scheduler, out)
        result = runner.execute(out)
        for o in scheduler.update_from_output(out, result):
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        if check:
            check(scheduler, None)
    raise AssertionError(f"requests still unfinished after {max_steps} steps: "
                         f"{sorted(scheduler.requests)}")


def check_invariants(scheduler: Scheduler, out: SchedulerOutput | None) -> None:
    """Block accounting, sharing and budget invariants (see issue 2's property test)."""
    kv = scheduler.kv
    for pool, tables in ((kv.pool, kv.block_tables), (kv.cpu_pool, kv.cpu_tables)):
        if pool is None:
            assert not tables
            continue
        refs = [0] * pool.num_blocks
        holders: dict[int, set[str]] = {}
        if kv.null_block is not None and pool is kv.pool:
            refs[kv.null_block.block_id] = 1          # reserved: never freed, never counted
        for rid, table in tables.items():
            skipped = kv._skipped.get(rid, 0)
            assert all(b is kv.null_block for b in table[:skipped])
            for b in table[skipped:]:
                assert b is not kv.null_block, f"{rid}: the null block inside its window"
                refs[b.block_id] += 1
                holders.setdefault(b.block_id, set()).add(rid)
        free = [b.block_id for b in pool.blocks if b.ref_cnt == 0]
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert sorted(free) == sorted(pool._free), "free queue != blocks with ref_cnt 0"
        for b in pool.blocks:
            assert b.ref_cnt == refs[b.block_id], \
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but {refs[b.block_id]} table refs"
        for block_id, rids in holders.items():
            if len(rids) > 1 and pool.blocks[block_id].block_hash is None:
                families = {r.split("#")[0] for r in rids}
                assert len(families) == 1, f"block {block_id} shared by {rids} outside fork/prefix"
    for req in scheduler.running:
        assert req.request_id in kv.block_tables
    for req in scheduler.swapped:
        assert req.request_id in kv.cpu_tables and req.request_id not in kv.block_tables
    for _, req in scheduler.waiting:
        assert not kv.holds_blocks(req.request_id)
    cfg = scheduler.config
    assert len(scheduler.running) <= cfg.max_num_seqs
    if out is not None:
        assert out.num_scheduled_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert sum(len(s.token_ids) for s in out.scheduled
                   if len(s.token_ids) > 1 and not s.num_drafts) \
            <= scheduler.prefill_budget, "prefill tokens beyond the step's prefill budget"
        assert out.num_draft_tokens == sum(s.num_drafts for s in out.scheduled)
        for s in out.scheduled:
            if s.num_drafts:
                req = scheduler.requests[s.request_id]
                assert s.num_drafts <= cfg.num_speculative_tokens
                assert s.start_position + len(s.token_ids) <= cfg.max_model_len
                left = req.sampling_params.max_tokens
                assert left is None or req.num_output_tokens + s.num_drafts < left
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
