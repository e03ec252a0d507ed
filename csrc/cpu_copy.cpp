// Backend `cpu`: the item body of kernels/block_copy.cuh compiled for the host.
//
// One C call per copy: items are spread over OpenMP threads (dynamic schedule, items
// differ in size), each item's segments copied with memcpy. Small calls stay on the
// calling thread: waking a team costs more than copying a few pages.
//
// With checksums (kvcopy_cpu_copy_sums, kernels/page_checksum.cuh), each run is copied
// by a loop that hashes the words it holds in registers on their way to the
// destination: 128 bytes per step with AVX-512 (F + DQ, for the 64-bit multiply), else
// 64 with AVX2 (each 64-bit multiply built from two 32-bit ones), else 16 bytes per
// step in scalar code. Each page's sum is added to its slot once per
// (item, block) with a relaxed atomic add (threads share slots: the layers of a group).
#include <stdint.h>
#include <string.h>

#include "block_copy.cuh"
#include "page_checksum.cuh"

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvcopy's checksums read words little-endian, as the GPU does"
#endif

namespace {

// Below this many bytes a call runs on one thread: waking an OpenMP team costs more
// than copying that much.
constexpr int64_t kParallelMinBytes = 1 << 20;

void copy_item(const kvcopy::Item& it) {
  const int64_t n = it.num_segments();
  const int64_t bytes = it.segment_bytes();
  for (int64_t k = 0; k < n; ++k) {
    int64_t src, dst;
    it.segment(k, &src, &dst);
    memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
           static_cast<size_t>(bytes));
  }
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

// The key of the first word of run r of an item's pages.
inline uint64_t run_key(const kvcopy::Item& it, uint64_t base, int64_t r) {
  return base + kvcopy::kPositionMul * (uint64_t)kvcopy::page_run_position(it.entry, r);
}

// Copy one whole run of n bytes (or its end from a multiple of 8) and return the sum of
// its words' terms, word j keyed with key + j * 8 * kPositionMul (page_checksum.cuh);
// a last partial word is zero-padded.
constexpr uint64_t kWordStep = 8 * kvcopy::kPositionMul;

uint64_t copy_run_scalar(const unsigned char* s, unsigned char* d, int64_t n, uint64_t key) {
  uint64_t a0 = 0, a1 = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // two independent chains: the multiplies overlap
    uint64_t w0, w1;
    memcpy(&w0, s + i, 8);
    memcpy(&w1, s + i + 8, 8);
    memcpy(d + i, &w0, 8);
    memcpy(d + i + 8, &w1, 8);
    a0 += kvcopy::mix64(w0 ^ key);
    a1 += kvcopy::mix64(w1 ^ (key + kWordStep));
    key += 2 * kWordStep;
  }
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    memcpy(&w, s + i, 8);
    memcpy(d + i, &w, 8);
    a0 += kvcopy::mix64(w ^ key);
    key += kWordStep;
  }
  if (i < n) {
    uint64_t w = 0;
    memcpy(&w, s + i, static_cast<size_t>(n - i));
    memcpy(d + i, s + i, static_cast<size_t>(n - i));
    a0 += kvcopy::mix64(w ^ key);
  }
  return a0 + a1;
}

#if defined(__x86_64__)
// Source lines are prefetched this far ahead of the loads: the hash's multiplies keep
// fewer loads in flight than memcpy's string moves, and calls beyond the caches paid
// for it (~10% of a 36 MiB call on one core without; within noise with).
constexpr int64_t kPrefetchBytes = 512;

__attribute__((target("avx512f,avx512dq"))) inline __m512i mix64x8(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi64(x, 33));
  x = _mm512_mullo_epi64(x, _mm512_set1_epi64((long long)kvcopy::kMix1));
  x = _mm512_xor_si512(x, _mm512_srli_epi64(x, 33));
  x = _mm512_mullo_epi64(x, _mm512_set1_epi64((long long)kvcopy::kMix2));
  return _mm512_xor_si512(x, _mm512_srli_epi64(x, 33));
}

// The bytes of one run: 128 per step into the caller's two accumulators (reduced once
// per page); the head and the rest (< 128 bytes) in scalar code, returned. kStream:
// non-temporal stores (the destination 64-byte aligned by a scalar head, when it is
// 8-byte aligned: hash words stay whole), which write lines without reading them first,
// as memcpy's string moves do; used for calls too large for the caches.
template <bool kStream>
__attribute__((target("avx512f,avx512dq"))) inline uint64_t run_avx512(const unsigned char* s,
                                                                       unsigned char* d, int64_t n,
                                                                       uint64_t key, __m512i& a0,
                                                                       __m512i& a1) {
  int64_t i = 0;
  uint64_t head = 0;
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
    for (; i + 128 <= n; i += 128) {
      _mm_prefetch(reinterpret_cast<const char*>(s + i + kPrefetchBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(s + i + kPrefetchBytes + 64), _MM_HINT_T0);
      const __m512i w0 = _mm512_loadu_si512(s + i);
      const __m512i w1 = _mm512_loadu_si512(s + i + 64);
      if (stream) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), w0);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 64), w1);
      } else {
        _mm512_storeu_si512(d + i, w0);
        _mm512_storeu_si512(d + i + 64, w1);
      }
      a0 = _mm512_add_epi64(a0, mix64x8(_mm512_xor_si512(w0, k0)));
      a1 = _mm512_add_epi64(a1, mix64x8(_mm512_xor_si512(w1, k1)));
      k0 = _mm512_add_epi64(k0, step);
      k1 = _mm512_add_epi64(k1, step);
    }
    key += (uint64_t)((i - start) / 8) * kWordStep;
  }
  return head + copy_run_scalar(s + i, d + i, n - i, key);
}

// All runs of block b of the item, one reduction.
template <bool kStream>
__attribute__((target("avx512f,avx512dq"))) uint64_t copy_page_avx512(const kvcopy::Item& it,
                                                                      int64_t b, uint64_t base) {
  __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
  uint64_t rest = 0;
  for (int64_t r = 0; r < it.entry[kvcopy::kRunsPerPage]; ++r) {
    int64_t src, dst;
    page_run(it, b, r, &src, &dst);
    rest += run_avx512<kStream>(reinterpret_cast<const unsigned char*>(src),
                                reinterpret_cast<unsigned char*>(dst), it.run_bytes(),
                                run_key(it, base, r), a0, a1);
  }
  if (kStream) _mm_sfence();  // the streamed lines ordered before anything that follows
  return rest + (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a0, a1));
}
#endif

#if defined(__x86_64__)
// AVX2 has no 64-bit multiply: x * m = x_lo * m_lo + ((x_hi * m_lo + x_lo * m_hi) << 32).
// The first term is one vpmuludq; the two cross terms, of which only the low 32 bits
// count, are one vpmulld against m with its halves swapped (x_lo * m_hi in the low
// lane, x_hi * m_lo in the high one), added in the high lane. 6 instructions where
// AVX-512 DQ has one. On Zen 3 the hash alone (from L1) ran at 13.4-15.4 GB/s this way
// against 12.8-13.5 with three vpmuludq (7 instructions), five runs each, interleaved.
struct Mul64Constant4 {
  __m256i lo;       // m_lo in each 64-bit lane
  __m256i swapped;  // m_hi | m_lo << 32 in each 64-bit lane
};

__attribute__((target("avx2"))) inline Mul64Constant4 mul64_constant4(uint64_t m) {
  return {_mm256_set1_epi64x((long long)(m & 0xffffffffu)),
          _mm256_set1_epi64x((long long)((m >> 32) | (m << 32)))};
}

__attribute__((target("avx2"))) inline __m256i mul64x4(__m256i x, const Mul64Constant4& m) {
  const __m256i high_lanes = _mm256_set1_epi64x((long long)0xffffffff00000000ull);
  const __m256i cross = _mm256_mullo_epi32(x, m.swapped);
  const __m256i high =
      _mm256_add_epi64(_mm256_and_si256(cross, high_lanes), _mm256_slli_epi64(cross, 32));
  return _mm256_add_epi64(_mm256_mul_epu32(x, m.lo), high);
}

struct MixConstants4 {
  Mul64Constant4 m1, m2;
};

__attribute__((target("avx2"))) inline __m256i mix64x4(__m256i x, const MixConstants4& c) {
  x = _mm256_xor_si256(x, _mm256_srli_epi64(x, 33));
  x = mul64x4(x, c.m1);
  x = _mm256_xor_si256(x, _mm256_srli_epi64(x, 33));
  x = mul64x4(x, c.m2);
  return _mm256_xor_si256(x, _mm256_srli_epi64(x, 33));
}

// run_avx512 with 256-bit vectors: 64 bytes per step.
template <bool kStream>
__attribute__((target("avx2"))) inline uint64_t run_avx2(const unsigned char* s, unsigned char* d,
                                                         int64_t n, uint64_t key, __m256i& a0,
                                                         __m256i& a1) {
  int64_t i = 0;
  uint64_t head = 0;
  const bool stream = kStream && (reinterpret_cast<uintptr_t>(d) & 7) == 0;
  if (stream) {
    i = (int64_t)((32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31);
    if (i > n) i = n & ~(int64_t)7;
    head = copy_run_scalar(s, d, i, key);
    key += (uint64_t)(i / 8) * kWordStep;
  }
  if (n - i >= 64) {
    const int64_t start = i;
    const MixConstants4 c{mul64_constant4(kvcopy::kMix1), mul64_constant4(kvcopy::kMix2)};
    const __m256i lanes = _mm256_setr_epi64x(0, (long long)kWordStep, (long long)(2 * kWordStep),
                                             (long long)(3 * kWordStep));
    __m256i k0 = _mm256_add_epi64(_mm256_set1_epi64x((long long)key), lanes);
    __m256i k1 = _mm256_add_epi64(k0, _mm256_set1_epi64x((long long)(4 * kWordStep)));
    const __m256i step = _mm256_set1_epi64x((long long)(8 * kWordStep));
    for (; i + 64 <= n; i += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(s + i + kPrefetchBytes), _MM_HINT_T0);
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
      if (stream) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), w0);
        _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), w1);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), w0);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i + 32), w1);
      }
      a0 = _mm256_add_epi64(a0, mix64x4(_mm256_xor_si256(w0, k0), c));
      a1 = _mm256_add_epi64(a1, mix64x4(_mm256_xor_si256(w1, k1), c));
      k0 = _mm256_add_epi64(k0, step);
      k1 = _mm256_add_epi64(k1, step);
    }
    key += (uint64_t)((i - start) / 8) * kWordStep;
  }
  return head + copy_run_scalar(s + i, d + i, n - i, key);
}

template <bool kStream>
__attribute__((target("avx2"))) uint64_t copy_page_avx2(const kvcopy::Item& it, int64_t b,
                                                        uint64_t base) {
  __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
  uint64_t rest = 0;
  for (int64_t r = 0; r < it.entry[kvcopy::kRunsPerPage]; ++r) {
    int64_t src, dst;
    page_run(it, b, r, &src, &dst);
    rest += run_avx2<kStream>(reinterpret_cast<const unsigned char*>(src),
                              reinterpret_cast<unsigned char*>(dst), it.run_bytes(),
                              run_key(it, base, r), a0, a1);
  }
  if (kStream) _mm_sfence();
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(a0, a1));
  return rest + lanes[0] + lanes[1] + lanes[2] + lanes[3];
}
#endif

uint64_t copy_page_scalar(const kvcopy::Item& it, int64_t b, uint64_t base) {
  uint64_t acc = 0;
  for (int64_t r = 0; r < it.entry[kvcopy::kRunsPerPage]; ++r) {
    int64_t src, dst;
    page_run(it, b, r, &src, &dst);
    acc += copy_run_scalar(reinterpret_cast<const unsigned char*>(src),
                           reinterpret_cast<unsigned char*>(dst), it.run_bytes(),
                           run_key(it, base, r));
  }
  return acc;
}

using PageCopy = uint64_t (*)(const kvcopy::Item&, int64_t, uint64_t);

// The loops this CPU can run: bit 0 the AVX2 loop, bit 1 the AVX-512 (F + DQ) loop.
int vector_loops() {
  int loops = 0;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) loops |= 1;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) loops |= 2;
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
#if defined(__x86_64__)
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

void add_sum(uint64_t* sums, int64_t slot, uint64_t v) {
  __atomic_fetch_add(sums + slot, v, __ATOMIC_RELAXED);
}

// Every block of the item, page by page, each page's sum added to its slot: one locked
// add per page, which waits for the stores before it to drain (run by run, as merged
// items were, a layout-converting copy's 512-byte runs cost 1.06-1.12x of the plain
// copy on one core; page by page 1.05-1.08x, the same runs).
void copy_item_sums(const kvcopy::Item& it, PageCopy copy_page, uint64_t* sums) {
  const uint64_t base = kvcopy::key_base(it.ordinal);
  for (int64_t b = 0; b < it.num_blocks; ++b)
    add_sum(sums, it.out_index + b, copy_page(it, b, base));
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

}  // namespace

extern "C" {

// Bumped whenever a C signature of this library changes (kvcopy/backends/native.py
// refuses a library whose version is not the one the Python code was written for).
// 2: kvcopy_plan_call with per-thread stamps and its error report in `packed`.
// 4: kvcopy_cpu_sums_loops and kvcopy_cpu_sums_loop replace kvcopy_cpu_sums_simd;
//    simd = 2 picks the AVX2 loop.
int kvcopy_cpu_abi_version() { return 4; }

int kvcopy_cpu_has_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

// entries [E][8], group_offsets [G+1], group_entries, packed call (see block_copy.cuh).
// total_bytes only decides whether to use threads; num_threads <= 0: OpenMP's default.
int kvcopy_cpu_copy(const int64_t* entries, const int64_t* group_offsets,
                    const int64_t* group_entries, int64_t num_groups, const int64_t* packed,
                    int64_t total_bytes, int num_threads) {
  const kvcopy::CallView call = kvcopy::CallView::from_packed(packed, num_groups);
  const int64_t items = call.num_items();
#ifdef _OPENMP
  if (total_bytes >= kParallelMinBytes && items > 1) {
    const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < items; ++i) {
      copy_item(kvcopy::locate_item(i, call, entries, group_offsets, group_entries));
    }
    return 0;
  }
#else
  (void)total_bytes;
  (void)num_threads;
#endif
  for (int64_t i = 0; i < items; ++i) {
    copy_item(kvcopy::locate_item(i, call, entries, group_offsets, group_entries));
  }
  return 0;
}

// The GPU kernel's work split, run on the host: the call's bytes cut into `num_ranges`
// equal ranges of `word_bytes` words, each walked with the byte cursor of
// block_copy.cuh exactly as one warp of csrc/cuda_copy.cu walks it. Tests run it over
// the shared cases with many range counts, so the addressing the GPU kernel uses is
// checked bit-exact on every CPU run. `call_ext` is the packed call followed by the
// block prefix (R+1 values); `entry_bytes_prefix` has GE+1 values.
int kvcopy_cpu_copy_ranges(const int64_t* entries, const int64_t* group_offsets,
                           const int64_t* group_entries, const int64_t* entry_bytes_prefix,
                           int64_t num_groups, const int64_t* call_ext, int64_t total_bytes,
                           int64_t num_ranges, int64_t word_bytes) {
  if (num_ranges < 1 || word_bytes < 1 || total_bytes % word_bytes) return 1;
  const kvcopy::CursorTables t = cursor_tables(entries, group_offsets, group_entries,
                                               entry_bytes_prefix, num_groups, call_ext);
  RangeItemCopy fn{word_bytes};
  walk_ranges(t, total_bytes, num_ranges, word_bytes, fn);
  return 0;
}

// kvcopy_cpu_copy with checksums: sums[num_sums] (one per block of the call, in call
// order; zeroed here first) receive each page's checksum (kernels/page_checksum.cuh).
// simd = 0 keeps to the scalar loop, 2 to the AVX2 loop (the tests compare them all);
// calls of at least stream_min_bytes (> 0) store with non-temporal stores.
int kvcopy_cpu_copy_sums(const int64_t* entries, const int64_t* group_offsets,
                         const int64_t* group_entries, int64_t num_groups, const int64_t* packed,
                         int64_t total_bytes, int num_threads, uint64_t* sums, int64_t num_sums,
                         int simd, int64_t stream_min_bytes) {
  memset(sums, 0, sizeof(uint64_t) * (size_t)num_sums);
  const kvcopy::CallView call = kvcopy::CallView::from_packed(packed, num_groups);
  const int64_t items = call.num_items();
  const bool stream = stream_min_bytes > 0 && total_bytes >= stream_min_bytes;
  const PageCopy copy_page = page_copy(simd, stream);
#ifdef _OPENMP
  if (total_bytes >= kParallelMinBytes && items > 1) {
    const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < items; ++i) {
      copy_item_sums(kvcopy::locate_item(i, call, entries, group_offsets, group_entries), copy_page,
                     sums);
    }
    return 0;
  }
#else
  (void)total_bytes;
  (void)num_threads;
#endif
  for (int64_t i = 0; i < items; ++i) {
    copy_item_sums(kvcopy::locate_item(i, call, entries, group_offsets, group_entries), copy_page,
                   sums);
  }
  return 0;
}

// The vector loops kvcopy_cpu_copy_sums can run on this CPU: bit 0 AVX2, bit 1 AVX-512.
int kvcopy_cpu_sums_loops() { return kVectorLoops; }

// The loop kvcopy_cpu_copy_sums runs for `simd`: 0 scalar, 1 AVX2, 2 AVX-512.
int kvcopy_cpu_sums_loop(int simd) { return loop_for(simd); }

// kvcopy_cpu_copy_ranges with checksums: the GPU checksum kernel's work split and
// keying, run on the host, sums as in kvcopy_cpu_copy_sums.
int kvcopy_cpu_copy_ranges_sums(const int64_t* entries, const int64_t* group_offsets,
                                const int64_t* group_entries, const int64_t* entry_bytes_prefix,
                                int64_t num_groups, const int64_t* call_ext, int64_t total_bytes,
                                int64_t num_ranges, int64_t word_bytes, uint64_t* sums,
                                int64_t num_sums) {
  if (num_ranges < 1 || word_bytes < 1 || total_bytes % word_bytes) return 1;
  memset(sums, 0, sizeof(uint64_t) * (size_t)num_sums);
  const kvcopy::CursorTables t = cursor_tables(entries, group_offsets, group_entries,
                                               entry_bytes_prefix, num_groups, call_ext);
  RangeItemCopySums fn{word_bytes, sums};
  walk_ranges(t, total_bytes, num_ranges, word_bytes, fn);
  return 0;
}

}  // extern "C"
