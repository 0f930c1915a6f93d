"""The step contract: `SchedulerOutput` goes to the model runner, `ModelRunnerOutput` comes back.

Data changes hands once per engine step: the scheduler decides, on the CPU, which requests run
and how many tokens each computes; the runner turns that into device tensors (flat token batch,
slot mapping, block tables), runs the forward pass and the sampler, and returns sampled token ids
(and, with an n-gram proposer, the drafts each sampled request proposes for its next step).
The scheduler then advances each `Request` (the only writer of one) and reports per-request
`RequestStepOutput`s to the engine's output processor. The runner keeps its own per-request
state (block table, sampling parameters, context) between steps, so after the first step only
diffs travel.

Kept small and explicit on purpose: speculative decoding, swap and other devices plug in here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.request import RequestStatus, SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """One request's work in one step.

    Positions computed this step are `start_position .. start_position + len(token_ids) - 1`;
    the K/V of position p goes to slot `block_table[p // block_size] * block_size +
    p % block_size`, where the runner's table is updated as
    `table[block_table_start:] = new_block_ids`.
    """

    request_id: str
    token_ids: list[int]          # ids computed this step: a prefill chunk, or 1 + num_drafts
    start_position: int           # = num_computed_tokens before this step
    block_table_start: int        # first table index that changed (0 for a new/resumed request)
    new_block_ids: list[int]      # table[block_table_start:]; empty when the table is unchanged
    is_new: bool                  # runner must (re)create its state: new, resumed, or forked
    sample: bool                  # this step reaches the last known token: sample the next one
    sampling_params: SamplingParams
    output_index: int             # tokens generated so far (seeded sampling keys on it)
    choice_index: int = 0         # which of n choices (seeded sampling keys on it too)
    # Only when is_new: the whole context so far (penalties need it; a prefix-cache hit or a
    # resumed request starts mid-sequence, so token_ids alone do not carry it).
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    # Speculative drafts: the last `num_drafts` of `token_ids`. The runner samples at every
    # one of the 1 + num_drafts positions and returns the accepted prefix plus one token.
    num_drafts: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the model runner needs for one step. Copies run before the forward pass in
    this order: swap out, swap in, copy-on-write."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0                                   # sum over `scheduled`
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)      # (src, dst) device
    preempted_request_ids: list[str] = field(default_factory=list)  # runner drops their state
    finished_request_ids: list[str] = field(default_factory=list)   # since last step; drop state
    num_lookahead_tokens: int = 0                                   # slots reserved per request
    num_draft_tokens: int = 0                   # speculative drafts among num_scheduled_tokens

    @property
    def is_empty(self) -> bool:
        """Whether no request is scheduled this step."""
        return not self.scheduled


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one forward pass produced.

    `sampled_token_ids[request_id]` lists the tokens to append, in order. Every token but the last
    had its K/V computed in this step (accepted speculative tokens); without speculative
    decoding it holds exactly one token. Requests that did not sample are absent.
    `logprobs[request_id]` is opaque to the scheduler and passed through to the engine.
    `prompt_logprobs[request_id]`: (index of the first prompt token scored, a
    `engine.outputs.PromptLogprob` per scored token), for requests with
    `SamplingParams.prompt_logprobs` whose prompt chunk ran this step; the engine reads it.
    `draft_token_ids[request_id]`: the speculative drafts proposed for the request's next step
    (possibly empty), for each request that sampled, when the runner has an n-gram proposer;
    `Scheduler.update_from_output` sets them as the request's `spec_token_ids`.
    The step's timings, for the engine's cost models: `swap` = (blocks copied between the
    device and the swap pool, seconds) when the step swapped; `draft_seconds` = the draft
    model's time in the step (all its passes), `draft_passes` = (rows, seconds) of its passes
    without catch-up, None when it ran none.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, Any] | None = None
    draft_token_ids: dict[str, list[int]] | None = None
    prompt_logprobs: dict[str, tuple[int, list[Any]]] | None = None
    swap: tuple[int, float] | None = None
    draft_seconds: float = 0.0
    draft_passes: tuple[int, float] | None = None


@dataclass(slots=True)
class RequestStepOutput:
    """Per-request result of `Scheduler.update_from_output`, for the output processor."""

    request_id: str
    new_token_ids: list[int]
    status: RequestStatus              # a FINISHED_* status when this step finished it
    stop_reason: int | str | None = None
    logprobs: Any = None
    parent_id: str | None = None       # set for forked choices (n > 1)
    index: int = 0                     # choice index
    # Set when the request failed before it ran (its grammar did not compile): why, for the
    # user. The output processor then ends every choice with finish_reason "error".
    error: str | None = None

    @property
    def finished(self) -> bool:
        """Whether the request ended this step."""
        return self.status.is_finished

    def __reduce__(self):
        """Pickled as `_step_output` and the fields in order, the status as its int (one a
        token crosses the engine's pipe: the default pickle is a dict of field names, and
        reading an enum member back goes through `RequestStatus(value)`, the slow path)."""
        return _step_output, (self.request_id, self.new_token_ids, int(self.status),
                              self.stop_reason, self.logprobs, self.parent_id, self.index,
                              self.error)


_STATUSES = tuple(RequestStatus)           # RequestStatus values are 0, 1, ... in order


def _step_output(request_id, new_token_ids, status, *rest) -> RequestStepOutput:
    return RequestStepOutput(request_id, new_token_ids, _STATUSES[status], *rest)
