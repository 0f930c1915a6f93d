"""Draft-model proposer: a smaller model with the target's tokenizer drafts by greedy decoding.

Draft, then score, inside one engine step (vLLM v0's speculative-decoding worker; Leviathan et al.
2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm 1), before the
target's forward pass:

- pass 1 runs the draft over every scheduled request's tokens of the step (prefill chunks and
  decode tokens, not drafts), preceded by any earlier positions the draft has not computed yet
  (catch-up), so the draft's K/V follows the target's position for position;
- for a request that verifies d drafts (the scheduler chose d; `scheduler.spec_decode`), the
  argmax of pass 1's last logits is draft 1, and passes 2..d feed each draft back, one token
  per request per pass.

The draft's K/V lives in its own cache tensor with the target's block layout and block ids
(`ModelRunner.draft_kv_cache`): one block table per request serves both models, so the one block
manager covers the draft's blocks too — prefix-cache hits, copy-on-write for n > 1, swap (the
runner mirrors every block copy into the draft's caches) and freeing. Draft slots past the
request's computed tokens are the lookahead the scheduler reserved for the drafts.

Drafts are the draft's argmax (q one-hot, as vLLM v1's proposers draft): the target's coupled
one-hot rule (`rejection_sampler.accepted_prefix`) then keeps greedy and seeded outputs
token-identical to decoding without speculation, whatever the draft.

In: the step's `ScheduledRequest`s and the runner's per-request state (block table, context).
Out: the same requests with their drafts appended to `token_ids`; `last_passes` = (rows,
seconds) of passes 2..d for the scheduler's cost model. Per request it keeps how many leading
positions hold valid draft K/V (`computed`), kept across a swap, dropped when the request ends.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from scheduler.output import ScheduledRequest


class DraftModelProposer:
    """Greedy drafts from `model` (an `engine.models.llama.LlamaForCausalLM` with the target's
    vocabulary) with `kernels` (its dtype's compiled kernels, or None for torch)."""

    def __init__(self, model, kernels) -> None:
        self.model, self.kernels = model, kernels
        model.set_kernels(kernels)
        self.computed: dict[str, int] = {}       # request id -> positions with valid draft K/V
        self.last_passes: tuple[int, float] | None = None

    def forget(self, request_id: str) -> None:
        """The request finished: drop its record."""
        self.computed.pop(request_id, None)

    def run(self, runner, scheduled: list[ScheduledRequest], states: dict,
            kv_cache: torch.Tensor) -> list[ScheduledRequest]:
        """Run the draft for one step: pass 1 over every request, then the drafting passes.

        runner: the `ModelRunner` (its `_prepare` builds the batch); states: request id ->
        the runner's `_RequestState`, already updated for this step; kv_cache: the draft's.
        Returns `scheduled` with each drafting request's `token_ids` = [token] + its drafts.
        """
        self.last_passes = None
        drafts = self._pass_one(runner, scheduled, states, kv_cache)
        if not drafts:
            return scheduled
        want = {s.request_id: s for s in scheduled if s.num_drafts}
        t0, rows = time.perf_counter(), 0
        for j in range(1, max(s.num_drafts for s in want.values())):
            items = [dataclasses.replace(s, token_ids=[drafts[rid][-1]],
                                         start_position=s.start_position + j, sample=True,
                                         num_drafts=0)
                     for rid, s in want.items() if s.num_drafts > j]
            for rid, tok in zip([s.request_id for s in items],
                                self._forward(runner, items, states, kv_cache, len(items))):
                drafts[rid].append(tok)
            rows += len(items)
        if rows:
            self.last_passes = (rows, time.perf_counter() - t0)
        out = []
        for s in scheduled:
            if s.num_drafts:
                self.computed[s.request_id] = s.start_position + s.num_drafts
                s = dataclasses.replace(s, token_ids=s.token_ids + drafts[s.request_id])
            out.append(s)
        return out

    def verified(self, request_id: str, start_position: int, num_emitted: int) -> None:
        """After the target's check: positions from `start_position + num_emitted` on held
        rejected drafts (or none), so the draft's valid K/V ends there at most."""
        if request_id in self.computed:
            self.computed[request_id] = min(self.computed[request_id],
                                            start_position + num_emitted)

    def _pass_one(self, runner, scheduled, states, kv_cache) -> dict[str, list[int]]:
        """Catch up and compute this step's tokens in the draft; returns draft 1 per drafting
        request."""
        items = []
        for s in scheduled:
            done = self.computed.get(s.request_id, s.start_position)
            if s.is_new or done > s.start_position:
                done = min(done, s.start_position)
            context = []
            if done < s.start_position:
                row = states[s.request_id].row
                context = (row.prompt_token_ids + row.output_token_ids)[done:s.start_position]
            items.append(dataclasses.replace(s, token_ids=context + s.token_ids,
                                             start_position=done, sample=s.num_drafts > 0,
                                             num_drafts=0))
            self.computed[s.request_id] = s.start_position + len(s.token_ids)
        decodes = [s for s in items if len(s.token_ids) == 1]
        if self.kernels is None:
            decodes.sort(key=lambda s: s.start_position)      # decode groups want them sorted
        chunks = [s for s in items if len(s.token_ids) > 1]
        ordered = decodes + chunks
        tokens = self._forward(runner, ordered, states, kv_cache, len(decodes))
        sampled = [s.request_id for s in ordered if s.sample]
        return {rid: [tok] for rid, tok in zip(sampled, tokens)}

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
