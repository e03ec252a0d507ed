// Backend `cpu`: the item body of kernels/block_copy.cuh compiled for the host.
//
// One C call per copy: items are spread over OpenMP threads (dynamic schedule, items
// differ in size), each item's segments copied with memcpy, or, in calls of at least
// the caller's stream_min_bytes (KVCOPY_CPU_STREAM_BYTES: by default 2 MiB on Intel
// CPUs, 16 MiB on others; kvcopy/copy_backends/cpu.py), with non-temporal stores.
// Small calls stay on the calling thread: waking a team costs more than copying a few
// pages.
//
// With checksums (kvcopy_cpu_copy_sums, kernels/page_checksum.cuh), each run is copied
// by a loop that hashes the words it holds in registers on their way to the
// destination: 128 bytes per step with AVX-512 F, else 64 with AVX2 (one vpmuludq per
// vector of words: product_term's 32 x 32-bit multiply), else 16 bytes per step in
// scalar code; in calls below the streaming threshold a vector loop given piece_bytes
// copies runs that long with memcpy, piece by piece, each piece hashed where it landed
// one piece later, with the next piece's source prefetched under the hash, whole in
// calls under 8 MiB, else its first half (PieceStream), in calls of at least
// piece_min_bytes (Python: PIECE_MIN_CALL_BYTES, 2 MiB, unless
// KVCOPY_CPU_SUM_PIECE_BYTES is set). Each page's sum is added
// to its slot once per (item, block), in a row of slots of the thread's own (threads
// share slots: the layers of a group), the rows summed at the end of the call.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block_copy.cuh"
#include "kvcopy_abi.h"
#include "page_checksum.cuh"

#ifdef _OPENMP
#include <omp.h>
#endif
// The vector loops are compiled where the intrinsics are: on x86-64 natively, each
// function for its own instruction set (KVCOPY_TARGET) and picked at run time
// (vector_loops); with KVCOPY_SIMD_EMULATION (tests only, CMake option of that name) on
// SIMDe's portable intrinsics with no target, so a CPU without AVX-512 runs the AVX-512
// loop's own code: its heads, keys, lanes, steps and reduction, bit for bit against
// the oracle (tests/copy_backends/test_cpu_simd_emulation.py). Never installed: the loops
// run there at a fraction of their speed.
#if defined(KVCOPY_SIMD_EMULATION)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define KVCOPY_X86_LOOPS 1
#define KVCOPY_TARGET(isa)
// What SIMDe 0.7.4 lacks (newer releases alias both as macros, hence the guards): a
// streaming store is a store to the bytes that, as the CPU's, faults off a 64-byte
// boundary (so a wrong aligning head fails here too), and the reduction a sum of the lanes.
#ifndef _mm512_stream_si512
inline void _mm512_stream_si512(__m512i* d, __m512i v) {
  if (reinterpret_cast<uintptr_t>(d) & 63) __builtin_trap();
  _mm512_storeu_si512(d, v);
}
#endif
#ifndef _mm512_reduce_add_epi64
inline int64_t _mm512_reduce_add_epi64(__m512i v) {
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, v);
  uint64_t sum = 0;
  for (uint64_t lane : lanes) sum += lane;
  return (int64_t)sum;
}
#endif
#elif defined(__x86_64__)
#include <immintrin.h>
#define KVCOPY_X86_LOOPS 1
#define KVCOPY_TARGET(isa) __attribute__((target(isa)))
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvcopy's checksums read words little-endian, as the GPU does"
#endif

namespace {

// Below this many bytes a call runs on one thread: waking an OpenMP team costs more
// than copying that much.
constexpr int64_t kParallelMinBytes = 1 << 20;

// Pieced checksummed calls below this many bytes prefetch each next piece's source
// whole under the hash of the piece before, calls of this many and more its first half
// (PieceStream). With Python's default threshold Intel CPUs stream from 2 MiB, so
// there only a raised KVCOPY_CPU_STREAM_BYTES reaches the half.
constexpr int64_t kWholePrefetchMaxBytes = 8 << 20;

void copy_memcpy(const unsigned char* s, unsigned char* d, int64_t n) {
  memcpy(d, s, static_cast<size_t>(n));
}

// Every segment of an item with kCopy (inlined: one instantiation per copy).
template <void (*kCopy)(const unsigned char*, unsigned char*, int64_t)>
void copy_item(const kvcopy::Item& it) {
  const int64_t n = it.num_segments();
  const int64_t bytes = it.segment_bytes();
  for (int64_t k = 0; k < n; ++k) {
    int64_t src, dst;
    it.segment(k, &src, &dst);
    kCopy(reinterpret_cast<const unsigned char*>(src), reinterpret_cast<unsigned char*>(dst),
          bytes);
  }
}

#if defined(KVCOPY_X86_LOOPS)
// n bytes with non-temporal stores, for calls too large for the caches: lines are
// written without being read first (a memcpy per run of a few KiB never reaches
// glibc's own streaming threshold, so each of its stores first read its line). SSE2,
// which every x86-64 CPU has: the stores, not the vector width, bound a copy to DRAM.
// A memcpy head aligns the destination to its 64-byte line (no line is written partly
// through the cache and partly around it); the tail is a memcpy.
void copy_stream(const unsigned char* s, unsigned char* d, int64_t n) {
  int64_t i = (int64_t)((64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63);
  if (i > n) i = n;
  memcpy(d, s, static_cast<size_t>(i));
  for (; i + 64 <= n; i += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(s + i + 512), _MM_HINT_T0);
    const __m128i w0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i w1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i w2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i w3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), w0);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), w1);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), w2);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), w3);
  }
  memcpy(d + i, s + i, static_cast<size_t>(n - i));
}

void copy_item_stream(const kvcopy::Item& it) {
  copy_item<copy_stream>(it);
  _mm_sfence();  // the streamed lines ordered before anything that follows
}
#define KVCOPY_STREAM_COPY 1
#endif

using ItemCopy = void (*)(const kvcopy::Item&);

// Whether a call of total_bytes streams its stores (stream_min_bytes > 0: the
// threshold; 0: never): one rule for the plain copy and the summing one.
inline bool streams(int64_t total_bytes, int64_t stream_min_bytes) {
  return stream_min_bytes > 0 && total_bytes >= stream_min_bytes;
}

// The plain copy of an item: non-temporal stores for a call of at least
// stream_min_bytes (> 0) where the CPU has them, else memcpy.
ItemCopy item_copy(int64_t total_bytes, int64_t stream_min_bytes) {
#if defined(KVCOPY_STREAM_COPY)
  if (streams(total_bytes, stream_min_bytes)) return copy_item_stream;
#else
  (void)total_bytes;
  (void)stream_min_bytes;
#endif
  return copy_item<copy_memcpy>;
}

struct MemcpyPiece {
  void operator()(int64_t src, int64_t dst, int64_t bytes) const {
    memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
           static_cast<size_t>(bytes));
  }
};

// One warp's share of one item, as block_copy_kernel.cuh's WarpItemCopy splits it:
// long segments piece by piece, short ones word by word through Item::byte_address
// (the lanes' order does not matter to the bytes; the addresses are what is checked).
struct RangeItemCopy {
  int64_t word_bytes;

  void operator()(const kvcopy::Item& it, int64_t lo, int64_t hi) const {
    if (it.segment_bytes() >= kvcopy::gather_below_bytes(word_bytes)) {
      MemcpyPiece fn;
      kvcopy::for_each_segment_piece(it, lo, hi, fn);
      return;
    }
    for (int64_t p = lo; p < hi; p += word_bytes) {
      int64_t src, dst;
      it.byte_address(p, &src, &dst);
      memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
             static_cast<size_t>(word_bytes));
    }
  }
};

// ---------------------------------------------------------------- checksummed runs
// Run r of block b of an item on both sides: segment r is run r of block 0 either way;
// block b is b block strides further (merged items: b run lengths, blocks adjacent).
inline void page_run(const kvcopy::Item& it, int64_t b, int64_t r, int64_t* src, int64_t* dst) {
  it.segment(r, src, dst);
  *src += b * (it.merged ? it.run_bytes() : it.entry[kvcopy::kSrcBlockStride]);
  *dst += b * (it.merged ? it.run_bytes() : it.entry[kvcopy::kDstBlockStride]);
}

// The runs of block b of an item in page order: fn(src, dst, key) with the addresses of
// run r and the key of its first word, for r = 0, 1, ... From counters over the page's
// three run dimensions (page_run_offsets' and page_run_position's decomposition of r),
// not per run: their divisions held ~1/6 of the samples of a converting copy's
// 512-byte runs under perf (not saved).
template <class Fn>
inline void for_each_page_run(const kvcopy::Item& it, int64_t b, uint64_t base, Fn&& fn) {
  const int64_t* d = it.entry + kvcopy::kRunDims;
  const int64_t* k = it.entry + kvcopy::kKeyStrides;
  const int64_t runs = it.entry[kvcopy::kRunsPerPage];
  int64_t src0, dst0;
  page_run(it, b, 0, &src0, &dst0);
  if (runs <= 0 || d[3] <= 0 || d[6] <= 0) return;  // the tables never make these
  int64_t r = 0;
  for (int64_t i0 = 0; r < runs; ++i0) {
    for (int64_t i1 = 0; i1 < d[3] && r < runs; ++i1) {
      const int64_t s1 = src0 + i0 * d[1] + i1 * d[4], d1 = dst0 + i0 * d[2] + i1 * d[5];
      const int64_t p1 = i0 * k[0] + i1 * k[1];
      for (int64_t i2 = 0; i2 < d[6] && r < runs; ++i2, ++r)
        fn(s1 + i2 * d[7], d1 + i2 * d[8],
           base + kvcopy::kPositionMul * (uint64_t)(p1 + i2 * k[2]));
    }
  }
}

// Copy one whole run of n bytes (or its end from a multiple of 8) and return the sum of
// its words' terms, word j keyed with key + j * 8 * kPositionMul (page_checksum.cuh);
// a last partial word is zero-padded.
constexpr uint64_t kWordStep = 8 * kvcopy::kPositionMul;

template <bool kCopy = true>
uint64_t copy_run_scalar(const unsigned char* s, unsigned char* d, int64_t n, uint64_t key) {
  uint64_t a0 = 0, a1 = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // two independent chains: the multiplies overlap
    uint64_t w0, w1;
    memcpy(&w0, s + i, 8);
    memcpy(&w1, s + i + 8, 8);
    if (kCopy) {
      memcpy(d + i, &w0, 8);
      memcpy(d + i + 8, &w1, 8);
    }
    a0 += kvcopy::product_term(w0 ^ key);
    a1 += kvcopy::product_term(w1 ^ (key + kWordStep));
    key += 2 * kWordStep;
  }
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    memcpy(&w, s + i, 8);
    if (kCopy) memcpy(d + i, &w, 8);
    a0 += kvcopy::product_term(w ^ key);
    key += kWordStep;
  }
  if (i < n) {
    uint64_t w = 0;
    memcpy(&w, s + i, static_cast<size_t>(n - i));
    if (kCopy) memcpy(d + i, s + i, static_cast<size_t>(n - i));
    a0 += kvcopy::product_term(w ^ key);
  }
  return a0 + a1;
}

// A run of rb bytes (rb >= piece > 0, piece a multiple of 64) cut into pieces of at
// most `piece` bytes, as equal as 64-byte multiples allow (the last the rest):
// fn(offset, bytes) in order. Below the streaming threshold a vector loop given
// piece_bytes copies a run this long piece by piece with memcpy and hashes each piece
// where it landed, still in cache (PieceStream): the bytes come from memory once, and
// memcpy's string moves write lines without reading them first, which vector stores
// cannot. The destination, not the source: the sum is of what the copy wrote, as the
// fused loop's is of the registers it stores, so a source rewritten in between (a late
// READ into D's span) cannot let stale bytes in the KV pass; re-reading the source
// instead was no faster (Xeon, three presets, two runs; not saved). Hashed right after
// its memcpy, with nothing fetched meanwhile, a piece's hash did not overlap the copy:
// on a Xeon the AVX-512 loop still gained over the fused loop (seeds2 6 MiB 1.14-1.22x
// -> 1.06-1.11x of the plain copy, mla 15 MiB 1.09-1.39x -> 1.06-1.12x), the AVX2 loop
// not at 6 MiB (1.13-1.45x -> 1.21-1.35x); docs/backends.md has the figures with the
// next piece prefetched under each hash.
template <class Fn>
inline void for_each_piece(int64_t rb, int64_t piece, Fn&& fn) {
  const int64_t count = (rb + piece - 1) / piece;
  const int64_t each = ((rb + count - 1) / count + 63) & ~(int64_t)63;  // <= piece
  for (int64_t o = 0; o < rb; o += each) fn(o, rb - o < each ? rb - o : each);
}

// The checksum of n bytes at p (a piece where memcpy put it), keyed from key, with the
// next piece's source [pf, pf + pf_n) prefetched into L1 along the way, whole or its
// first half: one vector loop's piece hash (hash_piece_avx512, hash_piece_avx2, each
// in both).
using PieceHash = uint64_t (*)(const unsigned char* p, int64_t n, uint64_t key,
                               const unsigned char* pf, int64_t pf_n);

// One thread's pieced copies, hashed one piece behind: a piece is memcpy'd when it
// comes and hashed where it landed when the next one comes, the next one's source
// prefetched under the hash (the piece hash's), so its memcpy reads from L1 and the
// hash's arithmetic overlaps the fetch instead of following it. The next piece may
// belong to another run, page or item of the thread's (only the thread's last piece
// has no prefetch): each piece's sum goes to its own page's slot. The destinations of
// a call never overlap (BlockCopier's _check_destinations refuses layers whose pages
// could share bytes; shared destinations are checked per call by csrc/call_plan.cpp's
// duplicate check and _check_shared_rows), so hashing a piece later reads what its
// memcpy wrote.
// Hashing each piece right after its memcpy, with nothing fetched under the hash:
// 1.11-1.20x the time of memcpy alone for 6 MiB of 32 KiB runs in 16 KiB
// pieces, scattered destinations; one behind, with the prefetch: 0.93-1.06x (T0 hint;
// T1 and T2 0.96-1.08x, NTA ~3x; hand-built, Xeon with AVX-512, both directions, not
// saved). From kWholePrefetchMaxBytes up, where the bytes may come from DRAM, only the
// next piece's first half, one line per 128 bytes hashed: there the whole piece cost
// more than it hid (15 MiB of 18 KiB runs in 9 KiB pieces: 1.16-1.24x memcpy against
// 1.08-1.21x with nothing prefetched), half of it did not (1.08-1.19x; 12 MiB of 32 KiB
// runs in 16 KiB pieces: half 1.08-1.24x, whole 1.11-1.35x, nothing 1.24-1.35x; same
// program, four runs each; kvcopy-bench pairs in docs/backends.md). Below it the whole
// piece: at 6 MiB half read 1.07-1.11x against whole 1.08-1.10x, and kvcopy-bench's
// median over nine pairs 1.06x against 1.05x (not saved).
struct PieceStream {
  PieceHash hash;
  const unsigned char* d = nullptr;  // the piece waiting for its hash
  int64_t n = 0;
  uint64_t key = 0;
  uint64_t* slot = nullptr;  // its page's sum; null: none waiting

  void add(const unsigned char* src, unsigned char* dst, int64_t bytes, uint64_t k,
           uint64_t* page_slot) {
    if (slot != nullptr) *slot += hash(d, n, key, src, bytes);
    memcpy(dst, src, static_cast<size_t>(bytes));
    d = dst;
    n = bytes;
    key = k;
    slot = page_slot;
  }
  // Before the thread's sums are read: the last piece's hash.
  void finish() {
    if (slot != nullptr) *slot += hash(d, n, key, nullptr, 0);
    slot = nullptr;
  }
};

#if defined(KVCOPY_X86_LOOPS)
// Where a piece hash's prefetch of the next piece stands after its steps over bytes
// [0, i): the first 64-byte multiple from i >> kHalf (the AVX2 loop's 64-byte steps
// reach half a line per step with kHalf: each line is prefetched once).
template <int kHalf>
inline int64_t prefetched_to(int64_t i) {
  static_assert(kHalf == 0 || kHalf == 1, "the whole next piece or its first half");
  return ((i >> kHalf) + 63) & ~(int64_t)63;
}

// A piece hash's prefetch at its step over bytes [i, i + kStep): the next piece's lines
// from offset prefetched_to(i) to prefetched_to(i + kStep), below end, so that the
// loop's steps cover its first half (kHalf) or all of it.
template <int kStep, int kHalf>
inline void prefetch_step(const unsigned char* pf, int64_t i, int64_t end) {
  for (int64_t j = prefetched_to<kHalf>(i); j < prefetched_to<kHalf>(i + kStep) && j < end; j += 64)
    _mm_prefetch(reinterpret_cast<const char*>(pf + j), _MM_HINT_T0);
}

// The lines of [pf + from, pf + to) a piece's hash loop did not reach (the next piece
// longer than this one): prefetched after it.
inline void prefetch_rest(const unsigned char* pf, int64_t from, int64_t to) {
  for (int64_t j = from; j < to; j += 64)
    _mm_prefetch(reinterpret_cast<const char*>(pf + j), _MM_HINT_T0);
}

// Source lines are prefetched this far ahead of the loads: the hash's multiplies keep
// fewer loads in flight than memcpy's string moves, and calls beyond the caches paid
// for it (~10% of a 36 MiB call on one core without; within noise with).
constexpr int64_t kPrefetchBytes = 512;

// product_term (page_checksum.cuh) on 8 words: vpmuludq multiplies the low 32 bits of
// each 64-bit lane into a 64-bit product.
KVCOPY_TARGET("avx512f") inline __m512i product_terms8(__m512i x) {
  return _mm512_add_epi64(_mm512_mul_epu32(x, _mm512_srli_epi64(x, 32)), x);
}

// The bytes of one run: 128 per step into the caller's two accumulators (reduced once
// per page); the head and the rest (< 128 bytes) in scalar code, returned. kStream:
// non-temporal stores (the destination 64-byte aligned by a scalar head, when it is
// 8-byte aligned: hash words stay whole), which write lines without reading them first,
// as memcpy's string moves do; used for calls too large for the caches. !kCopy (a
// piece's hash): no stores, and the next piece [pf, pf + pf_n) prefetched on the way,
// its first half with kHalf (prefetch_step).
template <bool kStream, bool kCopy = true, int kHalf = 0>
KVCOPY_TARGET("avx512f")
inline uint64_t
    run_avx512(const unsigned char* s, unsigned char* d, int64_t n, uint64_t key, __m512i& acc0,
               __m512i& acc1, const unsigned char* pf = nullptr, int64_t pf_n = 0) {
  int64_t i = 0;
  uint64_t head = 0;
  const int64_t pf_end = pf_n >> kHalf;
  const bool stream = kStream && (reinterpret_cast<uintptr_t>(d) & 7) == 0;
  if (stream) {
    i = (int64_t)((64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63);
    if (i > n) i = n & ~(int64_t)7;
    head = copy_run_scalar(s, d, i, key);
    key += (uint64_t)(i / 8) * kWordStep;
  }
  if (n - i >= 128) {
    const int64_t start = i;
    const __m512i lanes = _mm512_setr_epi64(0, (long long)kWordStep, (long long)(2 * kWordStep),
                                            (long long)(3 * kWordStep), (long long)(4 * kWordStep),
                                            (long long)(5 * kWordStep), (long long)(6 * kWordStep),
                                            (long long)(7 * kWordStep));
    __m512i k0 = _mm512_add_epi64(_mm512_set1_epi64((long long)key), lanes);
    __m512i k1 = _mm512_add_epi64(k0, _mm512_set1_epi64((long long)(8 * kWordStep)));
    const __m512i step = _mm512_set1_epi64((long long)(16 * kWordStep));
    // The sums in registers for the loop: added through the references, each step
    // waited on a store and a reload whenever the compiler did not inline this
    // function (it does not: the caller's lambda has the default target; 512-byte runs
    // then cost 1.4-1.8x the plain copy, kvcopy-bench minimum times, not saved).
    __m512i a0 = acc0, a1 = acc1;
    for (; i + 128 <= n; i += 128) {
      if (kCopy) {
        _mm_prefetch(reinterpret_cast<const char*>(s + i + kPrefetchBytes), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(s + i + kPrefetchBytes + 64), _MM_HINT_T0);
      } else {
        prefetch_step<128, kHalf>(pf, i, pf_end);
      }
      const __m512i w0 = _mm512_loadu_si512(s + i);
      const __m512i w1 = _mm512_loadu_si512(s + i + 64);
      if (!kCopy) {
      } else if (stream) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), w0);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 64), w1);
      } else {
        _mm512_storeu_si512(d + i, w0);
        _mm512_storeu_si512(d + i + 64, w1);
      }
      a0 = _mm512_add_epi64(a0, product_terms8(_mm512_xor_si512(w0, k0)));
      a1 = _mm512_add_epi64(a1, product_terms8(_mm512_xor_si512(w1, k1)));
      k0 = _mm512_add_epi64(k0, step);
      k1 = _mm512_add_epi64(k1, step);
    }
    acc0 = a0;
    acc1 = a1;
    key += (uint64_t)((i - start) / 8) * kWordStep;
  }
  if (!kCopy) prefetch_rest(pf, prefetched_to<kHalf>(i), pf_end);
  return head + copy_run_scalar<kCopy>(s + i, d + i, n - i, key);
}

// PieceHash for the AVX-512 loop.
template <int kHalf>
KVCOPY_TARGET("avx512f")
uint64_t hash_piece_avx512(const unsigned char* p, int64_t n, uint64_t key, const unsigned char* pf,
                           int64_t pf_n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
  const uint64_t rest =
      run_avx512<false, false, kHalf>(p, const_cast<unsigned char*>(p), n, key, a0, a1, pf,
                                      pf_n);  // no stores
  return rest + (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a0, a1));
}

// All runs of block b of the item, one reduction.
template <bool kStream>
KVCOPY_TARGET("avx512f")
uint64_t copy_page_avx512(const kvcopy::Item& it, int64_t b, uint64_t base) {
  __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
  uint64_t rest = 0;
  const int64_t rb = it.run_bytes();
  for_each_page_run(it, b, base, [&](int64_t src, int64_t dst, uint64_t key) {
    rest += run_avx512<kStream>(reinterpret_cast<const unsigned char*>(src),
                                reinterpret_cast<unsigned char*>(dst), rb, key, a0, a1);
  });
  if (kStream) _mm_sfence();  // the streamed lines ordered before anything that follows
  return rest + (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a0, a1));
}
#endif

#if defined(KVCOPY_X86_LOOPS)
// product_term on 4 words.
KVCOPY_TARGET("avx2") inline __m256i product_terms4(__m256i x) {
  return _mm256_add_epi64(_mm256_mul_epu32(x, _mm256_srli_epi64(x, 32)), x);
}

// run_avx512 with 256-bit vectors: 64 bytes per step.
template <bool kStream, bool kCopy = true, int kHalf = 0>
KVCOPY_TARGET("avx2")
inline uint64_t
    run_avx2(const unsigned char* s, unsigned char* d, int64_t n, uint64_t key, __m256i& acc0,
             __m256i& acc1, const unsigned char* pf = nullptr, int64_t pf_n = 0) {
  int64_t i = 0;
  uint64_t head = 0;
  const int64_t pf_end = pf_n >> kHalf;
  const bool stream = kStream && (reinterpret_cast<uintptr_t>(d) & 7) == 0;
  if (stream) {
    i = (int64_t)((32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31);
    if (i > n) i = n & ~(int64_t)7;
    head = copy_run_scalar(s, d, i, key);
    key += (uint64_t)(i / 8) * kWordStep;
  }
  if (n - i >= 64) {
    const int64_t start = i;
    const __m256i lanes = _mm256_setr_epi64x(0, (long long)kWordStep, (long long)(2 * kWordStep),
                                             (long long)(3 * kWordStep));
    __m256i k0 = _mm256_add_epi64(_mm256_set1_epi64x((long long)key), lanes);
    __m256i k1 = _mm256_add_epi64(k0, _mm256_set1_epi64x((long long)(4 * kWordStep)));
    const __m256i step = _mm256_set1_epi64x((long long)(8 * kWordStep));
    __m256i a0 = acc0, a1 = acc1;  // in registers for the loop (see run_avx512)
    for (; i + 64 <= n; i += 64) {
      if (kCopy)
        _mm_prefetch(reinterpret_cast<const char*>(s + i + kPrefetchBytes), _MM_HINT_T0);
      else
        prefetch_step<64, kHalf>(pf, i, pf_end);
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
      if (!kCopy) {
      } else if (stream) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), w0);
        _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), w1);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), w0);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i + 32), w1);
      }
      a0 = _mm256_add_epi64(a0, product_terms4(_mm256_xor_si256(w0, k0)));
      a1 = _mm256_add_epi64(a1, product_terms4(_mm256_xor_si256(w1, k1)));
      k0 = _mm256_add_epi64(k0, step);
      k1 = _mm256_add_epi64(k1, step);
    }
    acc0 = a0;
    acc1 = a1;
    key += (uint64_t)((i - start) / 8) * kWordStep;
  }
  if (!kCopy) prefetch_rest(pf, prefetched_to<kHalf>(i), pf_end);
  return head + copy_run_scalar<kCopy>(s + i, d + i, n - i, key);
}

KVCOPY_TARGET("avx2") inline uint64_t lane_sum4(__m256i v) {
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

// PieceHash for the AVX2 loop.
template <int kHalf>
KVCOPY_TARGET("avx2")
uint64_t hash_piece_avx2(const unsigned char* p, int64_t n, uint64_t key, const unsigned char* pf,
                         int64_t pf_n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
  const uint64_t rest = run_avx2<false, false, kHalf>(p, const_cast<unsigned char*>(p), n, key, a0,
                                                      a1, pf, pf_n);  // no stores
  return rest + lane_sum4(_mm256_add_epi64(a0, a1));
}

template <bool kStream>
KVCOPY_TARGET("avx2")
uint64_t copy_page_avx2(const kvcopy::Item& it, int64_t b, uint64_t base) {
  __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
  uint64_t rest = 0;
  const int64_t rb = it.run_bytes();
  for_each_page_run(it, b, base, [&](int64_t src, int64_t dst, uint64_t key) {
    rest += run_avx2<kStream>(reinterpret_cast<const unsigned char*>(src),
                              reinterpret_cast<unsigned char*>(dst), rb, key, a0, a1);
  });
  if (kStream) _mm_sfence();
  return rest + lane_sum4(_mm256_add_epi64(a0, a1));
}
#endif

uint64_t copy_page_scalar(const kvcopy::Item& it, int64_t b, uint64_t base) {
  uint64_t acc = 0;
  const int64_t rb = it.run_bytes();
  for_each_page_run(it, b, base, [&](int64_t src, int64_t dst, uint64_t key) {
    acc += copy_run_scalar(reinterpret_cast<const unsigned char*>(src),
                           reinterpret_cast<unsigned char*>(dst), rb, key);
  });
  return acc;
}

using PageCopy = uint64_t (*)(const kvcopy::Item&, int64_t, uint64_t);

// The loops this CPU can run: bit 0 the AVX2 loop, bit 1 the AVX-512 (F) loop.
int vector_loops() {
  int loops = 0;
#if defined(KVCOPY_SIMD_EMULATION)
  loops = 3;  // both, on SIMDe's portable code: any CPU runs them
#elif defined(KVCOPY_X86_LOOPS)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) loops |= 1;
  if (__builtin_cpu_supports("avx512f")) loops |= 2;
#endif
  return loops;
}

const int kVectorLoops = vector_loops();

enum SumsLoop : int { kScalarLoop = 0, kAvx2Loop = 1, kAvx512Loop = 2 };

// The loop for simd: 0 the scalar loop, 1 the widest vector loop the CPU has (else
// scalar), 2 the AVX2 loop (the caller has checked kVectorLoops). The one place the
// choice is made: kvcopy_cpu_sums_loop reports it to Python.
SumsLoop loop_for(int simd) {
  if (simd == 1 && (kVectorLoops & 2)) return kAvx512Loop;
  if (simd != 0 && (kVectorLoops & 1)) return kAvx2Loop;
  return kScalarLoop;
}

PageCopy page_copy(int simd, bool stream) {
#if defined(KVCOPY_X86_LOOPS)
  switch (loop_for(simd)) {
    case kAvx512Loop:
      return stream ? copy_page_avx512<true> : copy_page_avx512<false>;
    case kAvx2Loop:
      return stream ? copy_page_avx2<true> : copy_page_avx2<false>;
    case kScalarLoop:
      break;
  }
#endif
  (void)simd;
  (void)stream;
  return copy_page_scalar;
}

// How one call copies with sums: page by page through `page`; runs of at least `piece`
// bytes piece by piece (PieceStream) where piece_hash is set: in a vector loop, below
// the streaming threshold (streamed stores leave nothing in cache for a hash after),
// with piece_bytes > 0, in calls of at least piece_min_bytes (calls the caches hold ran
// faster in the fused loop). The scalar loop is far slower than memcpy: pieces would
// not pay.
struct SumsCopy {
  PageCopy page;
  PieceHash piece_hash;
  int64_t piece;
  bool whole;  // piece_hash prefetches the next piece whole, else its first half
};

SumsCopy sums_copy(int simd, bool stream, int64_t piece, int64_t piece_min, int64_t total_bytes) {
  SumsCopy c{page_copy(simd, stream), nullptr, piece, total_bytes < kWholePrefetchMaxBytes};
#if defined(KVCOPY_X86_LOOPS)
  if (!stream && piece > 0 && total_bytes >= piece_min) {
    const SumsLoop loop = loop_for(simd);
    if (loop == kAvx512Loop) c.piece_hash = c.whole ? hash_piece_avx512<0> : hash_piece_avx512<1>;
    if (loop == kAvx2Loop) c.piece_hash = c.whole ? hash_piece_avx2<0> : hash_piece_avx2<1>;
  }
#else
  (void)piece_min;
#endif
  return c;
}

void add_sum(uint64_t* sums, int64_t slot, uint64_t v) {
  __atomic_fetch_add(sums + slot, v, __ATOMIC_RELAXED);
}

// Every block of the item, page by page, each page's sum added to its slot of `sums`,
// which only the calling thread writes: a plain add. A locked add per page (threads
// sharing one array) waits for the page's stores to drain before the next page's loads
// may start: on a Xeon with AVX-512 it held 12% of the loop's samples under perf in a
// 6 MiB arena scatter of 32 KiB pages, one thread (not saved).
//
// Items whose runs are at least `piece` bytes go through the thread's PieceStream
// instead, when the call has a piece hash (a vector loop, below the streaming threshold,
// piece_bytes > 0): piece by piece, each page's pieces adding into its slot.
void copy_item_sums(const kvcopy::Item& it, const SumsCopy& c, PieceStream& pieces,
                    uint64_t* sums) {
  const uint64_t base = kvcopy::key_base(it.ordinal);
  const int64_t rb = it.run_bytes();
  if (c.piece_hash == nullptr || rb < c.piece) {
    for (int64_t b = 0; b < it.num_blocks; ++b) sums[it.out_index + b] += c.page(it, b, base);
    return;
  }
  for (int64_t b = 0; b < it.num_blocks; ++b) {
    uint64_t* slot = sums + it.out_index + b;
    for_each_page_run(it, b, base, [&](int64_t src, int64_t dst, uint64_t key) {
      const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
      unsigned char* d = reinterpret_cast<unsigned char*>(dst);
      for_each_piece(rb, c.piece, [&](int64_t o, int64_t n) {
        pieces.add(s + o, d + o, n, key + (uint64_t)(o / 8) * kWordStep, slot);
      });
    });
  }
}

// The checksum terms of the word of `word_bytes` at `src`, at offset q of a run of rb
// bytes at staging position pos_run: its 8-byte words when it has whole ones; a
// narrower word adds the zero-padded 8-byte word that starts at it, if one does (the
// owner rule of the GPU kernel, which reads the word's other bytes from the source).
uint64_t word_terms(int64_t src, int64_t q, int64_t rb, int64_t word_bytes, uint64_t base,
                    int64_t pos_run) {
  const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
  uint64_t acc = 0;
  if (word_bytes >= kvcopy::kHashWordBytes) {
    for (int64_t j = 0; j < word_bytes; j += 8) {
      uint64_t w;
      memcpy(&w, s + j, 8);
      acc += kvcopy::word_term(w, base, pos_run + q + j);
    }
    return acc;
  }
  if (q % kvcopy::kHashWordBytes) return 0;
  uint64_t w = 0;
  memcpy(&w, s, static_cast<size_t>(kvcopy::hash_word_bytes(q, rb)));
  return kvcopy::word_term(w, base, pos_run + q);
}

// RangeItemCopy with checksums: the item range cut into block ranges (one slot each),
// then, as the GPU kernel's checksum variant does, runs of at least the gather
// threshold piece by piece and shorter ones word by word through byte_place.
struct RangeItemCopySums {
  int64_t word_bytes;
  uint64_t* sums;

  void operator()(const kvcopy::Item& it, int64_t lo, int64_t hi) const {
    const uint64_t base = kvcopy::key_base(it.ordinal);
    const int64_t rb = it.run_bytes();
    const int64_t wb = word_bytes;
    auto block_range = [&](int64_t blo, int64_t bhi, int64_t block) {
      uint64_t acc = 0;
      if (rb >= kvcopy::gather_below_bytes(wb)) {
        auto piece = [&](int64_t src, int64_t dst, int64_t n, int64_t q, int64_t run) {
          memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                 static_cast<size_t>(n));
          const int64_t pos = kvcopy::page_run_position(it.entry, run);
          for (int64_t o = 0; o < n; o += wb) acc += word_terms(src + o, q + o, rb, wb, base, pos);
        };
        kvcopy::for_each_run_piece(it, blo, bhi, piece);
      } else {
        for (int64_t p = blo; p < bhi; p += wb) {
          int64_t src, dst, q, run;
          kvcopy::byte_place(it, p, &src, &dst, &q, &run);
          memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                 static_cast<size_t>(wb));
          acc += word_terms(src, q, rb, wb, base, kvcopy::page_run_position(it.entry, run));
        }
      }
      add_sum(sums, it.out_index + block, acc);
    };
    kvcopy::for_each_block_range(it, lo, hi, block_range);
  }
};

kvcopy::CursorTables cursor_tables(const int64_t* entries, const int64_t* group_offsets,
                                   const int64_t* group_entries, const int64_t* entry_bytes_prefix,
                                   int64_t num_groups, const int64_t* call_ext) {
  kvcopy::CursorTables t;
  t.entries = entries;
  t.group_offsets = group_offsets;
  t.group_entries = group_entries;
  t.entry_bytes_prefix = entry_bytes_prefix;
  t.call = kvcopy::CallView::from_packed(call_ext, num_groups);
  t.block_prefix = t.call.block_prefix;
  return t;
}

// The GPU kernel's split: `num_ranges` equal ranges of `word_bytes` words.
template <class Fn>
void walk_ranges(const kvcopy::CursorTables& t, int64_t total_bytes, int64_t num_ranges,
                 int64_t word_bytes, Fn& fn) {
  const int64_t words = total_bytes / word_bytes;
  for (int64_t w = 0; w < num_ranges; ++w) {
    const int64_t begin = (int64_t)((unsigned long long)words * (unsigned long long)w /
                                    (unsigned long long)num_ranges);
    const int64_t end = (int64_t)((unsigned long long)words * (unsigned long long)(w + 1) /
                                  (unsigned long long)num_ranges);
    kvcopy::for_each_item_range(t, begin * word_bytes, end * word_bytes, fn);
  }
}

// kvcopy_fold_page_sums' plan checks: every value's range of gathered sums inside
// [0, num_gather), in order, and every gather index inside the sums.
bool fold_plan_in_range(int64_t num_sums, const int64_t* gather, int64_t num_gather,
                        const int64_t* starts, int64_t num_values) {
  if (num_gather < 0 || num_values < 0) return false;
  for (int64_t v = 0; v < num_values; ++v) {
    const int64_t end = v + 1 < num_values ? starts[v + 1] : num_gather;
    if (starts[v] < 0 || starts[v] > end || end > num_gather) return false;
  }
  for (int64_t i = 0; i < num_gather; ++i)
    if (gather[i] < 0 || gather[i] >= num_sums) return false;
  return true;
}

// kvcopy_fold_page_sums' fold, on a plan fold_plan_in_range accepted.
int64_t fold_values(const uint64_t* sums, const int64_t* gather, const uint64_t* bounds,
                    int64_t num_gather, const int64_t* starts, int64_t num_values, uint64_t* values,
                    const uint64_t* want) {
  int64_t differ = 0;
  for (int64_t v = 0; v < num_values; ++v) {
    const int64_t end = v + 1 < num_values ? starts[v + 1] : num_gather;
    uint64_t acc = 0;
    for (int64_t i = starts[v]; i < end; ++i) acc += kvcopy::mix64(sums[gather[i]] ^ bounds[i]);
    if (values != nullptr) values[v] = acc;
    if (want != nullptr) differ += acc != want[v];
  }
  return differ;
}

}  // namespace

extern "C" {

// The ABI version kvcopy/native.py checks (its rule: csrc/kvcopy_abi.h; history:
// CHANGELOG.md). 13: option structs by pointer, kvcopy_cpu_entry_fields.
int kvcopy_cpu_abi_version() { return 13; }

// The entry-table width this library was compiled with (kernels/entry_layout.cuh):
// kvcopy/native.py refuses a library whose width is not the header's.
int kvcopy_cpu_entry_fields() { return KVCOPY_ENTRY_FIELDS; }

// Writes back and evicts the cache lines of [p, p + n) from every level of this CPU's
// caches (kvcopy-bench --cache cold: each timed call then starts with its bytes in
// memory, as a request's pages are in a serving engine). The bytes are unchanged.
// Returns 1 when flushed, 0 where this build has no flush instruction (nothing done),
// -1 for a null p with n > 0 or n < 0.
int kvcopy_cpu_flush(const void* p, int64_t n) {
  if (n < 0 || (p == nullptr && n > 0)) return -1;
#if defined(__x86_64__)
  // clflush: SSE2, every x86-64 CPU; a line size of 64 bytes on every one that has it.
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~static_cast<uintptr_t>(63);
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(n);
  for (uintptr_t a = first; a < end; a += 64)
    __builtin_ia32_clflush(reinterpret_cast<const void*>(a));
  __builtin_ia32_mfence();  // the flushes end before the caller's next load or store
  return 1;
#elif defined(__aarch64__)
  uint64_t ctr;
  asm volatile("mrs %0, ctr_el0" : "=r"(ctr));
  const uintptr_t line = static_cast<uintptr_t>(4) << ((ctr >> 16) & 0xF);  // DminLine, words
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~(line - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(n);
  for (uintptr_t a = first; a < end; a += line) asm volatile("dc civac, %0" : : "r"(a) : "memory");
  asm volatile("dsb sy" : : : "memory");  // as Linux ends a clean to the point of coherency
  return 1;
#else
  (void)p;
  return 0;
#endif
}

int kvcopy_cpu_has_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

// The tables (kvcopy_abi.h; entries [E][KVCOPY_ENTRY_FIELDS], see block_copy.cuh) and the
// packed call. total_bytes decides whether to use threads and (tuning's stream_min_bytes
// > 0) whether to store with non-temporal stores. Returns 0, or 3 (nothing done) for a
// struct shorter than this build's.
int kvcopy_cpu_copy(const kvcopy_tables* tables, const kvcopy_cpu_tuning* tuning,
                    const int64_t* packed, int64_t total_bytes) {
  if (!KVCOPY_STRUCT_OK(tables) || !KVCOPY_STRUCT_OK(tuning)) return 3;
  const int64_t* entries = tables->entries;
  const int64_t* group_offsets = tables->group_offsets;
  const int64_t* group_entries = tables->group_entries;
  const kvcopy::CallView call = kvcopy::CallView::from_packed(packed, tables->num_groups);
  const int64_t items = call.num_items();
  const ItemCopy copy = item_copy(total_bytes, tuning->stream_min_bytes);
#ifdef _OPENMP
  if (total_bytes >= kParallelMinBytes && items > 1) {
    const int threads = tuning->num_threads > 0 ? (int)tuning->num_threads : omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < items; ++i) {
      copy(kvcopy::locate_item(i, call, entries, group_offsets, group_entries));
    }
    return 0;
  }
#endif
  for (int64_t i = 0; i < items; ++i) {
    copy(kvcopy::locate_item(i, call, entries, group_offsets, group_entries));
  }
  return 0;
}

// The GPU kernel's work split, run on the host: the call's bytes cut into `num_ranges`
// equal ranges of `word_bytes` words, each walked with the byte cursor of
// block_copy.cuh exactly as one warp of csrc/cuda_copy.cu walks it. Tests run it over
// the shared cases with many range counts, so the addressing the GPU kernel uses is
// checked bit-exact on every CPU run. `call_ext` is the packed call followed by the
// block prefix (R+1 values); the tables' `entry_bytes_prefix` has GE+1 values.
int kvcopy_cpu_copy_ranges(const kvcopy_tables* tables, const int64_t* call_ext,
                           int64_t total_bytes, const kvcopy_ranges* ranges) {
  if (!KVCOPY_STRUCT_OK(tables) || !KVCOPY_STRUCT_OK(ranges)) return 3;
  const int64_t num_ranges = ranges->num_ranges, word_bytes = ranges->word_bytes;
  if (num_ranges < 1 || word_bytes < 1 || total_bytes % word_bytes) return 1;
  const kvcopy::CursorTables t =
      cursor_tables(tables->entries, tables->group_offsets, tables->group_entries,
                    tables->entry_bytes_prefix, tables->num_groups, call_ext);
  RangeItemCopy fn{word_bytes};
  walk_ranges(t, total_bytes, num_ranges, word_bytes, fn);
  return 0;
}

// kvcopy_cpu_copy with checksums: sums[num_sums] (one per block of the call, in call
// order; zeroed here first) receive each page's checksum (kernels/page_checksum.cuh).
// simd = 0 keeps to the scalar loop, 2 to the AVX2 loop (the tests compare them all);
// calls of at least stream_min_bytes (> 0) store with non-temporal stores; in the
// others of at least piece_min_bytes a vector loop copies runs of at least piece_bytes
// (> 0, a multiple of 64) with memcpy, piece by piece, each piece hashed one piece later
// (PieceStream; the next piece's source prefetched under it, whole in calls under
// kWholePrefetchMaxBytes, else its first half); 0: never.
// Returns 2, having written nothing, if the threads' rows cannot be allocated (3 for a
// struct shorter than this build's).
int kvcopy_cpu_copy_sums(const kvcopy_tables* tables, const kvcopy_cpu_tuning* tuning,
                         const int64_t* packed, int64_t total_bytes, uint64_t* sums,
                         int64_t num_sums) {
  if (!KVCOPY_STRUCT_OK(tables) || !KVCOPY_STRUCT_OK(tuning)) return 3;
  const int64_t* entries = tables->entries;
  const int64_t* group_offsets = tables->group_offsets;
  const int64_t* group_entries = tables->group_entries;
  const int num_threads = (int)tuning->num_threads;
  const int simd = (int)tuning->simd;
  const int64_t stream_min_bytes = tuning->stream_min_bytes;
  const int64_t piece_bytes = tuning->piece_bytes;
  const int64_t piece_min_bytes = tuning->piece_min_bytes;
  const kvcopy::CallView call = kvcopy::CallView::from_packed(packed, tables->num_groups);
  const int64_t items = call.num_items();
  const bool stream = streams(total_bytes, stream_min_bytes);
  const SumsCopy copy = sums_copy(simd, stream, piece_bytes, piece_min_bytes, total_bytes);
#ifdef _OPENMP
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  if (total_bytes >= kParallelMinBytes && items > 1 && threads > 1 && num_sums > 0) {
    // Threads share slots (the layers of a group), so each adds into its own row of
    // `rows`, summed into `sums` by this thread once every item is copied (one team,
    // one barrier, as the plain copy): no locked add per page.
    // 128 bytes at least between one row's end and the next row's start: rows sharing
    // a line would have two threads adding page sums pass it back and forth.
    const int64_t stride = ((num_sums + 15) & ~(int64_t)15) + 16;
    uint64_t* rows = static_cast<uint64_t*>(calloc((size_t)threads * (size_t)stride, 8));
    if (rows == nullptr) return 2;  // before any byte is written
#pragma omp parallel num_threads(threads)
    {
      uint64_t* row = rows + (int64_t)omp_get_thread_num() * stride;
      PieceStream pieces{copy.piece_hash};
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < items; ++i) {
        copy_item_sums(kvcopy::locate_item(i, call, entries, group_offsets, group_entries), copy,
                       pieces, row);
      }
      pieces.finish();  // before the barrier the rows are summed after
    }
    for (int64_t j = 0; j < num_sums; ++j) {
      uint64_t sum = 0;
      for (int t = 0; t < threads; ++t) sum += rows[(int64_t)t * stride + j];
      sums[j] = sum;
    }
    free(rows);
    return 0;
  }
#else
  (void)total_bytes;
  (void)num_threads;
#endif
  memset(sums, 0, sizeof(uint64_t) * (size_t)num_sums);
  PieceStream pieces{copy.piece_hash};
  for (int64_t i = 0; i < items; ++i) {
    copy_item_sums(kvcopy::locate_item(i, call, entries, group_offsets, group_entries), copy,
                   pieces, sums);
  }
  pieces.finish();
  return 0;
}

// Whether kvcopy_cpu_copy_sums, given these arguments, copies runs of run_bytes piece by
// piece (bit 0), and whether it then prefetches each next piece's source whole under
// the hash of the one before (bit 1) or its first half (bit 1 clear): what sums_copy
// decides, for the tests.
int kvcopy_cpu_sums_pieces(int64_t total_bytes, int64_t run_bytes,
                           const kvcopy_cpu_tuning* tuning) {
  if (!KVCOPY_STRUCT_OK(tuning)) return -1;
  const bool stream = streams(total_bytes, tuning->stream_min_bytes);
  const SumsCopy c = sums_copy((int)tuning->simd, stream, tuning->piece_bytes,
                               tuning->piece_min_bytes, total_bytes);
  if (c.piece_hash == nullptr || run_bytes < c.piece) return 0;
  return 1 | (c.whole ? 2 : 0);
}

// Whether kvcopy_cpu_copy streams a call of total_bytes (1) or memcpy's it (0).
int kvcopy_cpu_copy_streams(int64_t total_bytes, int64_t stream_min_bytes) {
  return item_copy(total_bytes, stream_min_bytes) != copy_item<copy_memcpy>;
}

// The arena's fold of page sums (kvcopy/nixl/modes/span_sums.py, FoldPlan.values): value v
// is the sum over i in [starts[v], starts[v + 1]) (the last value's to num_gather) of
// mix64(sums[gather[i]] ^ bounds[i]), mod 2^64; stored in values (when not null) and
// counted where it differs from want (when not null): kvcopy_fold in kvcopy_abi.h. Returns
// that count, or -1 (nothing stored) when starts or gather leave their ranges (or the
// struct is short). One call where numpy took ~14: right after a copy has swept the
// caches each of those cost several us.
int64_t kvcopy_fold_page_sums(const uint64_t* sums, int64_t num_sums, const kvcopy_fold* f) {
  if (!KVCOPY_STRUCT_OK(f) ||
      !fold_plan_in_range(num_sums, f->gather, f->num_gather, f->starts, f->num_values))
    return -1;
  return fold_values(sums, f->gather, f->bounds, f->num_gather, f->starts, f->num_values, f->values,
                     f->want);
}

// kvcopy_cpu_copy_sums, then kvcopy_fold_page_sums of the sums it wrote, in one call: D
// compares its scatter's sums (P folds its pack's) in the copy's own host call, not in
// a second one made after the copy has swept the caches (each cost 45-70 us there, warm
// a few; 6 MiB complete on a 2-core Xeon VM, scratch timing, not saved).
// Returns the count of values differing from the fold's want (0 when want is null), or,
// before any byte is written, -1 when the fold plan's indices leave their ranges, -2
// when the threads' rows cannot be allocated, -3 for a struct shorter than this build's.
int64_t kvcopy_cpu_copy_sums_fold(const kvcopy_tables* tables, const kvcopy_cpu_tuning* tuning,
                                  const int64_t* packed, int64_t total_bytes, uint64_t* sums,
                                  int64_t num_sums, const kvcopy_fold* f) {
  if (!KVCOPY_STRUCT_OK(tables) || !KVCOPY_STRUCT_OK(tuning) || !KVCOPY_STRUCT_OK(f)) return -3;
  if (!fold_plan_in_range(num_sums, f->gather, f->num_gather, f->starts, f->num_values)) return -1;
  if (kvcopy_cpu_copy_sums(tables, tuning, packed, total_bytes, sums, num_sums) != 0) return -2;
  return fold_values(sums, f->gather, f->bounds, f->num_gather, f->starts, f->num_values, f->values,
                     f->want);
}

// The vector loops kvcopy_cpu_copy_sums can run on this CPU: bit 0 AVX2, bit 1 AVX-512.
int kvcopy_cpu_sums_loops() { return kVectorLoops; }

// The loop kvcopy_cpu_copy_sums runs for `simd`: 0 scalar, 1 AVX2, 2 AVX-512.
int kvcopy_cpu_sums_loop(int simd) { return loop_for(simd); }

// kvcopy_cpu_copy_ranges with checksums: the GPU checksum kernel's work split and
// keying, run on the host, sums as in kvcopy_cpu_copy_sums.
int kvcopy_cpu_copy_ranges_sums(const kvcopy_tables* tables, const int64_t* call_ext,
                                int64_t total_bytes, const kvcopy_ranges* ranges, uint64_t* sums,
                                int64_t num_sums) {
  if (!KVCOPY_STRUCT_OK(tables) || !KVCOPY_STRUCT_OK(ranges)) return 3;
  const int64_t num_ranges = ranges->num_ranges, word_bytes = ranges->word_bytes;
  if (num_ranges < 1 || word_bytes < 1 || total_bytes % word_bytes) return 1;
  memset(sums, 0, sizeof(uint64_t) * (size_t)num_sums);
  const kvcopy::CursorTables t =
      cursor_tables(tables->entries, tables->group_offsets, tables->group_entries,
                    tables->entry_bytes_prefix, tables->num_groups, call_ext);
  RangeItemCopySums fn{word_bytes, sums};
  walk_ranges(t, total_bytes, num_ranges, word_bytes, fn);
  return 0;
}

}  // extern "C"
