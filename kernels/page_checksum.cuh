// kvcopy page checksums: the hash the copies compute while they move the bytes.
//
// Raw integers only, host and device (the same rules as block_copy.cuh). The
// definition, what it catches and what it does not, are in kvcopy/core/checksum.py, whose
// numpy code is the oracle the kernels are tested against; in short:
//
//   sum[slot] = SUM over the entries k of the group (k = the entry's position in it),
//               the runs of the page and the 8-byte words of each run (counted from
//               the run's first byte, the last one zero-padded) of
//               product_term(word XOR key), key = (pos + 1) * kPositionMul + k * kOrdinalMul
//   (mod 2^64), pos = the word's byte position in the staging page read chunk after
//   chunk (page_run_position + offset in the run), words little-endian.
//
// A sum does not depend on the order its terms are added in, so every work split
// (items on CPU threads, word ranges per GPU warp, Triton rows) gives the same value.
//
// Work split helpers: an item's bytes are cut into block ranges (one output slot
// each) and, within them, run pieces (contiguous on both sides, inside one run), so a
// caller always knows the slot, the run and the offset in the run of what it copies.
#pragma once

#include "block_copy.cuh"

namespace kvcopy {

constexpr uint64_t kPositionMul = 0x9E3779B97F4A7C15ull;  // odd: pos -> key is one-to-one
constexpr uint64_t kOrdinalMul = 0xC2B2AE3D27D4EB4Full;
constexpr int64_t kHashWordBytes = 8;

// The term of one keyed word x: the product of its 32-bit halves, plus x (mod 2^64). A
// change confined to one half of x always changes it (kvcopy/core/checksum.py says why), so
// every single-bit flip does; one 32 x 32 -> 64-bit multiply (a vpmuludq lane, an
// IMAD.WIDE) where MurmurHash3's finalizer took two 64-bit ones.
KVCOPY_HD uint64_t product_term(uint64_t x) {
  return (uint64_t)(uint32_t)x * (uint64_t)(uint32_t)(x >> 32) + x;
}

// The key of the word at staging position `pos` is key_base(ordinal) + pos * kPositionMul.
KVCOPY_HD uint64_t key_base(int64_t ordinal) {
  return kPositionMul + kOrdinalMul * (uint64_t)ordinal;
}

KVCOPY_HD uint64_t word_term(uint64_t word, uint64_t base, int64_t pos) {
  return product_term(word ^ (base + kPositionMul * (uint64_t)pos));
}

// MurmurHash3's 64-bit finalizer (kvcopy.core.checksum.mix64): one-to-one; seals a page's
// sum to its request and position once per page (kvcopy.core.checksum.seal), not per word.
KVCOPY_HD uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  x *= 0xC4CEB9FE1A85EC53ull;
  return x ^ (x >> 33);
}

// Bytes of the hash word that starts at offset q (a multiple of 8) of a run of `rb`.
KVCOPY_HD int64_t hash_word_bytes(int64_t q, int64_t rb) {
  return rb - q < kHashWordBytes ? rb - q : kHashWordBytes;
}

// Item-local bytes [lo, hi) cut where the page (block) changes: fn(lo, hi, block) once
// per piece, in order. A block is one output slot: item.out_index + block.
template <class Fn>
KVCOPY_HD void for_each_block_range(const Item& it, int64_t lo, int64_t hi, Fn& fn) {
  const int64_t rb = it.run_bytes();
  const int64_t page = it.entry[kRunsPerPage] * rb;
  const int64_t seg_bytes = it.segment_bytes();
  while (lo < hi) {
    int64_t block, end;
    if (it.merged) {  // segment k holds run k of every block of the item
      const int64_t k = lo / seg_bytes;
      block = (lo - k * seg_bytes) / rb;
      end = k * seg_bytes + (block + 1) * rb;
    } else {  // segments are block-major: a block is `page` consecutive bytes
      block = lo / page;
      end = (block + 1) * page;
    }
    if (end > hi) end = hi;
    fn(lo, end, block);
    lo = end;
  }
}

// Byte p of the item (segment order): its two addresses, its offset in its run, the
// run's index in the page and the block.
KVCOPY_HD void byte_place(const Item& it, int64_t p, int64_t* src, int64_t* dst, int64_t* q,
                          int64_t* run) {
  const int64_t seg_bytes = it.segment_bytes();
  const int64_t rb = it.run_bytes();
  const int64_t k = p / seg_bytes;
  const int64_t off = p - k * seg_bytes;
  it.segment(k, src, dst);
  *src += off;
  *dst += off;
  if (it.merged) {
    *run = k;
    *q = off - (off / rb) * rb;
  } else {
    *run = k - (k / it.entry[kRunsPerPage]) * it.entry[kRunsPerPage];
    *q = off;
  }
}

// Item-local bytes [lo, hi) as pieces inside one run of one block, contiguous on both
// sides: fn(src, dst, bytes, q, run) once per piece, in order, q the piece's offset in
// its run.
template <class Fn>
KVCOPY_HD void for_each_run_piece(const Item& it, int64_t lo, int64_t hi, Fn& fn) {
  const int64_t rb = it.run_bytes();
  while (lo < hi) {
    int64_t src, dst, q, run;
    byte_place(it, lo, &src, &dst, &q, &run);
    int64_t n = rb - q;
    if (n > hi - lo) n = hi - lo;
    fn(src, dst, n, q, run);
    lo += n;
  }
}

}  // namespace kvcopy
