"""Sampler rules on hand-made logits (no model)."""

import math

import pytest
import torch

from engine.sampler import Sampler, SamplingRow
from scheduler.request import SamplingParams


def row(prompt=(), output=(), stop_ids=(9,), index=0, **params):
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), index,
                       tuple(stop_ids))


def sample(logits, rows, seed=0):
    return Sampler(torch.device("cpu"), seed)(torch.tensor(logits, dtype=torch.float32), rows)


def test_greedy_is_argmax():
    assert sample([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]], [row(temperature=0)] * 2).token_ids == [1, 0]


def test_sampling_follows_the_softmax_distribution():
    logits = [0.0, math.log(2), math.log(3), math.log(4)]          # probs 0.1 .. 0.4
    n = 20000
    res = sample([logits] * n, [row(temperature=1.0)] * n, seed=3).token_ids
    freq = [res.count(t) / n for t in range(4)]
    assert all(abs(f - p) < 0.015 for f, p in zip(freq, [0.1, 0.2, 0.3, 0.4])), freq


def test_temperature_sharpens():
    logits = [0.0, 1.0]
    n = 5000
    hot = sample([logits] * n, [row(temperature=2.0)] * n, seed=1).token_ids.count(1) / n
    cold = sample([logits] * n, [row(temperature=0.25)] * n, seed=1).token_ids.count(1) / n
    assert cold > 0.95 and 0.55 < hot < 0.7


# probs 0.1, 0.2, 0.3, 0.4 for tokens 0..3
@pytest.mark.parametrize("params,allowed", [
    ({"top_k": 2}, {2, 3}),
    ({"top_p": 0.5}, {2, 3}),       # smallest top set with mass >= 0.5: 0.4 + 0.3
    ({"top_p": 0.35}, {3}),
    ({"min_p": 0.6}, {2, 3}),       # keep p >= 0.6 * 0.4 = 0.24
])
def test_top_k_top_p_min_p_restrict_the_support(params, allowed):
    logits = [0.0, math.log(2), math.log(3), math.log(4)]
    n = 3000
    got = set(sample([logits] * n, [row(temperature=1.0, **params)] * n, seed=2).token_ids)
    assert got == allowed


def test_penalties_and_logit_bias():
    logits = [[2.0, 1.9, 0.0]]
    assert sample(logits, [row(temperature=0, output=[0], presence_penalty=0.5)]).token_ids == [1]
    assert sample(logits, [row(temperature=0, output=[0, 0], frequency_penalty=0.06)]
                  ).token_ids == [1]
    assert sample(logits, [row(temperature=0, output=[0], frequency_penalty=0.04)]
                  ).token_ids == [0]
    assert sample(logits, [row(temperature=0, prompt=[0], repetition_penalty=1.1)]
                  ).token_ids == [1]
    assert sample(logits, [row(temperature=0, logit_bias={2: 5.0})]).token_ids == [2]


def test_min_tokens_masks_stop_ids_until_reached():
    logits = [[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0]]
    assert sample(logits, [row(temperature=0, min_tokens=2, output=[1])]).token_ids != [9]
    assert sample(logits, [row(temperature=0, min_tokens=2, output=[1, 1])]).token_ids == [9]


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = [[0.1 * i for i in range(50)]]
    seeded = row(temperature=1.0, seed=42, output=[1, 2])
    alone = sample(logits, [seeded], seed=0).token_ids
    batched = sample(logits * 4, [row(temperature=1.0), row(temperature=1.0, seed=7), seeded,
                                  row(temperature=0)], seed=123).token_ids
    assert batched[2] == alone[0]


def test_seeded_streams_move_with_output_index_and_choice():
    logits = [[0.1 * i for i in range(50)]]

    def draws(index):
        return [sample(logits, [row(temperature=1.0, seed=42, output=[1] * k, index=index)]
                       ).token_ids[0] for k in range(20)]

    assert len(set(draws(0))) > 1               # the output index moves the stream
    assert draws(0) != draws(1)                 # choices of n > 1 differ
    assert draws(0) == draws(0)


def test_logprobs_of_the_raw_distribution():
    logits = [[0.0, math.log(3)]]                # probs 0.25, 0.75
    res = sample(logits, [row(temperature=0, logprobs=2)])
    lp, top = res.logprobs[0]
    assert abs(lp - math.log(0.75)) < 1e-6
    assert [t for t, _ in top] == [1, 0] and abs(top[1][1] - math.log(0.25)) < 1e-6


def test_a_forward_passs_argmax_is_taken_only_for_rows_nothing_changes():
    """The layer stack hands the sampler each row's argmax (`greedy`): only rows whose token is
    the raw logits' argmax may take it — greedy, and no grammar, bias, banned words, unmet
    min_tokens or penalty first."""
    plain = row(temperature=0, output=[1, 2], min_tokens=2, top_p=0.5, logprobs=2)
    assert Sampler.plain_greedy([plain, row(temperature=0)])
    for changed in (row(temperature=0.7), row(temperature=0, logit_bias={2: 5.0}),
                    row(temperature=0, allowed_token_ids=(1,)),
                    row(temperature=0, bad_words_token_ids=((3,),)),
                    row(temperature=0, min_tokens=3, output=[1, 2]),
                    row(temperature=0, repetition_penalty=1.1),
                    row(temperature=0, frequency_penalty=0.1),
                    row(temperature=0, presence_penalty=0.1)):
        assert not Sampler.plain_greedy([plain, changed])
    logits = torch.tensor([[0.1, 3.0, 0.2, -1.0]])
    result = Sampler(torch.device("cpu"))(logits, [plain], greedy=[1])
    assert result.token_ids == [1]
    assert result.logprobs[0][1][0][0] == 1 and result.logprobs[0][0] == pytest.approx(
        torch.log_softmax(logits, -1)[0, 1].item())
