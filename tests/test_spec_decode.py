"""Speculative decoding without the model: the configuration's errors, the n-gram proposer, the
adaptive choice of k, the scheduler's draft bookkeeping, and the sampler's law.

The law tests draw >= 100,000 samples with fixed seeds and apply a G test (log-likelihood ratio)
at alpha = 1e-4 against the target distribution p: Leviathan et al.'s rule must emit tokens
distributed exactly as p whatever the draft distribution q.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import power_divergence

from engine.sampler import Sampler, SamplingRow
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.rejection_sampler import accepted_prefix, rejection_sample
from scheduler.config import CacheConfig, SchedulerConfig
from scheduler.output import ModelRunnerOutput
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.slo import LatencyHistory
from scheduler.spec_decode import (AcceptanceWindow, SpeculativeConfig, choose_num_drafts)

ALPHA = 1e-4
DRAWS = 120_000


# ----------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("value,words", [
    ('{"method": "medusa"}', "method must be one of ngram, draft_model"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
    ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min must not exceed"),
    ('{"adaptive": "yes"}', "adaptive must be true or false"),
    ('{"method": "draft_model"}', "model is required"),
    ('{"num_speculative_token": 3}', "unknown key 'num_speculative_token'"),
    ('{"method": ngram}', "not valid JSON"),
    ('[1, 2]', "must be a JSON object"),
])
def test_bad_config_names_the_key(value, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        SpeculativeConfig.parse(value)


def test_config_defaults_follow_vllm():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max,
            cfg.adaptive) == (3, 2, 5, True)


# ----------------------------------------------------------------------------- proposer
def test_ngram_proposes_what_followed_the_longest_most_recent_match():
    p = NgramProposer(k=3, min_n=2, max_n=4)
    #            0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 1, 2, 3]
    # Suffix [1, 2, 3] occurs at 1 and 6 (both followed); the newer one (6) wins.
    assert p.propose("a", tokens) == [7, 6, 1]
    # A longer match beats a newer shorter one: suffix [9, 1, 2] (length 3) vs [1, 2] newer.
    q = NgramProposer(k=2, min_n=2, max_n=3)
    assert q.propose("b", [9, 1, 2, 4, 4, 1, 2, 5, 9, 1, 2]) == [4, 4]
    assert p.propose("c", [1, 2, 3, 4]) == []           # no earlier occurrence
    assert p.propose("d", [4, 4]) == []                 # shorter than min_n + 1
    tokens.append(7)                                    # incremental: index grows with tokens
    assert p.propose("a", tokens) == [6, 1, 2]
    p.forget(set())
    assert p.num_tracked == 0


# ----------------------------------------------------------------------------- adaptive k
def test_adaptive_choice_speculates_alone_and_switches_off_in_a_big_batch():
    # A CPU-like step: 30 ms base + 2 ms per row (the session's measured shape).
    step = lambda rows: 0.030 + 0.002 * rows          # noqa: E731
    alone = choose_num_drafts([(4, 0.7)], 1, step(1), 0.002)
    assert alone == [4]
    big = choose_num_drafts([(4, 0.5)] * 64, 64, step(64), 0.002)
    assert big == [0] * 64
    # Near-certain drafts still pay in a big batch; the rest do not.
    mixed = choose_num_drafts([(4, 0.99)] + [(4, 0.3)] * 63, 64, step(64), 0.002)
    assert mixed[0] > 0 and sum(mixed[1:]) == 0
    # Without a measured cost: verify everything (measure first).
    assert choose_num_drafts([(3, 0.1), (2, 0.1)], 2, None, None) == [3, 2]


def test_acceptance_window_counts_tested_drafts():
    w = AcceptanceWindow()
    prior = w.rate()
    for _ in range(16):
        w.record(4, 4)                   # every draft passes
    assert w.rate() > 0.9
    for _ in range(16):
        w.record(4, 0)                   # first draft fails: 1 tested, 0 passed
    assert w.rate() < 0.5 < prior


def test_new_request_takes_the_pooled_acceptance_as_its_prior():
    """Drafts that cost almost a step (a draft model nearly the target's size): at the fixed
    70% prior a new request would never draft, so never learn; with recent requests accepting
    97% it drafts from its first step, and with them failing at the first draft 15 times in 16
    it does not."""
    step = lambda rows: 0.030 + 0.002 * rows          # noqa: E731
    pooled = AcceptanceWindow.pooled()
    assert choose_num_drafts([(4, pooled.rate())], 1, step(1), 0.002, 0.025) == [0]
    for _ in range(64):
        pooled.record(4, 4 if _ % 8 else 3)
    assert pooled.rate() > 0.95
    assert choose_num_drafts([(4, pooled.rate())], 1, step(1), 0.002, 0.025)[0] >= 2
    assert AcceptanceWindow().rate(pooled.rate()) == pytest.approx(pooled.rate())
    for _ in range(256):
        pooled.record(4, 4 if _ % 16 == 0 else 0)
    assert pooled.rate() < 0.3
    assert choose_num_drafts([(4, pooled.rate())], 1, step(1), 0.002, 0.025) == [0]


def test_latency_history_row_cost_is_the_decode_slope_once_seen():
    h = LatencyHistory()
    for _ in range(4):
        h.observe(1, 0, 0.032)
        h.observe(1, 200, 0.232)         # 1 ms per prefill token
    assert h.row_cost() == pytest.approx(0.001, rel=1e-6)   # one batch size: no slope seen
    for d in (2, 3, 5):
        h.observe(d, 0, 0.030 + 0.002 * d)
    assert h.row_cost() < 0.0025


# ----------------------------------------------------------------------------- scheduler
def _decode_ready(spec_k=4, adaptive=False, max_tokens=20, blocks=16):
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64,
                                  num_speculative_tokens=spec_k, spec_adaptive=adaptive),
                  CacheConfig(4, blocks, 0, True))
    req = Request("r", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=max_tokens,
                                                              temperature=0), eos_token_id=0)
    s.add_request(req)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput({"r": [8]}))
    return s, req


def test_drafts_roll_back_and_free_whole_blocks():
    s, req = _decode_ready()
    req.spec_token_ids = [9, 10, 11, 12]
    out = s.schedule()
    (sr,) = out.scheduled
    assert sr.token_ids == [8, 9, 10, 11, 12] and sr.num_drafts == 4
    assert out.num_scheduled_tokens == 5 and out.num_draft_tokens == 4
    assert len(s.kv.block_ids("r")) == 3            # 12 slots for positions 0..11
    # One draft accepted (9) plus the target's own token 13 at the first mismatch.
    s.update_from_output(out, ModelRunnerOutput({"r": [9, 13]}))
    assert req.all_token_ids[-3:] == [8, 9, 13]
    assert req.num_computed_tokens == 9             # 7 prompt + 8 + 9; 13 not yet computed
    assert len(s.kv.block_ids("r")) == 3            # 10 tokens need 3 blocks of 4
    c = s.spec_counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (1, 4, 1)
    assert c.accepted_per_pos == [1, 0, 0, 0]
    # All rejected: the block reserved for the drafts' slots goes back to the pool.
    req.spec_token_ids = [1, 1, 1]
    out = s.schedule()
    assert len(s.kv.block_ids("r")) == 4
    s.update_from_output(out, ModelRunnerOutput({"r": [2]}))
    assert len(s.kv.block_ids("r")) == 3
    assert s.kv.num_free_blocks == 16 - 3


def test_drafts_never_reach_past_max_tokens_or_the_budget():
    s, req = _decode_ready(max_tokens=3)            # 1 emitted, 2 left: at most 1 draft
    req.spec_token_ids = [9, 10, 11, 12]
    out = s.schedule()
    assert out.scheduled[0].num_drafts == 1
    s.update_from_output(out, ModelRunnerOutput({"r": [9, 10]}))
    assert req.is_finished and req.output_token_ids == [8, 9, 10]
    assert s.kv.num_free_blocks == 16


def test_no_drafts_while_prefilling():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=4, max_model_len=64,
                                  num_speculative_tokens=4, spec_adaptive=False),
                  CacheConfig(4, 16, 0, True))
    req = Request("r", list(range(1, 11)), SamplingParams(max_tokens=5, temperature=0))
    s.add_request(req)
    req.spec_token_ids = [1, 2]
    out = s.schedule()
    assert out.scheduled[0].num_drafts == 0 and out.num_draft_tokens == 0


# ----------------------------------------------------------------------------- the sampler's law
def _g_test(samples: torch.Tensor, probs: torch.Tensor) -> None:
    """G test of integer `samples` against `probs` [V]; tokens of probability 0 never drawn."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    zero = probs <= 0
    assert counts[zero].sum() == 0, f"drew tokens of probability 0: {counts[zero]}"
    kept = probs[~zero].double()
    expected = kept / kept.sum() * counts.sum()
    _, pvalue = power_divergence(counts[~zero].numpy(), expected.numpy(),
                                 lambda_="log-likelihood")
    assert pvalue > ALPHA, f"G test p = {pvalue:.2e}: {counts.tolist()} vs {expected.tolist()}"


def _draws(q: torch.Tensor, n: int, generator) -> torch.Tensor:
    return torch.multinomial(q, n, replacement=True, generator=generator)


P = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
CASES = {
    "q one-hot": torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0]),
    "q equals p": P.clone(),
    "q has mass where p has none": torch.tensor([0.1, 0.1, 0.1, 0.1, 0.3, 0.3]),
    "p has mass where q has none": torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0, 0.0]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rejection_sample_emits_the_target_law(case):
    p = P.clone()
    if case == "q has mass where p has none":
        p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0])
    q = CASES[case]
    g = torch.Generator().manual_seed(1234)
    drafts = _draws(q, DRAWS, g)[:, None]
    out = rejection_sample(p.expand(DRAWS, 2, 6).contiguous(), drafts,
                           q.expand(DRAWS, 1, 6).contiguous(),
                           torch.ones(DRAWS, dtype=torch.long), g)
    first = torch.tensor([o[0] for o in out])
    _g_test(first, p)


def _filtered(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    row = SamplingRow(SamplingParams(temperature=temperature, top_p=top_p), [1], [], 0, ())
    return Sampler(torch.device("cpu"))._filtered_probs(logits.div(temperature)[None].clone(),
                                                        [row])[0]


def test_rejection_sample_after_temperature_and_top_p():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0, -4.0])
    p = _filtered(logits, 0.7, 0.8)
    q = _filtered(logits * 0.5, 1.0, 1.0)          # a flatter draft, mass everywhere
    assert (p == 0).any()                          # top-p removed the tail
    g = torch.Generator().manual_seed(99)
    drafts = _draws(q, DRAWS, g)[:, None]
    out = rejection_sample(p.expand(DRAWS, 2, 8).contiguous(), drafts,
                           q.expand(DRAWS, 1, 8).contiguous(),
                           torch.ones(DRAWS, dtype=torch.long), g)
    _g_test(torch.tensor([o[0] for o in out]), p)


def test_rejection_sample_joint_law_of_two_positions():
    """k = 2: the emitted pair (t1, t2) must follow p1(a) p2(b | a). When a request stops
    after one token (a rejection at position 1), its second token is drawn as the next step
    would: from p2(. | t1)."""
    v = 4
    g = torch.Generator().manual_seed(7)
    p1 = torch.tensor([0.4, 0.3, 0.2, 0.1])
    p2 = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1],
                       [0.25, 0.25, 0.25, 0.25], [0.05, 0.05, 0.1, 0.8]])   # p2[a] = p(. | a)
    q1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q2 = torch.tensor([[0.25] * 4, [0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0],
                       [0.1, 0.2, 0.3, 0.4]])
    x1 = _draws(q1, DRAWS, g)
    x2 = torch.multinomial(q2[x1], 1, generator=g)[:, 0]
    bonus = torch.full((v,), 1.0 / v)              # p3: irrelevant to the pair
    target = torch.stack([p1.expand(DRAWS, v), p2[x1], bonus.expand(DRAWS, v)], 1)
    draft = torch.stack([q1.expand(DRAWS, v), q2[x1]], 1)
    out = rejection_sample(target.contiguous(), torch.stack([x1, x2], 1), draft.contiguous(),
                           torch.full((DRAWS,), 2, dtype=torch.long), g)
    pairs = []
    for o in out:
        second = o[1] if len(o) > 1 else int(torch.multinomial(p2[o[0]], 1, generator=g))
        pairs.append(o[0] * v + second)
    _g_test(torch.tensor(pairs), (p1[:, None] * p2).flatten())


def test_coupled_rule_through_the_engine_sampler_keeps_the_law():
    """The runner's path for one-hot drafts: every position drawn by the engine's sampler (after
    temperature and top-p), drafts kept while they equal the draws. The first token follows p1,
    and the second, when the draft was accepted, follows p2."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    params = SamplingParams(temperature=0.8, top_p=0.9)
    p = _filtered(logits, 0.8, 0.9)
    sampler = Sampler(torch.device("cpu"), seed=5)
    n = DRAWS
    rows = [SamplingRow(params, [1], [], 0, ()) for _ in range(n)]
    first = torch.tensor(sampler(logits.expand(n, 6).clone(), rows).token_ids)
    second = torch.tensor(sampler(logits.expand(n, 6).clone(), rows).token_ids)
    kept = [accepted_prefix([0, 3], [a, b, 0]) for a, b in zip(first.tolist(), second.tolist())]
    _g_test(torch.tensor([k[0] for k in kept]), p)
    after_accept = torch.tensor([k[1] for k in kept if len(k) > 1])
    assert len(after_accept) > 0.25 * n
    _g_test(after_accept, p)


def test_greedy_verification_stops_at_the_first_mismatch():
    assert accepted_prefix([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accepted_prefix([5, 6], [5, 6, 4]) == [5, 6, 4]          # all accepted + bonus
    assert accepted_prefix([], [8]) == [8]
    with pytest.raises(ValueError):
        accepted_prefix([1, 2], [1, 2])
