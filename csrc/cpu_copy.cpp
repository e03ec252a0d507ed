// Backend `cpu`: the item body of kernels/block_copy.cuh compiled for the host.
//
// One C call per copy: items are spread over OpenMP threads (dynamic schedule, items
// differ in size), each item's segments copied with memcpy. Small calls stay on the
// calling thread: waking a team costs more than copying a few pages.
#include <stdint.h>
#include <string.h>

#include "block_copy.cuh"

#ifdef _OPENMP
#include <omp.h>
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

}  // namespace

extern "C" {

// Bumped whenever a C signature of this library changes (kvcopy/backends/native.py
// refuses a library whose version is not the one the Python code was written for).
// 2: kvcopy_plan_call with per-thread stamps and its error report in `packed`.
int kvcopy_cpu_abi_version() { return 2; }

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
  kvcopy::CursorTables t;
  t.entries = entries;
  t.group_offsets = group_offsets;
  t.group_entries = group_entries;
  t.entry_bytes_prefix = entry_bytes_prefix;
  t.call = kvcopy::CallView::from_packed(call_ext, num_groups);
  t.block_prefix = t.call.runs + 3 * t.call.run_offsets[num_groups];
  const int64_t words = total_bytes / word_bytes;
  RangeItemCopy fn{word_bytes};
  for (int64_t w = 0; w < num_ranges; ++w) {
    const int64_t begin = (int64_t)((unsigned long long)words * (unsigned long long)w /
                                    (unsigned long long)num_ranges);
    const int64_t end = (int64_t)((unsigned long long)words * (unsigned long long)(w + 1) /
                                  (unsigned long long)num_ranges);
    kvcopy::for_each_item_range(t, begin * word_bytes, end * word_bytes, fn);
  }
  return 0;
}

}  // extern "C"
