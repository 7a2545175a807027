// token_bitmask: verify_triton.apply_token_bitmask_ref, bitwise: logits with -inf where the
// row's bit is clear (xgrammar's layout; tokens past the bitmask's words are not allowed).
// One thread per (token, row). Output: masked [num_rows, vocab] float32.
uint t = thread_position_in_grid.x;
uint row = thread_position_in_grid.y;
if (t >= uint(vocab) || row >= uint(num_rows)) return;
ulong at = ulong(row) * ulong(vocab) + t;
bool allowed = (int(t) >> 5) < mask_words
    && ((uint(bitmask[ulong(row) * ulong(mask_words) + (t >> 5)]) >> (t & 31)) & 1u);
masked[at] = allowed ? logits[at] : as_type<float>(0xFF800000u);
