"""N-gram (prompt lookup) proposer: drafts copied from the request's own earlier tokens.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's `ngram` method): find the
longest suffix n-gram of the request's tokens, `prompt_lookup_max` >= n >= `prompt_lookup_min`,
that also occurs earlier in its prompt or output, and propose the (up to k) tokens that followed
it; among equally long matches the most recent one wins.

Per request the proposer keeps an index token id -> positions where it occurred (with a token
after it), extended by the tokens added since the last call, so a step costs O(new tokens +
candidates x n) rather than a scan of the whole context. Candidates are the positions of the
last token, newest first, at most `MAX_CANDIDATES` of them.

In: a request id and its token ids (prompt + output, append-only while the request lives).
Out: a list of draft token ids, possibly empty. `forget` drops the index of finished requests.
"""

from __future__ import annotations

MAX_CANDIDATES = 64           # most recent occurrences of the last token that are extended


class NgramProposer:
    """Proposes up to `k` drafts by prompt lookup. `min_n` <= `max_n` are n-gram lengths in
    tokens (both >= 1; `SpeculativeConfig` checks them)."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self._index: dict[str, tuple[dict[int, list[int]], list[int]]] = {}

    def propose(self, request_id: str, token_ids: list[int]) -> list[int]:
        """Drafts for `request_id`, whose tokens are `token_ids` (oldest first); [] when no
        suffix n-gram of an allowed length occurs earlier."""
        last = len(token_ids) - 1
        if last < self.min_n:
            return []
        entry = self._index.get(request_id)
        if entry is None or entry[1][0] > last:
            entry = self._index[request_id] = ({}, [0])
        positions, done = entry
        for p in range(done[0], last):          # positions that now have a following token
            positions.setdefault(token_ids[p], []).append(p)
        done[0] = last
        candidates = positions.get(token_ids[last])
        if not candidates:
            return []
        best_n, best_at, max_n = 0, -1, self.max_n
        for p in reversed(candidates[-MAX_CANDIDATES:]):
            n = 1
            while n < max_n and n <= p and token_ids[p - n] == token_ids[last - n]:
                n += 1
            if n > best_n:
                best_n, best_at = n, p
                if n == max_n:
                    break
        if best_n < self.min_n:
            return []
        return token_ids[best_at + 1:best_at + 1 + self.k]

    @property
    def num_tracked(self) -> int:
        """Requests whose index is kept."""
        return len(self._index)

    def forget(self, keep: set[str]) -> None:
        """Drop the index of every request not in `keep` (the ones still running)."""
        for rid in [r for r in self._index if r not in keep]:
            del self._index[rid]
