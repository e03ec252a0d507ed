// kvcopy item body: where the bytes of one unit of a fused block copy sit.
//
// Raw pointers and integers only: no torch, no CUDA host API. The same header is
// compiled by nvcc for the GPU kernels (csrc/cuda_copy.cu) and by the host C++
// compiler for the `cpu` backend (csrc/cpu_copy.cpp), so every CPU test run exercises
// the addressing code the GPU runs.
//
// Data model (built in kvcopy/core/tables.py, documented there in full):
//
//   entries[E][KVCOPY_ENTRY_FIELDS]
//                   int64 (entry_layout.cuh), static per copier and direction. One
//                   row per copied layer (deduplicated by storage), bytes throughout:
//                   src base address, dst base address, src/dst block stride, run
//                   bytes, runs per page, then three nested run dims (count, src
//                   stride, dst stride), outermost first, one zero, the dims' key
//                   strides (page_checksum.cuh) and two zeros. A page is `runs per
//                   page` runs of `run bytes`,
//                   contiguous on both sides; run r = (i0 * c1 + i1) * c2 + i2 starts
//                   i0*s0 + i1*s1 + i2*s2 bytes into its page on each side with that
//                   side's strides. Identical orders: one run per dense page (2 for
//                   KV-first, one dim); converting orders (a head-major host page
//                   against a token-major cache page): C-byte runs over up to 3 dims.
//   group_offsets[G+1], group_entries[...]
//                   int64, static: group g copies entries
//                   group_entries[group_offsets[g] .. group_offsets[g+1]).
//   call (per call, one int64 array):
//       run_offsets[G+1]   runs of group g are runs[run_offsets[g] .. run_offsets[g+1])
//       item_offsets[G+1]  items of group g are [item_offsets[g], item_offsets[g+1]),
//                          item_offsets[g+1]-item_offsets[g] = entries(g) * runs(g)
//       runs[R][3]         (src first block, dst first block, number of blocks)
//       block_prefix[R+1]  blocks in the runs before run r, right after the runs (the
//                          planner writes it in the same buffer): block b of run r is
//                          block_prefix[r] + b of the call, its checksum slot
//
// An item is one (entry, run) pair: entry-major within a group, so consecutive items
// walk the runs of one layer (a "run" of the call is a run of block ids; a run of a
// page is a run of bytes). An item is made of segments: byte ranges that are
// contiguous on both sides. When a block run's pages are adjacent on both sides
// (block stride == run bytes) a page run of the whole block run is one segment;
// otherwise each (block, page run) is one.
//
// All offsets are 64-bit: a 48-layer cache of 2 MiB pages passes 2^31 bytes per layer.
#pragma once

#if defined(__CUDACC_RTC__)
// NVRTC has no C library headers; the fixed-width types are all this file needs.
typedef signed char int8_t;
typedef long long int64_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVCOPY_HD __host__ __device__ __forceinline__
#else
#define KVCOPY_HD inline
#endif

#include "entry_layout.cuh"

namespace kvcopy {

// Byte offsets of page run r (0 <= r < runs per page, < 2^31) into its page on both
// sides. One dim (the innermost slot: KV-first's two chunks, a head-major page's
// heads) costs one multiply; only converting pages over 2-3 dims pay the 32-bit
// divisions.
KVCOPY_HD void page_run_offsets(const int64_t* entry, int64_t r, int64_t* src, int64_t* dst) {
  const int64_t* d = entry + kRunDims;
  if (r == 0) {
    *src = 0;
    *dst = 0;
    return;
  }
  if (d[6] == entry[kRunsPerPage]) {
    *src = r * d[7];
    *dst = r * d[8];
    return;
  }
  uint32_t q = (uint32_t)r;
  const uint32_t c2 = (uint32_t)d[6], c1 = (uint32_t)d[3];
  const uint32_t i2 = q % c2;
  q /= c2;
  const uint32_t i1 = q % c1;
  const uint32_t i0 = q / c1;
  *src = (int64_t)i0 * d[1] + (int64_t)i1 * d[4] + (int64_t)i2 * d[7];
  *dst = (int64_t)i0 * d[2] + (int64_t)i1 * d[5] + (int64_t)i2 * d[8];
}

// Byte position of page run r in the staging page read chunk after chunk (the
// position the checksum keys the run's words with): the digits of page_run_offsets
// times the key strides.
KVCOPY_HD int64_t page_run_position(const int64_t* entry, int64_t r) {
  const int64_t* d = entry + kRunDims;
  const int64_t* k = entry + kKeyStrides;
  if (r == 0) return 0;
  if (d[6] == entry[kRunsPerPage]) return r * k[2];
  uint32_t q = (uint32_t)r;
  const uint32_t c2 = (uint32_t)d[6], c1 = (uint32_t)d[3];
  const uint32_t i2 = q % c2;
  q /= c2;
  const uint32_t i1 = q % c1;
  const uint32_t i0 = q / c1;
  return (int64_t)i0 * k[0] + (int64_t)i1 * k[1] + (int64_t)i2 * k[2];
}

// The per-call array, split into its three parts.
struct CallView {
  const int64_t* run_offsets;   // [G+1]
  const int64_t* item_offsets;  // [G+1]
  const int64_t* runs;          // [R][3]
  const int64_t* block_prefix;  // [R+1], after the runs
  int64_t num_groups;

  KVCOPY_HD static CallView from_packed(const int64_t* packed, int64_t num_groups) {
    CallView v;
    v.run_offsets = packed;
    v.item_offsets = packed + (num_groups + 1);
    v.runs = packed + 2 * (num_groups + 1);
    v.block_prefix = v.runs + 3 * packed[num_groups];
    v.num_groups = num_groups;
    return v;
  }
  KVCOPY_HD int64_t num_items() const { return item_offsets[num_groups]; }
};

// One (entry, run) unit of work, resolved to addresses.
struct Item {
  const int64_t* entry;  // row of the entry table
  int64_t src_block;
  int64_t dst_block;
  int64_t num_blocks;
  bool merged;  // block run adjacent on both sides: one segment per page run
  // Checksums only (page_checksum.cuh): the entry's position in its group, and the
  // call's index of the run's first block (its output slot).
  int64_t ordinal;
  int64_t out_index;

  KVCOPY_HD int64_t run_bytes() const { return entry[kRunBytes]; }
  KVCOPY_HD int64_t num_segments() const {
    return merged ? entry[kRunsPerPage] : entry[kRunsPerPage] * num_blocks;
  }
  KVCOPY_HD int64_t segment_bytes() const {
    return merged ? entry[kRunBytes] * num_blocks : entry[kRunBytes];
  }
  KVCOPY_HD int64_t total_bytes() const {
    return entry[kRunsPerPage] * entry[kRunBytes] * num_blocks;
  }
  // Byte p of the item (0 <= p < total_bytes(), segment order): its two addresses.
  KVCOPY_HD void byte_address(int64_t p, int64_t* src, int64_t* dst) const {
    const int64_t seg = segment_bytes();
    const int64_t k = p / seg;
    segment(k, src, dst);
    *src += p - k * seg;
    *dst += p - k * seg;
  }
  // Segment k (0 <= k < num_segments()): source and destination addresses.
  KVCOPY_HD void segment(int64_t k, int64_t* src, int64_t* dst) const {
    const int64_t runs = entry[kRunsPerPage];
    const int64_t block = merged || runs == 1 ? (merged ? 0 : k) : k / runs;
    const int64_t run = merged ? k : k - block * runs;
    int64_t s, d;
    page_run_offsets(entry, run, &s, &d);
    *src = entry[kSrcBase] + (src_block + block) * entry[kSrcBlockStride] + s;
    *dst = entry[kDstBase] + (dst_block + block) * entry[kDstBlockStride] + d;
  }
};

// The item of entry row `entry_index` and run `run` (a pointer to its 3 values).
KVCOPY_HD Item make_item(const int64_t* entries, int64_t entry_index, const int64_t* run) {
  Item it;
  it.entry = entries + kEntryFields * entry_index;
  it.src_block = run[0];
  it.dst_block = run[1];
  it.num_blocks = run[2];
  const int64_t rb = it.entry[kRunBytes];
  it.merged =
      it.num_blocks == 1 || (it.entry[kSrcBlockStride] == rb && it.entry[kDstBlockStride] == rb);
  it.ordinal = 0;
  it.out_index = 0;
  return it;
}

// Resolve item i of a call. Groups are few (1-8 in practice; 7 for Gemma-3), so a
// linear scan over item_offsets costs less than a binary search's branches.
KVCOPY_HD Item locate_item(int64_t i, const CallView& call, const int64_t* entries,
                           const int64_t* group_offsets, const int64_t* group_entries) {
  int64_t g = 0;
  while (g + 1 < call.num_groups && i >= call.item_offsets[g + 1]) ++g;
  const int64_t local = i - call.item_offsets[g];
  const int64_t first_run = call.run_offsets[g];
  const int64_t runs_in_group = call.run_offsets[g + 1] - first_run;
  const int64_t ordinal = local / runs_in_group;
  const int64_t run = first_run + local % runs_in_group;
  Item it = make_item(entries, group_entries[group_offsets[g] + ordinal], call.runs + 3 * run);
  it.ordinal = ordinal;
  it.out_index = call.block_prefix[run];
  return it;
}

// ---------------------------------------------------------------------------------
// Byte cursor: the call as one linear byte space, so a copy can be cut into equal
// ranges (one per GPU warp) whatever the sizes of its items.
//
// Order: group, then entry within the group, then run, then the item's segments
// (Item::segment order), then bytes. Seeking needs two prefix arrays:
//   entry_bytes_prefix[GE+1]  static: cumulative page bytes (runs x run bytes)
//                             over the flat group_entries list
//   block_prefix[R+1]         per call: cumulative run lengths (blocks) over all runs
// Group g then spans page_bytes(g) x blocks(g) bytes, entry k of it
// (prefix_k - prefix_first) x blocks(g) bytes in, and run r of entry k
// page_bytes(k) x (block_prefix[r] - block_prefix[first run]) bytes further.

struct CursorTables {
  const int64_t* entries;             // [E][KVCOPY_ENTRY_FIELDS]
  const int64_t* group_offsets;       // [G+1]
  const int64_t* group_entries;       // [GE]
  const int64_t* entry_bytes_prefix;  // [GE+1]
  const int64_t* block_prefix;        // [R+1], per call
  CallView call;
};

struct Cursor {
  int64_t group;  // g
  int64_t slot;   // index into group_entries (the entry of the current item)
  int64_t run;    // index into the call's runs
  int64_t seg;    // segment of the current item
  int64_t off;    // byte offset within the segment
  Item item;
};

KVCOPY_HD int64_t group_bytes(const CursorTables& t, int64_t g) {
  const int64_t* ro = t.call.run_offsets;
  const int64_t blocks = t.block_prefix[ro[g + 1]] - t.block_prefix[ro[g]];
  const int64_t page =
      t.entry_bytes_prefix[t.group_offsets[g + 1]] - t.entry_bytes_prefix[t.group_offsets[g]];
  return page * blocks;
}

KVCOPY_HD void cursor_load_item(const CursorTables& t, Cursor* c) {
  c->item = make_item(t.entries, t.group_entries[c->slot], t.call.runs + 3 * c->run);
  c->item.ordinal = c->slot - t.group_offsets[c->group];
  c->item.out_index = t.block_prefix[c->run];
}

// Place the cursor at byte `pos` (0 <= pos < total bytes of the call).
KVCOPY_HD void cursor_seek(const CursorTables& t, int64_t pos, Cursor* c) {
  const int64_t* ro = t.call.run_offsets;
  const int64_t* go = t.group_offsets;
  const int64_t* ebp = t.entry_bytes_prefix;
  const int64_t* bp = t.block_prefix;
  int64_t g = 0;
  for (; g + 1 < t.call.num_groups; ++g) {
    const int64_t bytes = group_bytes(t, g);
    if (pos < bytes) break;
    pos -= bytes;
  }
  const int64_t blocks = bp[ro[g + 1]] - bp[ro[g]];
  // entry: the last slot k in the group with (ebp[k] - ebp[first]) * blocks <= pos
  int64_t lo = go[g], hi = go[g + 1] - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if ((ebp[mid] - ebp[go[g]]) * blocks <= pos)
      lo = mid;
    else
      hi = mid - 1;
  }
  pos -= (ebp[lo] - ebp[go[g]]) * blocks;
  const int64_t page = ebp[lo + 1] - ebp[lo];
  const int64_t block = pos / page;
  // run: the last r in the group with bp[r] - bp[first] <= block
  int64_t rlo = ro[g], rhi = ro[g + 1] - 1;
  while (rlo < rhi) {
    const int64_t mid = (rlo + rhi + 1) / 2;
    if (bp[mid] - bp[ro[g]] <= block)
      rlo = mid;
    else
      rhi = mid - 1;
  }
  pos -= (bp[rlo] - bp[ro[g]]) * page;
  c->group = g;
  c->slot = lo;
  c->run = rlo;
  cursor_load_item(t, c);
  const int64_t seg_bytes = c->item.segment_bytes();
  c->seg = pos / seg_bytes;
  c->off = pos % seg_bytes;
}

// Move to the first byte of the next item (runs of an entry, entries of a group,
// then groups; empty groups skipped). Only called while bytes remain.
KVCOPY_HD void cursor_next_item(const CursorTables& t, Cursor* c) {
  const int64_t* ro = t.call.run_offsets;
  const int64_t* go = t.group_offsets;
  c->seg = 0;
  c->off = 0;
  if (++c->run < ro[c->group + 1]) {
    cursor_load_item(t, c);
    return;
  }
  c->run = ro[c->group];
  if (++c->slot < go[c->group + 1]) {
    cursor_load_item(t, c);
    return;
  }
  do {
    ++c->group;
  } while (c->group + 1 < t.call.num_groups && group_bytes(t, c->group) == 0);
  c->slot = go[c->group];
  c->run = ro[c->group];
  cursor_load_item(t, c);
}

// Walk bytes [begin, end) of the call item by item: fn(item, lo, hi) once per item
// touched, with [lo, hi) the item-local bytes (segment order) that fall in the range.
template <class Fn>
KVCOPY_HD void for_each_item_range(const CursorTables& t, int64_t begin, int64_t end, Fn& fn) {
  if (begin >= end) return;
  Cursor c;
  cursor_seek(t, begin, &c);
  int64_t pos = begin;
  for (;;) {
    const int64_t lo = c.seg * c.item.segment_bytes() + c.off;
    int64_t n = c.item.total_bytes() - lo;
    if (n > end - pos) n = end - pos;
    fn(c.item, lo, lo + n);
    pos += n;
    if (pos >= end) return;
    cursor_next_item(t, &c);
  }
}

// Item-local bytes [lo, hi) as pieces contiguous on both sides: fn(src, dst, bytes)
// once per piece, in order; pieces never cross a segment.
template <class Fn>
KVCOPY_HD void for_each_segment_piece(const Item& it, int64_t lo, int64_t hi, Fn& fn) {
  const int64_t seg_bytes = it.segment_bytes();
  int64_t k = lo / seg_bytes;
  int64_t off = lo - k * seg_bytes;
  while (lo < hi) {
    int64_t n = seg_bytes - off;
    if (n > hi - lo) n = hi - lo;
    int64_t src, dst;
    it.segment(k, &src, &dst);
    fn(src + off, dst + off, n);
    lo += n;
    off = 0;
    ++k;
  }
}

// Loads each lane of the GPU kernel keeps in flight with words of `word_bytes`: 64
// bytes per lane (16-byte words: 4), at most 16 loads.
KVCOPY_HD constexpr int64_t loads_in_flight(int64_t word_bytes) {
  return 64 / word_bytes < 16 ? 64 / word_bytes : 16;
}

// Segments shorter than one warp's loads in flight (2 KiB for 4- to 16-byte words) are
// copied word by word by the GPU kernel, each word's addresses from
// Item::byte_address, so every lane keeps loads_in_flight() loads outstanding across
// segment boundaries: a converting copy's 256-512 byte runs would otherwise leave one
// or two words in flight per lane. Longer segments fill the loads from one segment.
KVCOPY_HD constexpr int64_t gather_below_bytes(int64_t word_bytes) {
  return loads_in_flight(word_bytes) * 32 * word_bytes;
}

}  // namespace kvcopy
