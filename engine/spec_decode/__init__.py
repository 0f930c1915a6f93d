"""Speculative decoding, the engine's half: draft proposers and the rejection sampler.

The scheduler's half (configuration, acceptance windows, how many drafts each request verifies)
is `scheduler.spec_decode`. Flow per step: the engine asks the proposer for each decoding
request's drafts (`Request.spec_token_ids`), the scheduler schedules 1 + k tokens for it, the
model runner computes logits at every one of them and keeps the accepted prefix
(`rejection_sampler`), and the scheduler rolls `num_computed_tokens` and the block table back
past the rejected drafts.
"""
