"""Speculative decoding, the engine's half: draft proposers and the rejection sampler.

The scheduler's half (configuration, acceptance windows, how many drafts each request verifies)
is `scheduler.spec_decode`. Flow per step: the scheduler schedules 1 + k tokens for a decoding
request with drafts, the model runner computes logits at every one of them and keeps the
accepted prefix (`rejection_sampler`), and the scheduler rolls `num_computed_tokens` and the
block table back past the rejected drafts. The drafts come from the runner: the n-gram proposer
(`ngram`) runs after sampling, for each request that sampled, and its drafts travel in
`ModelRunnerOutput.draft_token_ids` to the scheduler, which keeps them on the request
(`Request.spec_token_ids`) for the next step; a draft model (`draft_model`) drafts within the
step, before the target's forward pass.
"""
