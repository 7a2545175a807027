"""The KV cache's blocks as plain bookkeeping, with a prefix cache; never touches tensors.

Block ids index the first dimension of every layer's cache tensor. A block holding a full run
of `block_size` final tokens gets a chained hash (its tokens plus the hash of everything
before), so a later request whose prompt starts with the same tokens reuses the block instead
of recomputing it. The forward is batch- and chunk-invariant, so a reused block holds exactly
the bits a fresh prefill would write: a cached prefix never changes a reply.

Invariants:
- a block is in use (ref count > 0), or free; a free block may still be cached (hash kept);
- free blocks leave in LRU order: allocation takes the least recently freed block and evicts
  its hash; a cache hit on a free block takes it back out of the free queue;
- only blocks whose tokens are all computed and final are hashed (never drafted rows).
"""
import hashlib
from collections import OrderedDict

NULL_BLOCK = -1  # a block table's entry for a block a sliding window let go (engine/cache_book.py)


def lane_blocks(window: int, block_size: int, max_chunk: int) -> int:
    """The most blocks one request holds in a sliding group of `window` tokens while a round
    computes up to max_chunk positions: the chunk's own blocks and those still in the window of
    its first row (CacheBook.slide keeps from the block holding p - window + 1, p the round's
    first position rounded down to its block)."""
    return -(-(max_chunk + block_size - 1) // block_size) + -(-(window - 1) // block_size)


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    data = parent + b"|" + ",".join(map(str, token_ids)).encode()
    return hashlib.blake2b(data, digest_size=16).digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, max_cached_blocks: int | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_cached_blocks = num_blocks if max_cached_blocks is None else max_cached_blocks
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}                  # hash -> block id
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"KV pool: asked for {count} blocks, {len(self._free)} free")
        ids = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            self._refs[block] = 1
            ids.append(block)
        return ids

    def free(self, block_ids: list[int]) -> None:
        # Freed in reverse so a request's later blocks are evicted before its prefix.
        for block in reversed(block_ids):
            if block == NULL_BLOCK:
                continue
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"block {block} freed twice"
            if self._refs[block] == 0:
                if self._hash_of[block] is None:
                    self._free[block] = None
                    self._free.move_to_end(block, last=False)  # uncached blocks go first
                else:
                    self._free[block] = None
        self._trim_cache()

    # -- prefix cache -----------------------------------------------------------------------

    def lookup(self, token_ids: list[int], max_blocks: int) -> tuple[list[int], list[bytes]]:
        """The longest cached run of full blocks at the start of token_ids: their block ids,
        each referenced for the caller (release with free()), and their chain hashes."""
        blocks, hashes, parent = [], [], b""
        for i in range(min(max_blocks, len(token_ids) // self.block_size)):
            parent = chain_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block = self._cached.get(parent)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
        self.take(blocks)
        return blocks, hashes

    def cached(self, block_hash: bytes) -> int | None:
        """The block holding the chain hash block_hash, if cached (no reference taken)."""
        return self._cached.get(block_hash)

    def take(self, block_ids: list[int]) -> None:
        """Reference cached blocks for a request (release with free())."""
        for block in block_ids:
            if block == NULL_BLOCK:
                continue
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def register(self, block_ids: list[int], token_ids: list[int], num_final: int,
                 hashes: list[bytes]) -> None:
        """Hash the full blocks among the first num_final tokens; `hashes` is the owner's chain
        so far (one per block already registered) and is extended in place."""
        full = min(num_final // self.block_size, len(block_ids))
        first = len(hashes)
        for i in range(first, full):
            parent = hashes[-1] if hashes else b""
            hashes.append(chain_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size]))
        self.cache_blocks(block_ids[first:full], hashes[first:full])

    def cache_blocks(self, block_ids: list[int], hashes: list[bytes]) -> None:
        """Put full final blocks in the prefix cache under their chain hashes (a table's freed
        entries, NULL_BLOCK, skipped)."""
        for block, h in zip(block_ids, hashes):
            if block != NULL_BLOCK and h not in self._cached and self._hash_of[block] is None:
                self._cached[h] = block
                self._hash_of[block] = h

    def forget_cached(self) -> None:
        """Drop the whole prefix cache (the blocks' contents were lost: a rank group restarted)."""
        for block in range(self.num_blocks):
            self._forget(block)

    def _forget(self, block: int) -> None:
        h = self._hash_of[block]
        if h is not None:
            self._hash_of[block] = None
            if self._cached.get(h) == block:
                del self._cached[h]

    def _trim_cache(self) -> None:
        """Keep at most max_cached_blocks hashed blocks among the free ones (LRU first)."""
        excess = len(self._cached) - self.max_cached_blocks
        if excess <= 0:
            return
        for block in list(self._free):
            if excess <= 0:
                break
            if self._hash_of[block] is not None and self._refs[block] == 0:
                self._forget(block)
                excess -= 1
