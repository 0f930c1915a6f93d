"""Which replica serves a request: request routers on Ray Serve's `ray.serve.request_router` API.

Owns: `PrefixAffinityRouter` (Ray Serve LLM's `PrefixCacheAffinityRouter`: a prefix tree of the
prompts each replica was sent; while replicas' queue lengths differ by at most
`imbalanced_threshold`, a request goes to the replica with the longest match (past 10% of its
text), else to the replica holding the least text; with imbalanced load, the less loaded of two
— Ray's power of two choices, i.e. the least loaded of two replicas). Requests without prompt
text (`/v1/models`, `/v2/...`, health) go to the least loaded replica and leave the tree alone.
`RandomRouter` (a uniformly random replica: the baseline the prefix-hit test compares against).
`router_config(name, threshold)`: the `request_router_config` of the replica deployment.

In: the `PendingRequest` of a handle call whose first argument is a `ForwardedRequest` (its
`prompt` is the text to match, "" for none). Out: ranked candidate replicas; Ray Serve picks the
one with the shortest queue within the first rank that accepts the request.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

try:        # the public path needs ray[llm] (vLLM); the class itself needs only ray[serve]
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter
except ImportError:
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter)


def _has_text(request: PendingRequest | None) -> bool:
    return (request is not None and bool(request.args)
            and bool(getattr(request.args[0], "prompt", None)))


class PrefixAffinityRouter(PrefixCacheAffinityRouter):
    """Ray Serve LLM's prefix-cache-affinity router; requests without text → least loaded."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        """Ranked candidates: by prefix match when load allows, else Ray's fallback."""
        if not _has_text(pending_request):
            return [list(candidate_replicas)]      # one rank: the shortest queue wins
        return await super().choose_replicas(candidate_replicas, pending_request)

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """Record the prompt in the prefix tree under the replica it went to."""
        if _has_text(pending_request):
            super().on_request_routed(pending_request, replica_id, result)


class RandomRouter(RequestRouter):
    """A uniformly random replica for every request (no load or prefix information)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        """One rank holding one random candidate (none when there are no candidates)."""
        return [[random.choice(candidate_replicas)]] if candidate_replicas else []


def router_config(name: str, imbalanced_threshold: float) -> dict | None:
    """`request_router_config` for `--request-router NAME` (None: Ray Serve's default power
    of two choices). Raises ValueError for an unknown name."""
    if name == "power-of-two":
        return None
    if name == "random":
        return {"request_router_class": f"{__name__}.RandomRouter"}
    if name == "prefix-aware":
        return {"request_router_class": f"{__name__}.PrefixAffinityRouter",
                "request_router_kwargs": {"imbalanced_threshold": imbalanced_threshold}}
    raise ValueError(f"unknown request router {name!r}")
