// The exact quantized GEMM's packed weights (kernels/quant_gemm.py's QuantWeight, packed once):
// the kinds' traits, where a column group's records, scales and tops sit, and how a record's
// codes and scales read back as the reference's integers. Shared by the packer (quant_pack.cpp)
// and the kernels (quant_gemm.cpp and its quant_gemm_*.h).
//
// The kinds differ in their activation groups (QKind::act): 32 columns, or a K-quant's super-block
// of 256, over which the weight's E (and F) is one (pack_quant checks it), so that the kernels
// sum a super-block's products exactly before its one dot term and one minimum term.
//
// Weights are packed from the reference's form (signed codes c, integer scales S with exponents
// E, optional minimums M 2^F) into column groups of 16. A group is one run of records, one per
// block of 32 (what a thread streams front to back): the codes as unsigned bytes u = c + offset
// (4-bit types two to a byte), then the 16 columns' scales, either as the float16 bits the file
// stored (q8_0, q4_0, q4_1: S 2^E is a float16's significand and exponent, decoded in
// registers; the bytes per weight are the file's), in the K-quants' super-block form (q4_k,
// q5_k, q6_k), or wide (S int32, E - top int8, M, F - top).
#pragma once

#include <cstdint>
#include <cstring>

namespace tf {
namespace quant {

constexpr int BLOCK = 32;
constexpr int GROUP = 16;     // columns per packed group (one zmm of int32)
constexpr int64_t MAGIC = 0x544651554e540005;  // "TFQUNT" v5 (v5: the K-quants per super-block, q5_1)

struct QKind {
  int sub;         // weights per scale S
  int term_bits;   // T
  bool has_min;
  int offset;      // u = c + offset is a byte
  bool nibbles;    // u < 16: two codes to a byte
  int code_bits;   // u < 2^code_bits
  int act;         // activations quantized per group of act columns: 32, or 256 (the K-quants)
};
// In quant_gemm.KINDS order: q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, q5_1. The K-quants (act 256)
// take one dot term (and q4_k / q5_k one minimum term) per super-block of 256; q5_1 is the
// per-32 arithmetic with a 5-bit code (GGUF's Q5_1).
constexpr QKind KINDS[] = {{32, 41, false, 128, false, 8, 32}, {32, 41, false, 8, true, 4, 32},
                           {32, 41, true, 0, true, 4, 32},     {32, 47, true, 0, true, 4, 256},
                           {32, 48, true, 0, false, 5, 256},   {16, 49, false, 32, false, 6, 256},
                           {32, 41, true, 0, false, 5, 32}};
constexpr int NUM_KINDS = 7;

inline int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

// How a packed weight keeps its scales (Header::form): WIDE, the reference's integers S, E - top,
// M, F - top per block of 32; F16, the float16 bits the file stored (the 32-weight types: S 2^E is
// a float16's significand and exponent); SUPER, the K-quants' super-block form (q4_k, q6_k): per
// 256 weights of a column the float16 d (and dmin) and the 6-bit (q6_k: 8-bit) sub-block scales,
// so that S = dm sc and M = -(dminm m) are formed in registers, and q6_k's codes as a nibble plane
// and a plane of their top two bits (q5_k's: a nibble plane and a plane of their fifth bits): the
// file's bytes per weight.
enum Form { WIDE = 0, F16 = 1, SUPER = 2 };
constexpr int SUPER_BLOCKS = 8;     // blocks of 32 per K-quant super-block
constexpr int Q4K = 3, Q5K = 4, Q6K = 5;  // the kinds with a SUPER form

// Where things sit in a packed weight: the header, then group g's records (one per block of 32,
// front to back; SUPER: one per super-block, a head of scales then its eight blocks' codes), then
// top [groups][16] int32 (the largest E or F of each column), then lows [groups][2] int32: the
// group's smallest E - top and F - top over its nonzero scales and minimums (0 where none), which
// tell a row tile whether any of its terms can have a negative shift (group_rows).
struct Layout {
  QKind kind;
  int form;
  int64_t groups, blocks, per, code_bytes;     // per: scales per block (32 / sub)
  int64_t min_at, sexp_at, mexp_at, record;    // offsets inside a record; record: its bytes (SUPER: per block, on average)
  int64_t super_head = 0, super_block = 0, super_bytes = 0;  // SUPER: a head's bytes, a block's, a super-block's
  int64_t top, lows, total;
  Layout(int kind_id, int form_, int64_t N, int64_t K) : kind(KINDS[kind_id]), form(form_) {
    groups = (N + GROUP - 1) / GROUP;
    blocks = K / BLOCK;
    per = BLOCK / kind.sub;
    code_bytes = kind.nibbles ? GROUP * BLOCK / 2 : GROUP * BLOCK;
    sexp_at = mexp_at = min_at = 0;
    if (form == SUPER) {
      // q4_k and q5_k head: d [16] u16, dmin [16] u16, the 12 scale bytes as planes [12][16];
      // q6_k head: d [16] u16, sc [16 sub-blocks][16] int8; a q6_k block: its low nibbles (as
      // q4's codes), then their top two bits [2][64] (quad q's in bits 2 (q % 4) of row q / 4); a
      // q5_k block: its low nibbles, then their fifth bits [64] (quad q's in bit q).
      const bool q6 = kind_id == Q6K;
      super_head = q6 ? 2 * GROUP + 16 * GROUP : 4 * GROUP + 12 * GROUP;
      code_bytes = GROUP * BLOCK / 2;
      super_block = q6 ? code_bytes + GROUP * BLOCK / 4 : kind_id == Q5K ? code_bytes + GROUP * BLOCK / 8 : code_bytes;
      super_bytes = super_head + SUPER_BLOCKS * super_block;
      record = super_bytes / SUPER_BLOCKS;
    } else if (form == F16) {  // d [16] u16, then m [16] u16
      min_at = code_bytes + 2 * GROUP;
      record = code_bytes + 2 * GROUP * (kind.has_min ? 2 : 1);
    } else {    // S [per][16] i32, E - top [16] i8, then M [16] i32, F - top [16] i8
      sexp_at = code_bytes + 4 * GROUP * per;
      min_at = sexp_at + GROUP;
      mexp_at = min_at + 4 * GROUP;
      record = kind.has_min ? mexp_at + GROUP : min_at;
    }
    top = 64 + align64(groups * blocks * record);
    lows = top + align64(groups * GROUP * 4);
    total = lows + align64(groups * 2 * 4);
  }
};

struct Header {
  int64_t magic, kind, N, K, form;
};

// A float16 (its bits) as dm 2^de, dm its integer significand (quant_gemm.significand).
inline void significand16(uint16_t bits, int32_t* dm, int32_t* de) {
  const int32_t frac = bits & 0x3FF;
  const int exp = (bits >> 10) & 0x1F;
  const int32_t magnitude = exp > 0 ? (frac | 0x400) : frac;
  *dm = (bits >> 15) ? -magnitude : magnitude;
  *de = exp > 0 ? exp - 25 : -24;
}

// The float16 whose significand() is (dm, de), or -1 when there is none.
inline int32_t float16_bits(int32_t dm, int32_t de) {
  const int32_t mag = dm < 0 ? -dm : dm, sign = dm < 0 ? 0x8000 : 0;
  if (mag == 0) return de == -24 ? 0 : -1;
  if (mag < 0x400) return de == -24 ? sign | mag : -1;      // subnormal
  if (mag < 0x800 && de + 25 >= 1 && de + 25 <= 31) return sign | ((de + 25) << 10) | (mag - 0x400);
  return -1;
}

// Where code u of column j (0..15) at k (0..31) of a block sits: quads of 4 consecutive k per
// column, 16 columns to a 64-byte row; 4-bit codes hold quad q + 4 in the high nibble of quad q.
inline int64_t code_index(bool nibbles, int j, int k) {
  const int quad = k / 4, i = k % 4;
  return ((nibbles ? quad % 4 : quad) * GROUP + j) * 4 + i;
}

// Block b of group g: its record (SUPER: the block's codes inside its super-block's record).
inline const uint8_t* record_at(const uint8_t* packed, const Layout& L, int64_t g, int64_t b) {
  if (L.form == SUPER)
    return packed + 64 + (g * (L.blocks / SUPER_BLOCKS) + b / SUPER_BLOCKS) * L.super_bytes + L.super_head +
           (b % SUPER_BLOCKS) * L.super_block;
  return packed + 64 + (g * L.blocks + b) * L.record;
}

// SUPER: the head of the super-block whose block b's codes are at `rec`.
inline const uint8_t* super_head(const uint8_t* rec, const Layout& L, int64_t b) {
  return rec - L.super_head - (b % SUPER_BLOCKS) * L.super_block;
}

// q4_k's 6-bit scale sc and minimum m of sub-block i (0..7) from its 12 scale bytes, as GGUF packs
// them: bytes 0-3 and 4-7 the low 6 bits of sc_0..3 and m_0..3, their top 2 bits the bits 4-5 of
// sc_4..7 and m_4..7, whose low 4 bits are the nibbles of bytes 8-11 (sc low, m high). byte(t)
// gives byte t of one column (V int32_t) or of a register's columns, each in a 32-bit lane (V a
// compiler vector of uint32_t, the kernels' 16 or 8 columns at once), so that one column's reading
// and the kernels' decoding are the same steps.
template <typename V, typename Byte>
inline void unpack_k_scale(const Byte& byte, int i, V* sc, V* m) {
  if (i < 4) {
    *sc = byte(i) & 63;
    *m = byte(i + 4) & 63;
  } else {
    *sc = (byte(i + 4) & 15) | ((byte(i - 4) >> 6) << 4);
    *m = (byte(i + 4) >> 4) | ((byte(i) >> 6) << 4);
  }
}

// Column j's, its 12 bytes kept in planes of 16 columns (byte t of column j at planes[16 t + j]).
inline void k_scale(const uint8_t* planes, int j, int i, int32_t* sc, int32_t* m) {
  unpack_k_scale([&](int t) { return static_cast<int32_t>(planes[16 * t + j]); }, i, sc, m);
}

struct ColumnScales {
  int32_t s[2], sexp, min, mexp;  // S per half, E - top, M, F - top
};

// Column j's scales in block b (codes at rec) as the reference's integers.
inline ColumnScales column_scales(const uint8_t* rec, const Layout& L, int64_t b, int j, int32_t top) {
  ColumnScales c{{0, 0}, 0, 0, 0};
  if (L.form == SUPER) {
    const uint8_t* head = super_head(rec, L, b);
    const int i = static_cast<int>(b % SUPER_BLOCKS);
    uint16_t bits;
    int32_t dm;
    std::memcpy(&bits, head + 2 * j, 2);
    significand16(bits, &dm, &c.sexp);
    c.sexp -= top;
    if (L.per == 2) {  // q6_k: sub-blocks 2i and 2i + 1
      for (int h = 0; h < 2; ++h) c.s[h] = dm * static_cast<int8_t>(head[2 * GROUP + 16 * (2 * i + h) + j]);
      return c;
    }
    int32_t sc, m, mm;
    k_scale(head + 4 * GROUP, j, i, &sc, &m);
    c.s[0] = dm * sc;
    std::memcpy(&bits, head + 2 * GROUP + 2 * j, 2);
    significand16(bits, &mm, &c.mexp);
    c.mexp -= top;
    c.min = -(mm * m);
    return c;
  }
  if (L.form == F16) {
    uint16_t bits;
    std::memcpy(&bits, rec + L.code_bytes + 2 * j, 2);
    significand16(bits, &c.s[0], &c.sexp);
    c.sexp -= top;
    if (L.kind.has_min) {
      std::memcpy(&bits, rec + L.min_at + 2 * j, 2);
      significand16(bits, &c.min, &c.mexp);
      c.mexp -= top;
    }
    return c;
  }
  for (int h = 0; h < L.per; ++h) std::memcpy(&c.s[h], rec + L.code_bytes + 4 * (h * GROUP + j), 4);
  c.sexp = static_cast<int8_t>(rec[L.sexp_at + j]);
  if (L.kind.has_min) {
    std::memcpy(&c.min, rec + L.min_at + 4 * j, 4);
    c.mexp = static_cast<int8_t>(rec[L.mexp_at + j]);
  }
  return c;
}

// Code u = c + offset of column j at k (0..31) in the block whose codes are at rec.
inline int code_at(const uint8_t* rec, const Layout& L, int j, int k) {
  const bool nibbles = L.kind.nibbles || L.form == SUPER;
  const uint8_t byte = rec[code_index(nibbles, j, k)];
  int u = nibbles ? (k / 4 >= 4 ? byte >> 4 : byte & 0x0F) : byte;
  if (L.form == SUPER && L.per == 2) {  // q6_k: the top two bits
    const int quad = k / 4;
    u |= ((rec[L.code_bytes + (quad / 4) * 64 + j * 4 + k % 4] >> (2 * (quad % 4))) & 3) << 4;
  } else if (L.form == SUPER && L.kind.code_bits == 5) {  // q5_k: the fifth bit
    u |= ((rec[L.code_bytes + j * 4 + k % 4] >> (k / 4)) & 1) << 4;
  }
  return u;
}

}  // namespace quant
}  // namespace tf
