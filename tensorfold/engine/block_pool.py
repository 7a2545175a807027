"""The KV cache's blocks as plain bookkeeping: which are free, who holds each one.

Block ids index the first dimension of every layer's cache tensor. Reference counts let a later
prefix cache share blocks between requests; a block returns to the free list when its count
reaches zero. The pool never touches tensors.
"""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"KV pool: asked for {count} blocks, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(count)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def free(self, block_ids: list[int]) -> None:
        for i in block_ids:
            self._refs[i] -= 1
            assert self._refs[i] >= 0, f"block {i} freed twice"
            if self._refs[i] == 0:
                self._free.append(i)
