"""GLM-5's latent attention and DSA indexer in Triton (kernels/latent_attention_triton.py, the cuda
op set's latent_attention and dsa_select) against the torch op set's (kernels/latent_attention.py),
bit for bit: without a GPU in Triton's interpreter, on small shapes (GLM-5's widths at a decode
row or two); tables out of order, ties in the indexer, rows alone == in the batch."""
from kernel_inputs import DEVICE  # first: sets TRITON_INTERPRET without a GPU

import pytest
import torch

from latent_cases import GLM5, ODD, TINY, make_case, single_rows
from tensorfold.kernels import latent_attention as ref
from tensorfold.kernels import latent_attention_triton as tri

SCALE = 0.0721


@pytest.mark.parametrize("shape,runs,top_k", [(TINY, [(0, 13), (30, 1), (6, 3)], 6),
                                               (ODD, [(0, 9), (17, 1)], 5),
                                               (GLM5, [(40, 1), (3, 1)], 16)], ids=["tiny", "odd", "glm5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_triton_gives_the_references_bits(shape, runs, top_k, dtype):
    cache, batch, query, index_q, weights = make_case(shape, runs, seed=top_k, dtype=dtype, device=DEVICE)
    index_scale = shape.index_dim ** -0.5
    want_sel = ref.dsa_select(index_q, weights, cache, batch, index_scale, top_k)
    got_sel = tri.dsa_select(index_q, weights, cache, batch, index_scale, top_k)
    assert want_sel is not None and got_sel.dtype == torch.int32 and torch.equal(got_sel, want_sel)
    for selection in (None, want_sel):
        want = ref.attention_by_sequence(query, cache, batch, SCALE, selection)
        assert torch.equal(tri.latent_attention(query, cache, batch, SCALE, selection), want)


def test_a_row_alone_gets_its_bits_in_the_batch():
    cache, batch, query, index_q, weights = make_case(TINY, [(0, 10), (21, 1)], seed=9, device=DEVICE)
    selection = tri.dsa_select(index_q, weights, cache, batch, 0.25, 4)
    whole = tri.latent_attention(query, cache, batch, SCALE, selection)
    for r, alone in single_rows(batch, TINY.block_size):
        sel = tri.dsa_select(index_q[r:r + 1], weights[r:r + 1], cache, alone, 0.25, 4)
        if sel is not None:
            assert torch.equal(sel[0], selection[r])
        assert torch.equal(tri.latent_attention(query[r:r + 1], cache, alone, SCALE, sel)[0], whole[r])
