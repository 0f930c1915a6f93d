"""Draft-model proposer: a smaller model with the target's tokenizer drafts by greedy decoding.

Draft, then score, inside one engine step (vLLM v0's speculative-decoding worker; Leviathan et al.
2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm 1), before the
target's forward pass, and only for the requests that verify drafts this step (the scheduler
chose d > 0 for them; `scheduler.spec_decode`) — when speculation switches itself off, the draft
costs nothing:

- pass 1 runs the draft over each drafting request's step token, preceded by every earlier
  position the draft has not computed yet (catch-up: its prompt the first time, the steps it sat
  out since), so the draft's K/V follows the target's position for position; the argmax of its
  last logits is draft 1;
- passes 2..d feed each draft back, one token per request per pass.

The draft's K/V lives in its own cache tensor with the target's block layout and block ids
(`ModelRunner.draft_kv_cache`): one block table per request serves both models, so the one block
manager covers the draft's blocks too — prefix-cache hits, copy-on-write for n > 1, swap (the
runner mirrors every block copy into the draft's caches) and freeing. Draft slots past the
request's computed tokens are the lookahead the scheduler reserved for the drafts. Because the
draft skips requests that do not draft, a block can hold target K/V the draft never computed:
such blocks are `stale` (by physical id, carried along by swaps and copies), and a request whose
prefix-cache hit reaches a stale block catches the draft up from that block.

Drafts are the draft's argmax (q one-hot, as vLLM v1's proposers draft): the target's coupled
one-hot rule (`rejection_sampler.accepted_prefix`) then keeps greedy and seeded outputs
token-identical to decoding without speculation, whatever the draft — a missing or stale draft
K/V can only lower acceptance.

In: the step's `ScheduledRequest`s and the runner's per-request state (block table, context).
Out: the same requests with their drafts appended to `token_ids`, the step's draft time (all
passes) and (rows, seconds) of its passes without catch-up, for the scheduler's draft cost model
(the runner puts both in its `ModelRunnerOutput`). Per request it keeps how many leading positions hold valid draft
K/V (`computed`), kept across a swap, dropped when the request ends.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from scheduler.output import SchedulerOutput, ScheduledRequest


class DraftModelProposer:
    """Greedy drafts from `model` (an `engine.models.llama.LlamaForCausalLM` with the target's
    vocabulary) with `kernels` (its dtype's compiled kernels, or None for torch); `block_size`
    in tokens, the target's."""

    def __init__(self, model, kernels, block_size: int) -> None:
        self.model, self.kernels, self.block_size = model, kernels, block_size
        model.set_kernels(kernels)
        self.computed: dict[str, int] = {}       # request id -> positions with valid draft K/V
        self.stale: set[int] = set()             # device block ids with K/V the draft lacks
        self.stale_cpu: set[int] = set()         # the same for the swap pool

    def forget(self, request_id: str) -> None:
        """The request finished: drop its record."""
        self.computed.pop(request_id, None)

    def moved(self, out: SchedulerOutput) -> None:
        """The runner copied blocks (swap out, swap in, copy-on-write, in that order): a copy is
        stale where its source was."""
        for pairs, src_set, dst_set in ((out.blocks_to_swap_out, self.stale, self.stale_cpu),
                                        (out.blocks_to_swap_in, self.stale_cpu, self.stale),
                                        (out.blocks_to_copy, self.stale, self.stale)):
            for src, dst in pairs:
                (dst_set.add if src in src_set else dst_set.discard)(dst)

    def run(self, runner, scheduled: list[ScheduledRequest], states: dict,
            kv_cache: torch.Tensor
            ) -> tuple[list[ScheduledRequest], float, tuple[int, float] | None]:
        """Run the draft for one step: pass 1 over the drafting requests, then passes 2..d.

        runner: the `ModelRunner` (its `_prepare` builds the batch); states: request id ->
        the runner's `_RequestState`, already updated for this step; kv_cache: the draft's.
        Returns (`scheduled` with each drafting request's `token_ids` = [token] + its drafts,
        the draft's seconds in this step, (rows, seconds) of its passes without catch-up or
        None): the timings travel in the step's `ModelRunnerOutput`.
        """
        want = {s.request_id: s for s in scheduled if s.num_drafts}
        for s in scheduled:
            table = states[s.request_id].block_table
            self.computed[s.request_id] = self._valid_prefix(s, table)
            if not s.num_drafts:             # the target computes it alone: the draft lags
                self._mark(table, s.start_position, s.start_position + len(s.token_ids), True)
        if not want:
            return scheduled, 0.0, None
        t0 = time.perf_counter()
        drafts, caught_up = self._pass_one(runner, list(want.values()), states, kv_cache)
        rows, t1 = len(want), time.perf_counter()
        for j in range(1, max(s.num_drafts for s in want.values())):
            items = [dataclasses.replace(s, token_ids=[drafts[rid][-1]],
                                         start_position=s.start_position + j, sample=True,
                                         num_drafts=0)
                     for rid, s in want.items() if s.num_drafts > j]
            for rid, tok in zip([s.request_id for s in items],
                                self._forward(runner, items, states, kv_cache, len(items))):
                drafts[rid].append(tok)
            rows += len(items)
        t2 = time.perf_counter()
        measured = (rows, t2 - t0) if not caught_up else (rows - len(want), t2 - t1)
        out = []
        for s in scheduled:
            if s.num_drafts:
                end = s.start_position + s.num_drafts     # computed[rid]: where pass 1 began
                self._mark(states[s.request_id].block_table, self.computed[s.request_id], end,
                           False)
                self.computed[s.request_id] = end
                s = dataclasses.replace(s, token_ids=s.token_ids + drafts[s.request_id])
            out.append(s)
        return out, t2 - t0, measured if measured[0] > 0 else None

    def verified(self, request_id: str, start_position: int, num_emitted: int,
                 block_table: list[int]) -> None:
        """After the target's check, which leaves the target's K/V valid up to position
        `start_position + num_emitted`: the draft's valid K/V ends there at most (rejected
        drafts), and one short of it when every draft was accepted (the last draft's K/V is
        the target's alone — that block is stale until the draft catches up)."""
        if request_id not in self.computed:
            return
        end = start_position + num_emitted
        if self.computed[request_id] < end:
            self._mark(block_table, self.computed[request_id], end, True)
        self.computed[request_id] = min(self.computed[request_id], end)

    def _valid_prefix(self, s: ScheduledRequest, table: list[int]) -> int:
        """Leading positions of `s` whose draft K/V is valid, at most its step's start. A new
        (or swapped-in, or recomputed) request: up to its first stale block."""
        done = self.computed.get(s.request_id, s.start_position)
        if s.is_new:
            bs = self.block_size
            for i in range(-(-s.start_position // bs)):
                if table[i] in self.stale:
                    done = min(done, i * bs)
                    break
        return min(done, s.start_position)

    def _mark(self, table: list[int], start: int, end: int, stale: bool) -> None:
        """Positions [start, end) of a request (its block table) now hold target K/V without
        the draft's (`stale`), or the draft's too (all earlier positions already did)."""
        bs = self.block_size
        for i in range(start // bs, -(-end // bs)):
            (self.stale.add if stale else self.stale.discard)(table[i])

    def _pass_one(self, runner, want, states, kv_cache) -> tuple[dict[str, list[int]], bool]:
        """Catch up and compute this step's token in the draft, for the drafting requests.
        Returns (draft 1 per request, whether any request caught up)."""
        items = []
        for s in want:
            done, context = self.computed[s.request_id], []
            if done < s.start_position:                # catch-up (not the common case)
                row = states[s.request_id].row
                context = (row.prompt_token_ids + row.output_token_ids)[done:s.start_position]
            items.append(dataclasses.replace(s, token_ids=context + s.token_ids,
                                             start_position=done, sample=True, num_drafts=0))
        decodes = [s for s in items if len(s.token_ids) == 1]
        if self.kernels is None:
            decodes.sort(key=lambda s: s.start_position)      # decode groups want them sorted
        chunks = [s for s in items if len(s.token_ids) > 1]
        ordered = decodes + chunks
        tokens = self._forward(runner, ordered, states, kv_cache, len(decodes))
        return {s.request_id: [tok] for s, tok in zip(ordered, tokens)}, bool(chunks)

    def _forward(self, runner, items, states, kv_cache, num_decodes: int) -> list[int]:
        """One draft forward over `items` (decodes first); the argmax at each sampled item."""
        item_states = [states[s.request_id] for s in items]
        input_ids, positions, meta, sample_idx = runner._prepare(items, item_states, num_decodes,
                                                                 self.kernels)
        hidden = self.model.forward(input_ids, positions, meta, kv_cache)
        if not sample_idx:
            return []
        logits = self.model.compute_logits(hidden[[i for _, i in sample_idx]])
        return logits.argmax(dim=-1).tolist()
