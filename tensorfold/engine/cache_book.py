"""The cache as the engine speaks of it: blocks and counts, never tensors.

Every layer's cache kind (models/cache.py) is indexed by the same block ids, so one block table
per request serves them all; the backend sized the blocks from the layers' specs. What a round
leaves in the cache changes in three ways, each an operation here, so that a kind whose state
is not a count (a recurrent state, restored from a snapshot) plugs in without touching the
scheduler or the engine:

    rollback(req, n)         the last n computed positions were rejected drafts: forget them
    resume(req, blocks, ...) admission found a cached prefix: the request starts after it
    release(req)             preemption or the end: the blocks go back (full ones stay cached)

For paged K/V each is a count: positions past num_computed_tokens are never read, and a hit's
blocks hold exactly what a fresh prefill writes. A recurrent state (models/cache.RecurrentState)
is kept per block, the state after the block's last computed position, so a request can resume
only where a block ends (resume_at_blocks): a rollback rewinds to the boundary at or before the
first rejected position, and the accepted positions after it are computed again in the next
round (bitwise what they were: the forward is a pure function of the tokens). A prefix hit is
already whole blocks, and release/replay start over from blocks too.
"""
from tensorfold.engine.block_pool import BlockPool
from tensorfold.engine.request import Request


class CacheBook:
    def __init__(self, pool: BlockPool, resume_at_blocks: bool = False, recompute_last_hit: bool = False):
        self.pool = pool
        self.resume_at_blocks = resume_at_blocks
        # The MTP drafter's K/V at a block's last slot holds the row of the token after the block,
        # which the block's hash does not cover: a hit's last block is computed again (its own
        # block, the cached one let go), so every reused slot's next token is a matched one.
        self.recompute_last_hit = recompute_last_hit

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def rollback(self, req: Request, num_tokens: int) -> None:
        req.num_computed_tokens -= num_tokens
        if num_tokens and self.resume_at_blocks:
            req.num_computed_tokens -= req.num_computed_tokens % self.pool.block_size

    def resume(self, req: Request, block_ids: list[int], block_hashes: list[bytes]) -> None:
        if self.recompute_last_hit and block_ids:
            self.pool.free(block_ids[-1:])
            block_ids, block_hashes = block_ids[:-1], block_hashes[:-1]
        req.block_ids, req.block_hashes = block_ids, block_hashes
        req.num_computed_tokens = len(block_ids) * self.pool.block_size

    def reserve(self, req: Request, num_tokens: int) -> int:
        """Blocks for up to num_tokens positions where free ones exist (no preemption); returns
        how many positions req's blocks now cover, at most num_tokens."""
        needed = min(self.pool.blocks_for(num_tokens) - len(req.block_ids), self.pool.num_free)
        if needed > 0:
            req.block_ids += self.pool.allocate(needed)
        return min(num_tokens, len(req.block_ids) * self.pool.block_size)

    def release(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids, req.block_hashes = [], []
