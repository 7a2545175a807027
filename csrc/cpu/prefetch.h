// Asking the memory for data ahead of its use: hints that change when bytes are read, never a
// result. The kernels stream weights and cache rows whose addresses they know in advance, while
// the hardware prefetcher stops at every 4 KiB page.
#pragma once

#include <cstdint>

namespace tf {

// Where a prefetched line goes (__builtin_prefetch's locality): L1 (prefetcht0); L2 (prefetcht1),
// for lines needed later, without holding one of the core's few L1 fill buffers until it arrives;
// FAR (prefetcht2), the outer levels, for lines needed later still.
enum PrefetchTo { TO_L1 = 3, TO_L2 = 2, TO_FAR = 1 };

// Every cache line that bytes [p, p + bytes) touch.
template <PrefetchTo To = TO_L1>
inline void prefetch_lines(const void* p, int64_t bytes) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t line = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}; line < end; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, To);
}

}  // namespace tf
