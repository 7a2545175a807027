// verify_accept: grammar-masked verification's accepted lengths (verify_triton.verify_ref),
// bitwise. A path owns rows path_starts[p] .. path_starts[p + 1]; row j carries the draft checked
// at its position (-1: none, the bonus row) and the keyed draw on its grammar-masked logits
// (sampler_* with the rows' bitmasks). One thread per path: the drafts accepted up to the first
// row without a draft or whose draw differs from its draft.
// Output: accepted [num_paths] int32.
uint path = thread_position_in_grid.x;
if (path >= uint(num_paths)) return;
int start = path_starts[path], end = path_starts[path + 1];
int n = 0;
while (start + n < end && drafts[start + n] >= 0 && draws[start + n] == drafts[start + n]) n += 1;
accepted[path] = n;
