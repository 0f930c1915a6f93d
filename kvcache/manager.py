"""KV-cache manager: per-request block tables over a device block pool and a CPU swap pool.

Owns: each request's block table (logical block i -> physical block), the memo of each request's
full-block hashes, the copy-on-write copies and the prefix-cache counters.

In (from the scheduler): request ids, their token ids (read-only), how many tokens are computed
and how many this step adds. Out: block ids for `SchedulerOutput` (tables or their diffs),
`(src, dst)` block-id pairs to copy or swap, and `None` when there is no room — the signal that
makes the scheduler preempt. Every call either succeeds completely or changes nothing.

Pure Python, no torch. Physical layout (in the runner): slot = block_id * block_size + offset.

Contract with the model runner: within one forward pass, the K/V of every scheduled token of a
layer is written before that layer's attention reads the cache. A block registered in the prefix
cache during `allocate_slots` may therefore be read by another request in the same step.

Sliding windows (`sliding_window` W > 0: every layer of the model attends to a window, and the
attention backend applies it — vLLM's `SlidingWindowManager`): a query at position p reads keys
p - W + 1 .. p only, so once a request has computed c tokens, its blocks wholly before position
c - W + 1 are never read again. `allocate_slots` frees them and puts the null block — one
block reserved at start, never written, never read — in their table entries, so a windowed
model's cache holds about W tokens a request however long its context; the attention kernels
must not read keys before a query's window (the Triton kernels mask them out of their loads).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvcache.block_pool import BlockPool, KVCacheBlock, KVCacheError, hash_block_tokens


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


class KVCacheManager:
    """Block tables for every request that holds KV cache, on the device and in the swap pool.

    Args:
        num_blocks: device blocks (the physical KV cache is `[num_blocks, block_size, ...]`).
        block_size: tokens per block.
        enable_prefix_caching: share full blocks between requests with equal prefixes.
        num_cpu_blocks: blocks in the CPU swap pool (0 disables swapping).
        sliding_window: W > 0 frees blocks that slid out of a W-token window (module
            docstring); it reserves one device block, the null block.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0, sliding_window: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window and num_blocks < 2:
            raise ValueError("a sliding-window cache needs two blocks or more (one is the null "
                             "block)")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False) if num_cpu_blocks else None
        self.sliding_window = sliding_window
        self.null_block = self.pool.allocate(1)[0] if sliding_window else None
        self._skipped: dict[str, int] = {}             # leading table entries now null
        self._unreported: dict[str, int] = {}          # first entry nulled, not yet returned
        self.num_window_freed = 0                      # table entries freed by the window
        self.block_tables: dict[str, list[KVCacheBlock]] = {}
        self.cpu_tables: dict[str, list[KVCacheBlock]] = {}
        self._hashes: dict[str, list[int]] = {}        # memo: hash of each full block so far
        self._num_cached: dict[str, int] = {}          # leading table blocks already registered
        self._copies: list[tuple[int, int]] = []       # copy-on-write (src, dst) since last take

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Device blocks with no reference (cached or not)."""
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """Device KV-cache usage in [0, 1] (blocks referenced / total)."""
        return self.pool.usage()

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's device block table as ids from index `start` (empty if none)."""
        table = self.block_tables.get(request_id, ())
        return [b.block_id for b in table[start:]] if start < len(table) else []

    def holds_blocks(self, request_id: str) -> bool:
        """Whether the request has a block table on the device or in the swap pool."""
        return request_id in self.block_tables or request_id in self.cpu_tables

    # ----------------------------------------------------------------- prefix cache
    def _block_hashes(self, request_id: str, token_ids: Sequence[int], num_full: int,
                      extra_keys: Hashable) -> list[int]:
        """Hashes of the first `num_full` full blocks of `token_ids`, memoised per request."""
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs], extra_keys))
        return hashes

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int],
                            extra_keys: Hashable = None) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks for a request that holds no blocks yet.

        The prefix is capped so that at least one token is left to compute (its logits are
        needed to sample). References nothing: pass the blocks to `allocate_slots`.

        Returns: (cached blocks in order, number of tokens they cover).
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        hashes = self._block_hashes(request_id, token_ids, max_blocks, extra_keys)
        hit: list[KVCacheBlock] = []
        for i in range(max_blocks):
            block = self.pool.lookup(hashes[i], token_ids[i * bs:(i + 1) * bs])
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * bs

    def _cache_full_blocks(self, request_id: str, table: list[KVCacheBlock],
                           token_ids: Sequence[int], num_tokens: int,
                           extra_keys: Hashable) -> None:
        """Register every block of `table` that is full after `num_tokens` tokens."""
        num_full = min(num_tokens // self.block_size, len(table))
        start = max(self._num_cached.get(request_id, 0), self._skipped.get(request_id, 0))
        if num_full <= start:
            return
        hashes = self._block_hashes(request_id, token_ids, num_full, extra_keys)
        bs = self.block_size
        for i in range(start, num_full):
            self.pool.cache(table[i], hashes[i], token_ids[i * bs:(i + 1) * bs])
        self._num_cached[request_id] = num_full

    # ----------------------------------------------------------------- allocation
    def allocate_slots(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                       num_new_tokens: int, num_lookahead_tokens: int = 0,
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       extra_keys: Hashable = None) -> int | None:
        """Make room for `num_new_tokens` (+ `num_lookahead_tokens` speculative slots).

        Args:
            request_id: the owner of the block table.
            token_ids: all known token ids of the request (prompt + output); read only.
            num_computed_tokens: tokens whose K/V is already in the table's blocks, not counting
                `new_computed_blocks`.
            num_new_tokens: tokens this step computes, positions follow the computed ones.
            num_lookahead_tokens: extra slots reserved past them (speculative decoding).
            new_computed_blocks: prefix-cache hits from `get_computed_blocks` (new request only).

        Returns: the index of the first table entry that changed since the last call returned
        (== old table length when only appends happened or nothing changed), or None if the
        device pool has no room — then nothing was changed but the release of blocks that slid
        out of the window (`_free_slid_out`). A shared, partly filled block about to be written
        is replaced by a private copy (copy-on-write); the pair appears in
        `take_blocks_to_copy()`.
        """
        bs = self.block_size
        table = self.block_tables.get(request_id)
        if table is None:
            table = []
        elif not new_computed_blocks:
            if self.sliding_window:
                self._free_slid_out(request_id, table, num_computed_tokens)
            # Fast path (most decodes): the slots exist, the written block is private, and no
            # block becomes full, so nothing changes.
            end = num_computed_tokens + num_new_tokens
            write_idx = num_computed_tokens // bs
            if (end + num_lookahead_tokens <= len(table) * bs and write_idx < len(table)
                    and table[write_idx].ref_cnt == 1
                    and (not self.enable_prefix_caching
                         or end // bs <= self._num_cached.get(request_id, 0))):
                return self._unreported.pop(request_id, len(table))
        num_computed = num_computed_tokens + len(new_computed_blocks) * bs
        needed = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, bs)
        num_existing = len(table) + len(new_computed_blocks)
        write_idx = num_computed // bs
        cow = write_idx < len(table) and table[write_idx].ref_cnt > 1
        num_alloc = max(0, needed - num_existing) + cow
        if num_alloc:
            reviving = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            if num_alloc > self.pool.num_free_blocks - reviving:
                return None
        first_changed = min(len(table), self._unreported.pop(request_id, len(table)))
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            table.extend(new_computed_blocks)
            self._num_cached[request_id] = len(table)
            if self.sliding_window:        # a long cached prefix: keep only its window
                self._free_slid_out(request_id, table, num_computed)
                first_changed = min(first_changed, self._unreported.pop(request_id, 0))
        if cow:
            old = table[write_idx]
            new = self.pool.allocate(1)[0]
            table[write_idx] = new
            self.pool.free([old])
            if num_computed % bs:
                self._copies.append((old.block_id, new.block_id))
            first_changed = min(first_changed, write_idx)
            num_alloc -= 1
        if num_alloc:
            table.extend(self.pool.allocate(num_alloc))
        self.block_tables[request_id] = table
        if self.enable_prefix_caching:
            self._cache_full_blocks(request_id, table, token_ids, num_computed + num_new_tokens,
                                    extra_keys)
        return first_changed

    def _free_slid_out(self, request_id: str, table: list[KVCacheBlock],
                       num_computed: int) -> None:
        """Free the table's blocks wholly before position `num_computed - W + 1` (no query
        from `num_computed` on reads them) and put the null block in their entries; the first
        such entry is remembered for the next successful `allocate_slots` to report. Done
        whether or not that allocation succeeds: the freed blocks are never read again."""
        done = self._skipped.get(request_id, 0)
        upto = min((num_computed - self.sliding_window + 1) // self.block_size, len(table))
        if upto <= done:
            return
        self.pool.free(table[done:upto])
        table[done:upto] = [self.null_block] * (upto - done)
        self.num_window_freed += upto - done
        self._skipped[request_id] = upto
        self._unreported[request_id] = min(self._unreported.get(request_id, done), done)

    def _live(self, request_id: str, table: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """The table without its leading null entries."""
        return table[self._skipped.get(request_id, 0):]

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """Copy-on-write pairs `(src_block_id, dst_block_id)` since the last call."""
        copies, self._copies = self._copies, []
        return copies

    def fork(self, parent_id: str, child_id: str, num_computed_tokens: int) -> None:
        """Give `child_id` the parent's blocks that hold computed tokens, shared by reference.

        A later write into the shared, partly filled last block copies it first (copy-on-write).

        Raises: KVCacheError if the child already holds blocks.
        """
        if self.holds_blocks(child_id):
            raise KVCacheError(f"fork: request {child_id!r} already holds blocks")
        shared = self.block_tables.get(parent_id, [])[:cdiv(num_computed_tokens, self.block_size)]
        skipped = min(self._skipped.get(parent_id, 0), len(shared))
        self.pool.touch(shared[skipped:])
        if skipped:
            self._skipped[child_id] = skipped
        self.block_tables[child_id] = list(shared)
        self._num_cached[child_id] = min(self._num_cached.get(parent_id, 0), len(shared))
        if parent_id in self._hashes:
            self._hashes[child_id] = list(self._hashes[parent_id][:len(shared)])

    # ----------------------------------------------------------------- free and swap
    def free(self, request_id: str, keep_hashes: bool = False) -> None:
        """Release every block the request holds, on the device and in the swap pool.

        `keep_hashes=True` keeps the memo of its block hashes (the request will come back after
        a recompute preemption).

        Raises: KVCacheError if the request holds no blocks (a double free).
        """
        table = self.block_tables.pop(request_id, None)
        cpu = self.cpu_tables.pop(request_id, None)
        if table is None and cpu is None:
            raise KVCacheError(f"free: request {request_id!r} holds no blocks")
        if table is not None:
            self.pool.free(self._live(request_id, table))
        if cpu is not None:
            self.cpu_pool.free(self._live(request_id, cpu))
        self._num_cached.pop(request_id, None)
        self._skipped.pop(request_id, None)
        self._unreported.pop(request_id, None)
        if not keep_hashes:
            self._hashes.pop(request_id, None)

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Free the request's trailing device blocks beyond the `cdiv(num_tokens, block_size)`
        that hold its first `num_tokens` tokens: the slots of rejected speculative drafts. Those
        blocks never hold a full block of verified tokens, so none is in the prefix cache.
        Returns the number of blocks freed (0 for a request without a device table)."""
        table = self.block_tables.get(request_id)
        keep = cdiv(num_tokens, self.block_size)
        if table is None or len(table) <= keep:
            return 0
        extra = table[keep:]
        del table[keep:]
        self.pool.free(extra)
        return len(extra)

    def forget(self, request_id: str) -> None:
        """Drop per-request memo state of a request that holds no blocks (finished while waiting)."""
        self._hashes.pop(request_id, None)
        self._num_cached.pop(request_id, None)

    def can_swap_out(self, request_id: str) -> bool:
        """Whether the CPU pool has room for all of the request's device blocks."""
        live = self._live(request_id, self.block_tables.get(request_id, []))
        return self.cpu_pool is not None and self.cpu_pool.num_free_blocks >= len(live)

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's device blocks to the CPU pool.

        Returns: `(device_block_id, cpu_block_id)` pairs for the runner to copy before it reuses
        the device blocks, or None (nothing changed) if the CPU pool has no room.
        """
        if not self.can_swap_out(request_id):
            return None
        table = self.block_tables.pop(request_id)
        live = self._live(request_id, table)
        cpu = self.cpu_pool.allocate(len(live))
        self.pool.free(live)
        skipped = len(table) - len(live)      # null entries stay null (the null block)
        self.cpu_tables[request_id] = [self.null_block] * skipped + cpu
        self._num_cached.pop(request_id, None)
        self._unreported.pop(request_id, None)     # a swap-in reports its whole table
        return [(g.block_id, c.block_id) for g, c in zip(live, cpu)]

    def swap_in(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                num_new_tokens: int, num_lookahead_tokens: int = 0,
                extra_keys: Hashable = None) -> list[tuple[int, int]] | None:
        """Bring a swapped request back to the device with room for its next tokens.

        Returns: `(cpu_block_id, device_block_id)` pairs, or None (nothing changed) if the device
        pool cannot hold the table plus the new slots.
        """
        cpu = self.cpu_tables[request_id]
        bs = self.block_size
        skipped = self._skipped.get(request_id, 0)
        needed = max(len(cpu), cdiv(num_computed_tokens + num_new_tokens + num_lookahead_tokens,
                                    bs)) - skipped
        if needed > self.pool.num_free_blocks:
            return None
        live = self.pool.allocate(needed)
        del self.cpu_tables[request_id]
        self.cpu_pool.free(cpu[skipped:])
        table = self.block_tables[request_id] = [self.null_block] * skipped + live
        if self.enable_prefix_caching:
            self._cache_full_blocks(request_id, table, token_ids,
                                    num_computed_tokens + num_new_tokens, extra_keys)
        return [(c.block_id, g.block_id) for c, g in zip(cpu[skipped:], live)]

    def reset_prefix_cache(self) -> int:
        """Drop cached content of every free block (see `BlockPool.reset_prefix_cache`)."""
        return self.pool.reset_prefix_cache()


__all__ = ["KVCacheManager", "KVCacheError", "cdiv"]
