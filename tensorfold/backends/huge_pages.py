"""Memory in 2 MiB pages for the cpu backend's packed GEMM weights (Linux transparent huge pages).

A decode step reads every weight of the model once, front to back. In 4 KiB pages that is a TLB
miss every 4 KiB (the default model's 212 MiB of bfloat16 layer weights: some 54,000 page walks
per token); in 2 MiB pages about a hundred. One-row GEMMs over the default model's 30 layers
ran 7.2-7.6 ms against 8.2-8.6 ms from ordinary pages (docs/benchmarks.md). The weights are
copied as they are: only their addresses change, never a bit of any result.

Tensors are placed back to back (64-byte aligned) in 32 MiB regions, each mapped privately and
advised MADV_HUGEPAGE; a larger tensor gets a region of its own. A region lives as long as any
tensor placed in it. Where the OS has no huge pages to give (not Linux, THP set to never), or refuses the mapping or
the advice, `place` returns its tensor unchanged (the last says so once in the log).
"""
import logging
import mmap

import torch

log = logging.getLogger("tensorfold.backends")

PAGE = 2 << 20       # a huge page
REGION = 32 << 20    # tensors up to this size share regions
ALIGN = 64           # a cache line: every placed tensor starts on one


def available() -> bool:
    """Whether anonymous private memory can be backed by transparent huge pages here."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _region(nbytes: int) -> torch.Tensor:
    """A byte tensor of nbytes rounded up to whole huge pages, 2 MiB-aligned, advised MADV_HUGEPAGE
    (pages are backed when first written: a region's unused tail costs no memory)."""
    size = -(-nbytes // PAGE) * PAGE
    buf = mmap.mmap(-1, size + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # keeps buf (the mapping) alive
    start = -whole.data_ptr() % PAGE
    buf.madvise(mmap.MADV_HUGEPAGE, start, size)
    return whole[start:start + size]


class Arena:
    """Places tensors in huge-page regions: `place(t)` returns a copy of t living there, `empty(n)`
    n bytes there to be written."""

    def __init__(self):
        self.enabled = available()
        self._region: torch.Tensor | None = None
        self._used = 0

    def place(self, t: torch.Tensor) -> torch.Tensor:
        if not self.enabled or t.device.type != "cpu":
            return t
        block = self._block(t.numel() * t.element_size())
        if block is None:
            return t
        out = block.view(t.dtype).view(t.shape)
        out.copy_(t)
        return out

    def empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialized uint8 tensor of nbytes in huge pages (in ordinary memory where there are
        none), for a packer that writes its result in place: nothing is copied."""
        block = self._block(nbytes) if self.enabled else None
        return torch.empty(nbytes, dtype=torch.uint8) if block is None else block

    def _block(self, nbytes: int) -> torch.Tensor | None:
        try:
            if nbytes > REGION:
                block = _region(nbytes)
            else:
                if self._region is None or self._used + nbytes > REGION:
                    self._region, self._used = _region(REGION), 0
                block = self._region[self._used:]
                self._used += -(-nbytes // ALIGN) * ALIGN
        except OSError as e:  # the mapping or the advice refused (a container, a strict limit)
            log.warning("huge pages: %s; the packed weights stay in ordinary pages", e)
            self.enabled = False
            return None
        return block[:nbytes]


arena = Arena()  # the process's: the packed weights of every model the cpu backend loads
