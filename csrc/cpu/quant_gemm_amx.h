// The AMX-INT8 path, for passes of AMX_MIN_ROWS rows or more (group_rows): the block dots of 16
// rows and 16 columns in one tile multiply (tdpbssd: s8 x s8 -> int32, the codes made signed once
// per group), K the block's 32 (or a q6_k half's 16), so each C tile holds one block's dots
// c . xq, which the vpdpbusd chains reach as u . xq - offset sum xq; the terms then run per row as
// in group_vector. Built only beside the VNNI path (quant_gemm_vnni.h), whose codes, scales and
// terms it reuses.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_gemm.h"
#include "quant_gemm_common.h"
#include "quant_gemm_vnni.h"

#if defined(TF_QUANT_AMX)
#include <sys/syscall.h>
#include <unistd.h>

namespace tf {
namespace {

using namespace quant;

constexpr int64_t AMX_BLOCKS = 8;  // blocks whose dots a row tile keeps at once (8 KiB: in L1 till their terms)
static_assert(AMX_BLOCKS == SUPER_BLOCKS, "group_amx's runs are the K-quants' super-blocks");

// The tile registers, named by literals in the intrinsics (which paste them into the assembly
// text): A (the rows' codes) tmm0 and tmm1, B (the columns') tmm2 and tmm3, C (the dots) tmm4..7;
// group_amx says which block or half each holds. These are their indices in the tile config.
constexpr int A0 = 0, B0 = 2, C0 = 4;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether this process may use the tile state: Linux grants it on request (arch_prctl), once.
bool amx_granted() {
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

// A column group made ready once for all its row tiles (group_amx): its blocks' signed codes
// c = u - offset as B rows (so the tiles' dots need no offset term), and their scales.
struct alignas(64) CodeRows {
  uint8_t v[8 * 64];
};
struct alignas(64) DotTile {
  int32_t v[TILE_ROWS][GROUP];
};
// A SUPER super-block's factors (super_factors), made once per group for all its row tiles.
struct alignas(64) SuperInts {
  int32_t sc[16][GROUP];
  int32_t m_pairs[SUPER_BLOCKS / 2][GROUP];  // with a minimum: m of blocks 2p (low int16) and 2p + 1 (high)
  __m512d dd[2], dmin[2];
};
struct AmxGroup {
  uint64_t call = 0;  // which call, weight and group it was made for
  const uint8_t* packed = nullptr;
  int64_t g = -1;
  std::vector<CodeRows> codes;  // per block: its B rows
  std::vector<BlockScales> scales;  // per block (not SUPER)
  std::vector<SuperInts> supers;  // per super-block (SUPER)
  std::vector<DotTile> dots;  // per block of a run (and half): a row tile's dots
};

template <int FORM, int KIND>
void prepare_group(const Layout& L, const uint8_t* packed, int64_t g, int shift0, const int32_t* top, AmxGroup* G) {
  if (G->call == current_call && G->packed == packed && G->g == g) return;
  G->call = current_call, G->packed = packed, G->g = g;
  G->codes.resize(L.blocks);
  if constexpr (FORM == SUPER)
    G->supers.resize(L.blocks / SUPER_BLOCKS);
  else
    G->scales.resize(L.blocks);
  G->dots.resize(AMX_BLOCKS * (BLOCK / KINDS[KIND].sub));
  const __m512i topv = _mm512_loadu_si512(top);
  __m512d units[2];
  group_units(topv, shift0, units);
  const int64_t ahead = prefetch_distance(L, 0);
  for (int64_t b = 0; b < L.blocks; ++b) {
    const uint8_t* rec = streamed_record(packed, L, g, b, ahead);
    __m512i u[8];
    block_codes<FORM, KIND>(rec, L, u);
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(KINDS[KIND].offset));
    for (int q = 0; q < 8; ++q) _mm512_store_si512(G->codes[b].v + 64 * q, _mm512_sub_epi8(u[q], offset));  // mod 256
    if constexpr (FORM == SUPER) {
      if (b % SUPER_BLOCKS == 0) {
        SuperInts& si = G->supers[b / SUPER_BLOCKS];
        super_factors<KIND == Q6K>(super_head(rec, L, b), topv, shift0, si.sc, si.dd, si.dmin);
        if constexpr (KINDS[KIND].has_min)
          for (int p = 0; p < SUPER_BLOCKS / 2; ++p)  // m < 64: each fits an int16 half
            _mm512_store_si512(si.m_pairs[p], _mm512_or_si512(_mm512_load_si512(si.sc[SUPER_BLOCKS + 2 * p]),
                                                              _mm512_slli_epi32(_mm512_load_si512(si.sc[SUPER_BLOCKS + 2 * p + 1]), 16)));
      }
    } else {
      G->scales[b] = block_scales<FORM, KIND>(rec, L, topv, shift0, units);
    }
  }
}

// The tiles' shapes for a kind (tdpbssd's K: a block's 32 codes, or a q6_k half's 16): A 16 rows'
// codes, B the 16 columns' codes as K / 4 rows of 64 bytes, C their 16 x 16 int32 dots.
template <int KIND>
inline TileConfig tile_config() {
  constexpr QKind KD = KINDS[KIND];
  TileConfig cfg;
  for (int t = 0; t < 2; ++t) cfg.rows[A0 + t] = TILE_ROWS, cfg.colsb[A0 + t] = KD.sub;
  for (int t = 0; t < 2; ++t) cfg.rows[B0 + t] = KD.sub / 4, cfg.colsb[B0 + t] = 64;
  for (int t = 0; t < 4; ++t) cfg.rows[C0 + t] = TILE_ROWS, cfg.colsb[C0 + t] = 64;
  return cfg;
}

// A run's dots on the tiles: blocks [b0, b0 + blocks) of a row tile's codes (a, rows `stride`
// bytes apart) against the group's B rows, into dots (per block, per half for PER == 2). The
// tile registers are literals, so each block's choice of them is a switch; four blocks are in
// flight, each C tile stored three blocks after its multiply (halves: two C tiles a block, stored
// one block after).
template <int PER>
inline void run_dots(const AmxGroup& G, const int8_t* a, int64_t stride, int64_t b0, int64_t blocks, DotTile* dots) {
  if constexpr (PER == 1) {  // block b: A tmm0/1, B tmm2/3 by b % 2, C tmm 4 + b % 4
    for (int64_t b = 0; b < blocks + 3; ++b) {
      if (b < blocks) {
        const uint8_t* bb = G.codes[b0 + b].v;
        const int8_t* ab = a + (b0 + b) * BLOCK;
        switch (b % 4) {
          case 0: _tile_loadd(2, bb, 64); _tile_loadd(0, ab, stride); _tile_zero(4); _tile_dpbssd(4, 0, 2); break;
          case 1: _tile_loadd(3, bb, 64); _tile_loadd(1, ab, stride); _tile_zero(5); _tile_dpbssd(5, 1, 3); break;
          case 2: _tile_loadd(2, bb, 64); _tile_loadd(0, ab, stride); _tile_zero(6); _tile_dpbssd(6, 0, 2); break;
          default: _tile_loadd(3, bb, 64); _tile_loadd(1, ab, stride); _tile_zero(7); _tile_dpbssd(7, 1, 3); break;
        }
      }
      const int64_t s = b - 3;  // the block whose C tile is stored now
      if (s < 0) continue;
      switch (s % 4) {
        case 0: _tile_stored(4, dots[s].v, 64); break;
        case 1: _tile_stored(5, dots[s].v, 64); break;
        case 2: _tile_stored(6, dots[s].v, 64); break;
        default: _tile_stored(7, dots[s].v, 64); break;
      }
    }
  } else {  // halves of 16: block b's in C tmm 4, 5 (b even) or 6, 7 (b odd); A and B by half
    for (int64_t b = 0; b < blocks + 1; ++b) {
      if (b < blocks) {
        const uint8_t* bb = G.codes[b0 + b].v;
        const int8_t* ab = a + (b0 + b) * BLOCK;
        _tile_loadd(2, bb, 64);
        _tile_loadd(3, bb + 4 * 64, 64);  // quads 4-7: k 16..31
        _tile_loadd(0, ab, stride);
        _tile_loadd(1, ab + 16, stride);
        if (b % 2 == 0) {
          _tile_zero(4); _tile_dpbssd(4, 0, 2); _tile_zero(5); _tile_dpbssd(5, 1, 3);
        } else {
          _tile_zero(6); _tile_dpbssd(6, 0, 2); _tile_zero(7); _tile_dpbssd(7, 1, 3);
        }
      }
      const int64_t s = b - 1;
      if (s < 0) continue;
      if (s % 2 == 0) {
        _tile_stored(4, dots[2 * s].v, 64); _tile_stored(5, dots[2 * s + 1].v, 64);
      } else {
        _tile_stored(6, dots[2 * s].v, 64); _tile_stored(7, dots[2 * s + 1].v, 64);
      }
    }
  }
}

// Row i of the tile: its terms of the run of `blocks` blocks from b0 (their dots in dots, the
// codes signed: c . xq), added to its sums lo (columns 0-7) and hi (8-15), as group_vector's kernels
// add them.
template <int FORM, int KIND>
inline void run_terms(const AmxGroup& G, const DotTile* dots, const RowQ& row, int64_t i, int64_t b0, int64_t blocks,
                      __m512i* lo, __m512i* hi) {
  constexpr QKind KD = KINDS[KIND];
  constexpr int PER = BLOCK / KD.sub;
  if constexpr (FORM == SUPER) {  // a run is one super-block: its int32 sums, then two terms (group_super)
    const SuperInts& si = G.supers[b0 / SUPER_BLOCKS];
    __m512i dsum = _mm512_setzero_si512(), msum = dsum;
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512i d0 = _mm512_load_si512(dots[PER * b].v[i]);  // c . xq: the codes signed
      if constexpr (PER == 2) {
        const __m512i d1 = _mm512_load_si512(dots[PER * b + 1].v[i]);
        dsum = _mm512_add_epi32(dsum, _mm512_add_epi32(_mm512_mullo_epi32(d0, _mm512_load_si512(si.sc[2 * b])),
                                                       _mm512_mullo_epi32(d1, _mm512_load_si512(si.sc[2 * b + 1]))));
      } else {
        dsum = _mm512_add_epi32(dsum, _mm512_mullo_epi32(d0, _mm512_load_si512(si.sc[b])));
      }
    }
    if constexpr (KD.has_min) {  // m sum(xq) two blocks at a time: |sum(xq)| <= 32 127 fits an int16
      const int32_t* xs = row.xsum.data() + b0;
      for (int p = 0; p < SUPER_BLOCKS / 2; ++p) {
        const int32_t pair = static_cast<int32_t>((static_cast<uint32_t>(xs[2 * p]) & 0xFFFF) |
                                                  (static_cast<uint32_t>(xs[2 * p + 1]) << 16));
        msum = _mm512_dpwssd_epi32(msum, _mm512_load_si512(si.m_pairs[p]), _mm512_set1_epi32(pair));
      }
    }
    super_int_terms<KD.has_min>(dsum, msum, si.dd, si.dmin, row.mf[b0 / SUPER_BLOCKS], lo, hi);
  } else if constexpr (KD.act != BLOCK) {  // a run is one super-block (AMX_BLOCKS = SUPER_BLOCKS, K a multiple of 256)
    __m512d dsum[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()}, msum[2] = {dsum[0], dsum[0]};
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512i d0 = _mm512_load_si512(dots[PER * b].v[i]);
      const __m512i d1 = _mm512_load_si512(dots[PER * b + PER - 1].v[i]);
      row_super_products<KIND>(d0, d1, G.scales[b0 + b], row, b0 + b, dsum, msum);
    }
    row_super_terms<KIND>(dsum, msum, row, b0 / SUPER_BLOCKS, lo, hi);
  } else {
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512i d0 = _mm512_load_si512(dots[PER * b].v[i]);
      const __m512i d1 = _mm512_load_si512(dots[PER * b + PER - 1].v[i]);
      row_terms<KIND>(d0, d1, G.scales[b0 + b], row, b0 + b, lo, hi);
    }
  }
}

// Rows [r0, r1) against group g into acc [r1 - r0][16], the rows' codes `stride` bytes apart, a
// tile of 16 rows at a time (a last tile of fewer reads past the GEMM's rows into the buffer's
// slack and keeps only its own). Per run of blocks, first the whole tile's dots on the tiles
// (run_dots), then each row's terms of the run (run_terms), its sums kept in `sums` between runs.
template <int FORM, int KIND>
void group_amx(const Layout& L, const uint8_t* packed, const RowQ* rows, int64_t r0, int64_t r1, int64_t g,
               int shift0, const int32_t* top, int64_t stride, int64_t* acc) {
  constexpr int PER = BLOCK / KINDS[KIND].sub;
  static thread_local AmxGroup G;
  prepare_group<FORM, KIND>(L, packed, g, shift0, top, &G);
  const TileConfig cfg = tile_config<KIND>();
  _tile_loadconfig(&cfg);
  DotTile* dots = G.dots.data();
  alignas(64) int64_t sums[TILE_ROWS][GROUP];  // the tile's rows' sums between runs of blocks
  for (int64_t t0 = r0; t0 < r1; t0 += TILE_ROWS) {
    const int8_t* a = rows[t0].xq;
    const int64_t n = std::min<int64_t>(TILE_ROWS, r1 - t0);
    std::memset(sums, 0, sizeof(sums));
    // Runs of AMX_BLOCKS blocks, whose dots stay in L1 between their multiplies and their terms.
    for (int64_t b0 = 0; b0 < L.blocks; b0 += AMX_BLOCKS) {
      const int64_t blocks = std::min(AMX_BLOCKS, L.blocks - b0);
      run_dots<PER>(G, a, stride, b0, blocks, dots);
      for (int64_t i = 0; i < n; ++i) {
        __m512i lo = _mm512_load_si512(sums[i]), hi = _mm512_load_si512(sums[i] + 8);
        run_terms<FORM, KIND>(G, dots, rows[t0 + i], i, b0, blocks, &lo, &hi);
        _mm512_store_si512(sums[i], lo);
        _mm512_store_si512(sums[i] + 8, hi);
      }
    }
    for (int64_t i = 0; i < n; ++i) std::memcpy(acc + (t0 - r0 + i) * GROUP, sums[i], sizeof(sums[i]));
  }
  _tile_release();
}

}  // namespace
}  // namespace tf

#endif
