// Per-call planning in one C call: validate every group's block ids and pack the
// kernel's call array (kernels/block_copy.cuh) -- the host side of every backend.
//
// The numpy version in kvcopy/tables.py does the same in ~15 numpy calls per group
// (about 25 us per group on this machine); a copy of 48 layers x 6 groups has to
// cost microseconds in total on the host, so the per-call path is one pass in C.
//
// Duplicate destinations are found with a stamp array owned by the caller, one row
// of one int64 per destination block for each class of groups that share destination
// bytes: block b was already written in this call by class c iff
// seen[c * capacity + b] == stamp. The stamp grows by one every call, so the array is
// never cleared.
#include <stdint.h>

namespace {

enum PlanError : int64_t {
  kOk = 0,
  kSrcRange = 1,
  kDstRange = 2,
  kDuplicate = 3,
};

// The planner itself; with_prefix: also write the block prefix after the runs.
int64_t plan_call(int64_t num_groups, const int64_t* src_ids, const int64_t* dst_ids,
                  const int64_t* group_lens, const int64_t* src_limit, const int64_t* dst_limit,
                  const int64_t* dst_class, const int64_t* entries_per_group, int64_t* seen,
                  int64_t dst_capacity, int64_t stamp, int64_t* packed, int64_t* err,
                  bool with_prefix);

}  // namespace

extern "C" {

// src_ids, dst_ids: all groups' ids concatenated; group_lens[G].
// src_limit[G], dst_limit[G]: ids must lie in [0, limit).
// dst_class[G]: groups of one class share destination bytes (their ids must be
//   disjoint); a group alone in its class checks only against itself. Classes are
//   numbered from 0; seen has a row of dst_capacity stamps per class.
// entries_per_group[G]: layers (entries) each group copies.
// seen[classes][dst_capacity]: the stamp array; stamp: this call's stamp (> 0).
// packed: out, room for 2 * (G + 1) + 3 * total ids.
// err[3]: out, on failure (code, group, offending id).
// Returns the number of int64 written to packed, or -1 on a validation error.
int64_t kvcopy_plan_call(int64_t num_groups, const int64_t* src_ids, const int64_t* dst_ids,
                         const int64_t* group_lens, const int64_t* src_limit,
                         const int64_t* dst_limit, const int64_t* dst_class,
                         const int64_t* entries_per_group, int64_t* seen, int64_t dst_capacity,
                         int64_t stamp, int64_t* packed, int64_t* err) {
  return plan_call(num_groups, src_ids, dst_ids, group_lens, src_limit, dst_limit, dst_class,
                   entries_per_group, seen, dst_capacity, stamp, packed, err, false);
}

// kvcopy_plan_call, and the fused CUDA kernel's block prefix in the same call: R + 1
// words right after the runs (prefix[r] = blocks in runs before r), so the call array
// the `cuda` backend hands to its launch is packed[0 : n + R + 1] as written, with no
// numpy pass on the host (~5-8 us per call saved). packed needs room for
// 2 * (G + 1) + 4 * total ids + 1 words. Returns n, as kvcopy_plan_call.
int64_t kvcopy_plan_call_prefix(int64_t num_groups, const int64_t* src_ids, const int64_t* dst_ids,
                                const int64_t* group_lens, const int64_t* src_limit,
                                const int64_t* dst_limit, const int64_t* dst_class,
                                const int64_t* entries_per_group, int64_t* seen,
                                int64_t dst_capacity, int64_t stamp, int64_t* packed,
                                int64_t* err) {
  return plan_call(num_groups, src_ids, dst_ids, group_lens, src_limit, dst_limit, dst_class,
                   entries_per_group, seen, dst_capacity, stamp, packed, err, true);
}

// Does nothing and returns 0 (success): `kvcopy-bench overhead` calls it through ctypes
// typed as a launch function, to time the host path without a device.
int kvcopy_host_noop() { return 0; }

}  // extern "C"

namespace {

int64_t plan_call(int64_t num_groups, const int64_t* src_ids, const int64_t* dst_ids,
                  const int64_t* group_lens, const int64_t* src_limit, const int64_t* dst_limit,
                  const int64_t* dst_class, const int64_t* entries_per_group, int64_t* seen,
                  int64_t dst_capacity, int64_t stamp, int64_t* packed, int64_t* err,
                  bool with_prefix) {
  int64_t* run_offsets = packed;
  int64_t* item_offsets = packed + num_groups + 1;
  int64_t* runs = packed + 2 * (num_groups + 1);
  int64_t r = 0;
  int64_t pos = 0;
  run_offsets[0] = 0;
  item_offsets[0] = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t n = group_lens[g];
    int64_t* seen_class = seen + dst_class[g] * dst_capacity;
    const int64_t first_run = r;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = src_ids[pos + i];
      const int64_t d = dst_ids[pos + i];
      if (s < 0 || s >= src_limit[g]) {
        err[0] = kSrcRange, err[1] = g, err[2] = s;
        return -1;
      }
      if (d < 0 || d >= dst_limit[g] || d >= dst_capacity) {
        err[0] = kDstRange, err[1] = g, err[2] = d;
        return -1;
      }
      if (seen_class[d] == stamp) {
        err[0] = kDuplicate, err[1] = g, err[2] = d;
        return -1;
      }
      seen_class[d] = stamp;
      // Extend the open run when both sides continue it, else open a new one.
      if (r > first_run && runs[3 * (r - 1)] + runs[3 * (r - 1) + 2] == s &&
          runs[3 * (r - 1) + 1] + runs[3 * (r - 1) + 2] == d) {
        runs[3 * (r - 1) + 2] += 1;
      } else {
        runs[3 * r] = s;
        runs[3 * r + 1] = d;
        runs[3 * r + 2] = 1;
        ++r;
      }
    }
    pos += n;
    run_offsets[g + 1] = r;
    item_offsets[g + 1] = item_offsets[g] + entries_per_group[g] * (r - first_run);
  }
  const int64_t n = 2 * (num_groups + 1) + 3 * r;
  if (with_prefix) {
    int64_t* prefix = packed + n;
    prefix[0] = 0;
    for (int64_t k = 0; k < r; ++k) prefix[k + 1] = prefix[k] + runs[3 * k + 2];
  }
  return n;
}

}  // namespace
