// kvcopy fused block-copy kernel: every (group, layer, run) of one call, one launch.
//
// Device code only: raw pointers and integers, no torch, no host API. Compiled by
// nvcc into libkvcopy_cuda (csrc/cuda_copy.cu) and by NVRTC at first use when that
// library is absent (kvcopy/nvrtc.py); both define the same extern "C" entry points
// through KVCOPY_DEFINE_KERNELS below.
//
// Work split. The call is one linear byte space (block_copy.cuh, "Byte cursor"): the
// total is cut into equal word-aligned ranges, one per warp of a persistent grid, so a
// 2 MiB segment is spread over many warps (and CTAs) and thousands of 2 KiB pages are
// dealt out evenly, whatever the mix of layers, groups and run lengths. A warp seeks
// its first byte once (a few broadcast loads and two short binary searches), then
// walks forward item by item: no per-tile search, no host-side per-item prefix. Within
// an item, segments of 2 KiB and up move piece by piece; shorter ones (the C-byte runs
// of a layout-converting copy) word by word, each word's two addresses from the item
// body (Item::byte_address), so every lane still has kLoadsInFlight loads outstanding.
// The host chooses the grid (csrc/cuda_copy.cu): enough warps for bytes in flight,
// never more than `max_ctas` CTAs, no warp with less than a few KiB.
//
// Bytes move as words of W bytes (16, 8, 4, 2, 1): the host passes the widest word
// that divides every address, stride and size of the tables (CopyTables.word_bytes),
// one kernel per width. Each lane keeps kLoadsInFlight loads outstanding before it
// stores (64 bytes per lane, 2 KiB per warp with 16-byte words): reads of pinned host
// memory over PCIe are bound by bytes in flight, not by instructions. Loads and
// stores use the streaming (evict-first) cache hints: every byte is touched once.
//
// Per-call data (the packed runs + block prefix) comes either inline in the kernel
// parameters (small calls: no upload at all, and a CUDA graph captures it by value)
// or through a device pointer. Offsets are 64-bit throughout.
//
// Checksums (kvcopy_block_copy_sums_w*, page_checksum.cuh): the same split and loads;
// a warp's range is further cut into block ranges (one page, one output slot each).
// Each lane adds the hash terms of the words it copies to a register as they go from
// load to store; when the warp moves to another page (and at the end of its range) the
// lanes' parts are summed with shuffles and lane 0 adds the total to the page's slot
// with one 64-bit atomic. Runs of 2 KiB and up move as run pieces, shorter ones word
// by word within their page. Words of 8 and 16 bytes are one or two hash words in
// registers; narrower words (1-4 byte aligned tables) add the zero-padded 8-byte hash
// word that starts at them, if one does, reading its other bytes from the source (a
// warp range may end inside a hash word: the word belongs to the range holding its
// first byte). One 32 x 32 -> 64-bit multiply (IMAD.WIDE.U32) per 8 bytes: far below
// what an SM issues while it waits for PCIe, so the copy should keep its bandwidth
// (bench/gpu_check.sh measures it; not run on a GPU yet).
#pragma once

#include "block_copy.cuh"
#include "page_checksum.cuh"

#ifndef KVCOPY_THREADS
#define KVCOPY_THREADS 512
#endif
// int64 words of call data that fit in the kernel parameters (4 KiB parameter limit
// of every CUDA version, minus the fixed fields).
#ifndef KVCOPY_INLINE_WORDS
#define KVCOPY_INLINE_WORDS 480
#endif

namespace kvcopy {

// The kernel's single parameter. Layout mirrored by ctypes in kvcopy/nvrtc.py.
struct KernelParams {
  const int64_t*
      tables;  // entries[E*20] | group_offsets[G+1] | group_entries[GE] | entry_bytes_prefix[GE+1]
  const int64_t* call;  // packed call | block_prefix[R+1]; nullptr: use inline_call
  int64_t num_entries;
  int64_t num_groups;
  int64_t num_group_entries;
  int64_t total_bytes;       // bytes the call moves (a multiple of the word size)
  unsigned long long* sums;  // checksum kernels: one zeroed slot per block of the call
  int64_t inline_call[KVCOPY_INLINE_WORDS];
};

template <typename W>
struct WarpCopy {
  static constexpr int kLoadsInFlight = (int)loads_in_flight((int64_t)sizeof(W));
  int lane;

  __device__ __forceinline__ void operator()(int64_t src_addr, int64_t dst_addr,
                                             int64_t bytes) const {
    const W* __restrict__ src = reinterpret_cast<const W*>(src_addr);
    W* __restrict__ dst = reinterpret_cast<W*>(dst_addr);
    const int64_t n = bytes / (int64_t)sizeof(W);
    constexpr int U = kLoadsInFlight;
    int64_t i = lane;
    for (; i + (U - 1) * 32 < n; i += U * 32) {
      W v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = __ldcs(src + i + u * 32);
#pragma unroll
      for (int u = 0; u < U; ++u) __stcs(dst + i + u * 32, v[u]);
    }
    if (i < n) {  // tail: still all loads first, then all stores
      W v[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (i + u * 32 < n) v[u] = __ldcs(src + i + u * 32);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (i + u * 32 < n) __stcs(dst + i + u * 32, v[u]);
    }
  }
};

// One warp's share of one item: segments of 2 KiB and up piece by piece (WarpCopy),
// shorter ones (a converting copy's runs) word by word, each lane kLoadsInFlight words
// of the range (with their own addresses) loaded before it stores them.
template <typename W>
struct WarpItemCopy {
  int lane;

  __device__ __forceinline__ void operator()(const Item& it, int64_t lo, int64_t hi) const {
    // Each gathered load carries its own 64-bit store address: at most 8 per lane keep
    // the narrow-word kernels within the 128 registers of 512-thread CTAs, no spills.
    constexpr int U = WarpCopy<W>::kLoadsInFlight < 8 ? WarpCopy<W>::kLoadsInFlight : 8;
    if (it.segment_bytes() >= gather_below_bytes((int64_t)sizeof(W))) {
      WarpCopy<W> fn{lane};
      for_each_segment_piece(it, lo, hi, fn);
      return;
    }
    const int64_t n = (hi - lo) / (int64_t)sizeof(W);
    for (int64_t i = lane; i < n; i += U * 32) {
      W v[U];
      int64_t dst[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (i + u * 32 < n) {
          int64_t src;
          it.byte_address(lo + (i + u * 32) * (int64_t)sizeof(W), &src, &dst[u]);
          v[u] = __ldcs(reinterpret_cast<const W*>(src));
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (i + u * 32 < n) __stcs(reinterpret_cast<W*>(dst[u]), v[u]);
    }
  }
};

__device__ __forceinline__ CursorTables kernel_tables(const KernelParams& p) {
  const int64_t* call = p.call != nullptr ? p.call : p.inline_call;
  CursorTables t;
  t.entries = p.tables;
  t.group_offsets = t.entries + kEntryFields * p.num_entries;
  t.group_entries = t.group_offsets + (p.num_groups + 1);
  t.entry_bytes_prefix = t.group_entries + p.num_group_entries;
  t.call = CallView::from_packed(call, p.num_groups);
  t.block_prefix = t.call.block_prefix;
  return t;
}

// This warp's contiguous byte range of the call, in words of W; the grid is sized by
// the host (at most max_ctas).
template <typename W>
__device__ __forceinline__ void warp_range(const KernelParams& p, int64_t* begin, int64_t* end) {
  const int64_t words = p.total_bytes / (int64_t)sizeof(W);
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  const int64_t w = (int64_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
  *begin =
      (int64_t)((unsigned long long)words * (unsigned long long)w / (unsigned long long)warps) *
      (int64_t)sizeof(W);
  *end = (int64_t)((unsigned long long)words * (unsigned long long)(w + 1) /
                   (unsigned long long)warps) *
         (int64_t)sizeof(W);
}

template <typename W>
__device__ __forceinline__ void block_copy_body(const KernelParams& p) {
  const CursorTables t = kernel_tables(p);
  WarpItemCopy<W> fn{(int)(threadIdx.x & 31)};
  int64_t begin, end;
  warp_range<W>(p, &begin, &end);
  for_each_item_range(t, begin, end, fn);
}

// ---------------------------------------------------------------------- checksums
// The hash terms of one word of W bytes (page_checksum.cuh): `key` is the key of its
// first byte; `src` (its source address) and q (its offset in a run of rb bytes) only
// matter to words narrower than 8 bytes.
template <typename W>
__device__ __forceinline__ uint64_t word_terms(const W& v, int64_t src, int64_t q, int64_t rb,
                                               uint64_t key) {
  if constexpr (sizeof(W) == 16) {
    return product_term(((uint64_t)v.x | ((uint64_t)v.y << 32)) ^ key) +
           product_term(((uint64_t)v.z | ((uint64_t)v.w << 32)) ^ (key + 8 * kPositionMul));
  } else if constexpr (sizeof(W) == 8) {
    return product_term(((uint64_t)v.x | ((uint64_t)v.y << 32)) ^ key);
  } else {
    if (q & (kHashWordBytes - 1)) return 0;
    const int64_t n = hash_word_bytes(q, rb);
    uint64_t word = (uint64_t)v;
    for (int64_t b = (int64_t)sizeof(W); b < n; b += (int64_t)sizeof(W)) {
      word |= (uint64_t)(*reinterpret_cast<const W*>(src + b)) << (8 * b);
    }
    return product_term(word ^ key);
  }
}

template <typename W>
struct WarpItemCopySums {
  static constexpr int64_t kW = (int64_t)sizeof(W);
  int lane;
  unsigned long long* sums;
  int64_t slot;  // the page `acc` belongs to (warp-uniform; -1: none yet)
  uint64_t acc;  // this lane's part of that page's sum

  // The warp's sum of acc to its slot: called by the whole warp.
  __device__ __forceinline__ void flush() {
    uint64_t total = acc;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    if (lane == 0 && slot >= 0) atomicAdd(sums + slot, (unsigned long long)total);
    acc = 0;
  }

  // Bytes [src, src + bytes) of one run, the first at offset q0 of the run, keyed from
  // key0: WarpCopy's loop, the words hashed once all their stores are issued (hashing
  // each word after its own store made ptxas spill 4 bytes in the 8-byte kernel).
  __device__ __forceinline__ void piece(int64_t src_addr, int64_t dst_addr, int64_t bytes,
                                        int64_t q0, int64_t rb, uint64_t key0) {
    const W* __restrict__ src = reinterpret_cast<const W*>(src_addr);
    W* __restrict__ dst = reinterpret_cast<W*>(dst_addr);
    const int64_t n = bytes / kW;
    // Narrow words also keep the addresses of their hash words' other bytes: fewer in
    // flight keeps them in registers (odd layouts only).
    constexpr int U = kW >= kHashWordBytes ? WarpCopy<W>::kLoadsInFlight : 4;
    // One loop with per-load guards (no separate tail): ptxas keeps every variant
    // within 128 registers this way.
    for (int64_t i = lane; i < n; i += U * 32) {
      W v[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (i + u * 32 < n) v[u] = __ldcs(src + i + u * 32);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (i + u * 32 < n) __stcs(dst + i + u * 32, v[u]);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (i + u * 32 < n) {
          const int64_t at = (i + u * 32) * kW;
          acc +=
              word_terms<W>(v[u], src_addr + at, q0 + at, rb, key0 + kPositionMul * (uint64_t)at);
        }
      }
    }
  }

  // Item-local bytes [lo, hi) of one page, word by word (short runs), each word's
  // addresses, run offset and key from the item body.
  __device__ __forceinline__ void gather(const Item& it, int64_t lo, int64_t hi, uint64_t base) {
    constexpr int U = WarpCopy<W>::kLoadsInFlight < 4 ? WarpCopy<W>::kLoadsInFlight : 4;
    const int64_t rb = it.run_bytes();
    const int64_t n = (hi - lo) / kW;
    for (int64_t i = lane; i < n; i += U * 32) {
      W v[U];
      int64_t src[U], dst[U], q[U];
      uint64_t key[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (i + u * 32 < n) {
          int64_t run;
          byte_place(it, lo + (i + u * 32) * kW, &src[u], &dst[u], &q[u], &run);
          v[u] = __ldcs(reinterpret_cast<const W*>(src[u]));
          key[u] = base + kPositionMul * (uint64_t)(page_run_position(it.entry, run) + q[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (i + u * 32 < n) {
          __stcs(reinterpret_cast<W*>(dst[u]), v[u]);
          acc += word_terms<W>(v[u], src[u], q[u], rb, key[u]);
        }
      }
    }
  }

  __device__ __forceinline__ void operator()(const Item& it, int64_t lo, int64_t hi) {
    const uint64_t base = key_base(it.ordinal);
    const int64_t rb = it.run_bytes();
    auto page = [&](int64_t blo, int64_t bhi, int64_t block) {
      if (it.out_index + block != slot) {
        flush();
        slot = it.out_index + block;
      }
      if (rb >= gather_below_bytes(kW)) {
        auto run_piece = [&](int64_t s, int64_t d, int64_t bytes, int64_t q, int64_t run) {
          piece(s, d, bytes, q, rb,
                base + kPositionMul * (uint64_t)(page_run_position(it.entry, run) + q));
        };
        for_each_run_piece(it, blo, bhi, run_piece);
      } else {
        gather(it, blo, bhi, base);
      }
    };
    for_each_block_range(it, lo, hi, page);
  }
};

template <typename W>
__device__ __forceinline__ void block_copy_sums_body(const KernelParams& p) {
  const CursorTables t = kernel_tables(p);
  WarpItemCopySums<W> fn{(int)(threadIdx.x & 31), p.sums, -1, 0};
  int64_t begin, end;
  warp_range<W>(p, &begin, &end);
  for_each_item_range(t, begin, end, fn);
  fn.flush();
}

// Parameters of the staging kernel: up to KVCOPY_INLINE_WORDS words carried by value
// into device memory. Used to put a large call array on the device inside CUDA graph
// capture, where the graph must own every byte it reads at replay.
struct StoreParams {
  int64_t* dst;
  int64_t count;
  int64_t words[KVCOPY_INLINE_WORDS];
};

}  // namespace kvcopy

// The entry points, one per word width; names looked up by NVRTC and the launcher.
#define KVCOPY_DEFINE_KERNEL(NAME, WORD)                       \
  extern "C" __global__ void __launch_bounds__(KVCOPY_THREADS) \
      NAME(const __grid_constant__ kvcopy::KernelParams p) {   \
    kvcopy::block_copy_body<WORD>(p);                          \
  }

#define KVCOPY_DEFINE_SUMS_KERNEL(NAME, WORD)                  \
  extern "C" __global__ void __launch_bounds__(KVCOPY_THREADS) \
      NAME(const __grid_constant__ kvcopy::KernelParams p) {   \
    kvcopy::block_copy_sums_body<WORD>(p);                     \
  }

#define KVCOPY_DEFINE_KERNELS                                                                    \
  extern "C" __global__ void kvcopy_store_words(const __grid_constant__ kvcopy::StoreParams p) { \
    for (int64_t i = threadIdx.x; i < p.count; i += blockDim.x) p.dst[i] = p.words[i];           \
  }                                                                                              \
  KVCOPY_DEFINE_KERNEL(kvcopy_block_copy_w16, uint4)                                             \
  KVCOPY_DEFINE_KERNEL(kvcopy_block_copy_w8, uint2)                                              \
  KVCOPY_DEFINE_KERNEL(kvcopy_block_copy_w4, unsigned int)                                       \
  KVCOPY_DEFINE_KERNEL(kvcopy_block_copy_w2, unsigned short)                                     \
  KVCOPY_DEFINE_KERNEL(kvcopy_block_copy_w1, unsigned char)                                      \
  KVCOPY_DEFINE_SUMS_KERNEL(kvcopy_block_copy_sums_w16, uint4)                                   \
  KVCOPY_DEFINE_SUMS_KERNEL(kvcopy_block_copy_sums_w8, uint2)                                    \
  KVCOPY_DEFINE_SUMS_KERNEL(kvcopy_block_copy_sums_w4, unsigned int)                             \
  KVCOPY_DEFINE_SUMS_KERNEL(kvcopy_block_copy_sums_w2, unsigned short)                           \
  KVCOPY_DEFINE_SUMS_KERNEL(kvcopy_block_copy_sums_w1, unsigned char)
