"""The cache as the engine speaks of it: blocks and counts per cache group, never tensors.

The layers' caches are grouped behind block tables (models/cache.layer_groups, vLLM v1's
KV-cache groups): group 0 keeps every position (full attention, recurrent and latent kinds), each
further group is the sliding-window layers of one window. Each group has its own BlockPool and a
request one table per group (req.block_ids for group 0, req.group_block_ids for the others), all
indexed by position: table[j] holds positions [j * block_size, (j + 1) * block_size). What a
round leaves in the cache changes in a few ways, each an operation here, so that a kind whose
state is not a count (a recurrent state, restored from a snapshot) or a window that lets blocks
go plugs in without touching the scheduler or the engine:

    rollback(req, n)         the last n computed positions were rejected drafts: forget them
    lookup/resume(req, hit)  admission found a cached prefix: the request starts after it
    slide(req)               before a round: a sliding group lets go of the blocks no row reads
    release(req)             preemption or the end: the blocks go back (full ones stay cached)

For paged K/V each is a count: positions past num_computed_tokens are never read, and a hit's
blocks hold exactly what a fresh prefill writes. A recurrent state (models/cache.RecurrentState)
is kept per block, the state after the block's last computed position, so a request can resume
only where a block ends (resume_at_blocks): a rollback rewinds to the boundary at or before the
first rejected position, and the accepted positions after it are computed again in the next
round (bitwise what they were: the forward is a pure function of the tokens). A prefix hit is
already whole blocks, and release/replay start over from blocks too.

Sliding windows. A row at position p reads keys p - window + 1 ... p, so a round starting at s
reads nothing before s - window + 1; slide() frees the blocks wholly before that, counted from
s rounded down to its block (a recurrent rewind restarts at most there), and marks them
NULL_BLOCK in the table. A freed block keeps its prefix-cache hash until evicted. The exact rule
for a prefix hit: n blocks are a hit only where every full group holds blocks 0..n-1 and every
sliding group still holds the blocks its window reads from position n * block_size on (the
rest are NULL_BLOCK: never read); otherwise the hit is shortened until they are, down to none,
and the request recomputes. A hit so resumes from exactly the K/V a fresh prefill would hold in
the blocks it reads. Preemption releases every group; the replay recomputes from position 0.
"""
from dataclasses import dataclass

from tensorfold.engine.block_pool import NULL_BLOCK, BlockPool, chain_hash, lane_blocks
from tensorfold.engine.request import Request


@dataclass
class Hit:
    """A cached prefix found at admission: a table per group (its blocks referenced) and the
    chain hashes of its blocks."""
    tables: list[list[int]]
    hashes: list[bytes]


class CacheBook:
    def __init__(self, pools: BlockPool | list[BlockPool], windows: list[int | None] | None = None,
                 resume_at_blocks: bool = False, recompute_last_hit: bool = False):
        """pools: one per cache group, group 0's first; windows: each group's (None: keeps every
        position; default: all None)."""
        self.pools = [pools] if isinstance(pools, BlockPool) else list(pools)
        self.windows = list(windows) if windows is not None else [None] * len(self.pools)
        assert len(self.windows) == len(self.pools) and len({p.block_size for p in self.pools}) == 1
        self.pool = self.pools[0]
        self.resume_at_blocks = resume_at_blocks
        # The MTP drafter's K/V at a block's last slot holds the row of the token after the block,
        # which the block's hash does not cover: a hit's last block is computed again (its own
        # block, the cached one let go), so every reused slot's next token is a matched one.
        self.recompute_last_hit = recompute_last_hit

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def tables(self, req: Request) -> list[list[int]]:
        """req's block table of each group, group 0's first (the lists themselves)."""
        if len(req.group_block_ids) != len(self.pools) - 1:
            req.group_block_ids = [[] for _ in self.pools[1:]]
        return [req.block_ids, *req.group_block_ids]

    # -- counts -----------------------------------------------------------------------------

    def first_read(self, g: int, position: int) -> int:
        """The first block of group g that rows from `position` on read (0 for a full group)."""
        window = self.windows[g]
        if window is None:
            return 0
        return max(0, (position - position % self.block_size - window + 1) // self.block_size)

    def blocks_to_hold(self, g: int, num_tokens: int, max_chunk: int) -> int:
        """The most blocks group g holds for a request of num_tokens computed in rounds of up to
        max_chunk positions."""
        blocks, window = self.pool.blocks_for(num_tokens), self.windows[g]
        return blocks if window is None else min(blocks, lane_blocks(window, self.block_size, max_chunk))

    def fits(self, num_tokens: int, max_chunk: int) -> bool:
        """Whether one request of num_tokens fits each group's whole pool."""
        return all(self.blocks_to_hold(g, num_tokens, max_chunk) <= pool.num_blocks
                   for g, pool in enumerate(self.pools))

    def short(self, hit: Hit, num_tokens: int, max_chunk: int) -> bool:
        """Whether some group lacks the free blocks a request admitted with `hit` holds for
        num_tokens."""
        return any(self.blocks_to_hold(g, num_tokens, max_chunk) - _held(table) > pool.num_free
                   for g, (pool, table) in enumerate(zip(self.pools, hit.tables)))

    def can_grow(self, req: Request, num_tokens: int) -> bool:
        return all(self.pool.blocks_for(num_tokens) - len(table) <= pool.num_free
                   for pool, table in zip(self.pools, self.tables(req)))

    def num_held(self, req: Request) -> list[int]:
        """Blocks req holds in each group."""
        return [_held(table) for table in self.tables(req)]

    # -- operations -------------------------------------------------------------------------

    def grow(self, req: Request, num_tokens: int) -> None:
        """Blocks for positions up to num_tokens in every group (can_grow said they are free)."""
        for pool, table in zip(self.pools, self.tables(req)):
            needed = pool.blocks_for(num_tokens) - len(table)
            if needed > 0:
                table += pool.allocate(needed)

    def slide(self, req: Request) -> None:
        """Before a round from req.num_computed_tokens: each sliding group lets go of the blocks
        no row from there on reads (the freed ones are a prefix of the table)."""
        for g, table in enumerate(self.tables(req)):
            keep = min(self.first_read(g, req.num_computed_tokens), len(table))
            first = keep
            while first > 0 and table[first - 1] != NULL_BLOCK:
                first -= 1
            if first < keep:
                self.pools[g].free(table[first:keep])
                table[first:keep] = [NULL_BLOCK] * (keep - first)

    def rollback(self, req: Request, num_tokens: int) -> None:
        req.num_computed_tokens -= num_tokens
        if num_tokens and self.resume_at_blocks:
            req.num_computed_tokens -= req.num_computed_tokens % self.pool.block_size

    def lookup(self, token_ids: list[int], max_blocks: int) -> Hit:
        """The longest usable cached prefix of token_ids, at most max_blocks blocks (the module
        docstring's rule), its blocks referenced for the caller (resume() or drop())."""
        bs, full = self.block_size, [g for g, w in enumerate(self.windows) if w is None]
        hashes, found, parent = [], [], b""
        for i in range(min(max_blocks, len(token_ids) // bs)):
            parent = chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
            row = [pool.cached(parent) for pool in self.pools]
            if any(row[g] is None for g in full):
                break
            hashes.append(parent)
            found.append(row)
        n = len(hashes)
        while n > 0 and not self._windows_cached(found, self._resumed(n)):
            n -= 1
        n = self._resumed(n)
        tables = []
        for g, pool in enumerate(self.pools):
            first = self.first_read(g, n * bs)
            tables.append([NULL_BLOCK] * first + [found[j][g] for j in range(first, n)])
            pool.take(tables[-1])
        return Hit(tables, hashes[:n])

    def _resumed(self, num_hit: int) -> int:
        """Blocks a request resumes after from num_hit cached ones (the MTP drafter's rule)."""
        return max(0, num_hit - 1) if self.recompute_last_hit else num_hit

    def _windows_cached(self, found: list[list[int | None]], n: int) -> bool:
        """Whether every sliding group holds what rows from block n on read in blocks 0..n-1."""
        return all(found[j][g] is not None for g, w in enumerate(self.windows) if w is not None
                   for j in range(self.first_read(g, n * self.block_size), n))

    def drop(self, hit: Hit) -> None:
        """A hit not used (admission waits): its references go back."""
        for pool, table in zip(self.pools, hit.tables):
            pool.free(table)

    def resume(self, req: Request, hit: Hit) -> None:
        req.block_ids, req.group_block_ids = hit.tables[0], hit.tables[1:]
        req.block_hashes = list(hit.hashes)
        req.num_computed_tokens = len(hit.hashes) * self.pool.block_size

    def reserve(self, req: Request, num_tokens: int) -> int:
        """Group 0's blocks (the MTP layer's) for up to num_tokens positions where free ones exist
        (no preemption); returns how many positions req's blocks now cover, at most num_tokens."""
        needed = min(self.pool.blocks_for(num_tokens) - len(req.block_ids), self.pool.num_free)
        if needed > 0:
            req.block_ids += self.pool.allocate(needed)
        return min(num_tokens, len(req.block_ids) * self.pool.block_size)

    def register(self, req: Request, token_ids: list, num_final: int) -> None:
        """Hash req's full blocks among the first num_final of token_ids (its tokens as the prefix
        cache keys them) into every group's prefix cache (the chain once, req.block_hashes,
        extended in place), up to req.num_hashable_tokens."""
        if req.num_hashable_tokens is not None:
            num_final = min(num_final, req.num_hashable_tokens)
        first = len(req.block_hashes)
        tables = self.tables(req)
        self.pool.register(tables[0], token_ids, num_final, req.block_hashes)
        for pool, table in zip(self.pools[1:], tables[1:]):
            pool.cache_blocks(table[first:len(req.block_hashes)], req.block_hashes[first:])

    def release(self, req: Request) -> None:
        for pool, table in zip(self.pools, self.tables(req)):
            pool.free(table)
        req.block_ids, req.block_hashes = [], []
        req.group_block_ids = [[] for _ in self.pools[1:]]

    def forget_cached(self) -> None:
        for pool in self.pools:
            pool.forget_cached()


def _held(table: list[int]) -> int:
    return sum(1 for block in table if block != NULL_BLOCK)
