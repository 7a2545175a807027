"""backends/huge_pages.py: the cpu backend's packed weights copied into memory advised for 2 MiB
pages. A placed tensor must be its original bit for bit, cache-line aligned, in a mapping the
kernel has marked for huge pages (VmFlags `hg` in /proc/self/smaps: the advice is recorded
whether or not a huge page was free to back it), and the model's packed weights must live there.
"""
import os

import pytest
import torch

from tensorfold.backends import huge_pages, native_problem

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on this OS")


def advised_for_huge_pages(t: torch.Tensor) -> bool:
    """Whether the mapping holding t's first byte carries the MADV_HUGEPAGE flag."""
    address, mapping = t.data_ptr(), None
    with open(f"/proc/{os.getpid()}/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                mapping = lo <= address < hi
            elif head == "VmFlags:" and mapping:
                return "hg" in line.split()[1:]
    return False


@needs_thp
def test_placed_tensors_are_copies_in_advised_aligned_memory(draw):
    arena = huge_pages.Arena()
    small = [draw.randn(n, dtype=dtype) for n, dtype in [(5, torch.float32), (333, torch.bfloat16), (4096, torch.float32)]]
    placed = [arena.place(t) for t in small]
    for t, p in zip(small, placed):
        assert p.dtype == t.dtype and p.shape == t.shape and p.is_contiguous()
        assert torch.equal(p.view(torch.uint8) if p.dtype == torch.uint8 else p, t), str(draw)
        assert p.data_ptr() % huge_pages.ALIGN == 0 and p.data_ptr() != t.data_ptr()
        assert advised_for_huge_pages(p)
    # small tensors go back to back in one region, from its 2 MiB-aligned start
    assert placed[0].data_ptr() % huge_pages.PAGE == 0
    assert placed[1].data_ptr() == placed[0].data_ptr() + huge_pages.ALIGN
    big = arena.place(torch.zeros(huge_pages.REGION // 4 + 1))  # over a region: a mapping of its own
    assert big.data_ptr() % huge_pages.PAGE == 0 and advised_for_huge_pages(big)
    small[0].fill_(7.0)  # a copy: the original's later writes do not reach it
    assert not torch.equal(placed[0], small[0])


def test_without_huge_pages_a_tensor_stays_where_it_is(draw):
    arena = huge_pages.Arena()
    arena.enabled = False
    t = draw.randn(100)
    assert arena.place(t) is t


def test_a_refused_mapping_leaves_tensors_where_they_are(draw, monkeypatch, caplog):
    arena = huge_pages.Arena()
    arena.enabled = True

    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    t = draw.randn(100)
    with caplog.at_level("WARNING", logger="tensorfold.backends"):
        assert arena.place(t) is t
    assert not arena.enabled and "ordinary pages" in caplog.text
    u = draw.randn(3)
    assert arena.place(u) is u and len(calls) == 1  # later tensors are not tried again


@needs_thp
@pytest.mark.skipif(native_problem() is not None, reason=str(native_problem()))
def test_the_compiled_op_sets_packed_weights_live_in_huge_pages(draw):
    from tensorfold.backends import native_ops
    from tensorfold.kernels import reference
    w, x = draw.randn(40, 70, dtype=torch.bfloat16), draw.randn(3, 70, dtype=torch.bfloat16)
    packed = native_ops.Linear.of(w)
    assert advised_for_huge_pages(packed.single.data)
    assert torch.equal(packed(x), reference.linear(x, w)), str(draw)
