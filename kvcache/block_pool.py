"""Block pool: who owns each physical KV-cache block, and which full blocks are cached by content.

Owns: one `KVCacheBlock` per physical block id, its reference count, the free queue (which
doubles as the LRU eviction order of cached blocks), and the map from a full block's content hash
to the block that holds it (automatic prefix caching).

In: block counts to allocate, blocks to reference or release, (hash, token ids) to register.
Out: `KVCacheBlock` objects; ids only are what leaves `kvcache/` for the model runner.

Pure Python, no torch: the physical tensors live with the model runner and are indexed by
`block_id`.

Prefix-caching scheme (vLLM automatic prefix caching, as in nano-vllm and vLLM v1
`kv_cache_utils.hash_block_tokens`): a full block is keyed by
`hash((parent_hash, token_ids, extra_keys))`, chained from a root that folds in the request's
extra keys (an adapter id, a cache salt), so two blocks match only if their whole prefix matches.
Token ids are stored on the block and re-checked on a hit, so a hash collision can never serve
another prompt's cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence


class KVCacheError(RuntimeError):
    """Raised when the block bookkeeping is used wrongly (double free, free of an unowned block).

    Such a call means a bug in the caller; the pool's state is left unchanged.
    """


ROOT_HASH = hash("continuum-prefix-root")


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int],
                      extra_keys: Hashable = None) -> int:
    """Content hash of one full block, chained on its parent block's hash.

    Args:
        parent_hash: hash of the previous block of the same sequence, or None for the first block.
        token_ids: the block's `block_size` token ids.
        extra_keys: anything else that changes the K/V for the same tokens (adapter id, salt);
            only the first block folds it in, the chain carries it to the rest.

    Returns: a Python int. Equal prefixes give equal hashes within one process; collisions are
    possible and are caught by the token re-check in `BlockPool.lookup`.
    """
    if parent_hash is None:
        parent_hash = hash((ROOT_HASH, extra_keys))
    return hash((parent_hash, tuple(token_ids)))


class KVCacheBlock:
    """One physical block: its id, how many block tables reference it, and its cache key.

    `block_hash` and `token_ids` are set only while the block is registered in the prefix cache
    (it is full and its K/V is, or in this step will be, computed).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """A fixed set of `num_blocks` blocks with reference counts and an LRU-evicted prefix cache.

    A block is *free* when its reference count is 0. Free blocks that hold a cached prefix stay in
    the hash map and can be revived by a later hit until they are handed out again; the free
    queue hands out uncached blocks first, then cached ones least recently freed first.

    Invariant: `num_free_blocks + num_used_blocks == num_blocks`, where used means ref_cnt > 0.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Free queue: front = next to hand out. Values unused; OrderedDict gives O(1) removal.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached or not (all of them can be handed out)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one block table."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or free-but-revivable)."""
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take `n` free blocks (evicting their cached content) and reference each once.

        Raises: KVCacheError if fewer than `n` blocks are free (callers check first).
        """
        if n > len(self._free):
            raise KVCacheError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block (a prefix-cache hit or a fork), reviving free ones."""
        free = self._free
        for block in blocks:
            if block.ref_cnt == 0:
                del free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 becomes free.

        Pass a request's blocks in table order: they are queued for eviction tail first, so a
        long prefix outlives its own suffix in the cache. Uncached blocks are queued at the front
        (handed out before any cached block).

        Raises: KVCacheError, before changing anything, if a block is already free (double free).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise KVCacheError(f"double free of block {block.block_id}")
        free = self._free
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = None
                if block.block_hash is None:
                    free.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> KVCacheBlock | None:
        """The cached block with this hash *and* these token ids, or None."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache(self, block: KVCacheBlock, block_hash: int, token_ids: Sequence[int]) -> bool:
        """Register a full, referenced block under `block_hash`.

        Returns False (and leaves the block uncached) when caching is off, the block is already
        cached, or another block already holds this hash (a duplicate computed concurrently).
        """
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block
        return True

    def _uncache(self, block: KVCacheBlock) -> None:
        del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that is free; returns how many were dropped.

        Used after a failed forward pass, when cached-but-uncomputed blocks cannot be trusted.
        """
        dropped = 0
        for block in list(self._cached.values()):
            if block.ref_cnt == 0:
                self._uncache(block)
                self._free.move_to_end(block.block_id, last=False)
                dropped += 1
        return dropped
