// sampler_chunk_max: the largest drawable logit of each chunk of a row (sampling/sampler.py:
// m = max z = max(x) / T, as the Triton sampler takes it). One thread per (chunk, row), a loop
// over its TF_SAMPLER_CHUNK tokens; a token is drawable when its bit is set in the row's bitmask
// (xgrammar's layout, bit t % 32 of word t / 32; tokens past the words are not allowed; HAS_MASK
// false: all allowed) and its logit is not -inf. -inf where the chunk has none.
// Output: chunk_max [num_rows, num_chunks] float32.
uint chunk = thread_position_in_grid.x;
uint row = thread_position_in_grid.y;
if (chunk >= uint(num_chunks) || row >= uint(num_rows)) return;
float best = as_type<float>(0xFF800000u);
int start = int(chunk) * TF_SAMPLER_CHUNK;
int end = start + TF_SAMPLER_CHUNK < vocab ? start + TF_SAMPLER_CHUNK : vocab;
for (int t = start; t < end; ++t) {
  float x = logits[ulong(row) * ulong(vocab) + t];
  bool allowed = !HAS_MASK || ((t >> 5) < mask_words
      && ((uint(bitmask[ulong(row) * ulong(mask_words) + (t >> 5)]) >> (t & 31)) & 1u));
  if (allowed && x > best) best = x;
}
chunk_max[ulong(row) * ulong(num_chunks) + chunk] = best;
