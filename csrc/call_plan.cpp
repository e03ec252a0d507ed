// Per-call planning in one C call: check every group's block ids and pack the call
// array the kernels read (kernels/block_copy.cuh) -- the host side of every backend.
//
// kvcopy/core/planner.py has the same pass in numpy (~15 numpy calls per group) for
// installs without this library; a copy of 48 layers x 6 groups has to cost
// microseconds in total on the host, so the per-call path is one pass in C.
//
// Duplicate destinations are found with a stamp array, one row of one int64 per
// destination block for each class of groups that share destination bytes: block b
// was already written in this call by class c iff seen[c * capacity + b] == stamp.
// The stamp grows by one every call, so the array is never cleared. The array and
// the stamp are per thread (thread_local): calls on one planner from several threads
// never see each other's stamps, and no lock is taken. A thread's array grows to the
// largest classes x capacity it has planned for and lives as long as the thread.
#include <stdint.h>

#include <new>
#include <vector>

#include "kvcopy_abi.h"

namespace {

enum PlanError : int64_t {
  kOk = 0,
  kSrcRange = 1,
  kDstRange = 2,
  kDuplicate = 3,
};

struct Stamps {
  std::vector<int64_t> seen;
  int64_t stamp = 0;
};

thread_local Stamps t_stamps;

int64_t plan_call(int64_t num_groups, const int64_t* src_ids, const int64_t* dst_ids,
                  const int64_t* group_lens, const int64_t* src_limit, const int64_t* dst_limit,
                  const int64_t* dst_class, const int64_t* entries_per_group, int64_t* seen,
                  int64_t dst_capacity, int64_t stamp, int64_t* packed);

}  // namespace

extern "C" {

// plan (kvcopy_plan_static, kvcopy_abi.h), per group: src_limit, dst_limit (ids must lie
//   in [0, limit)); dst_class (groups of one class share destination bytes, so their ids
//   must be disjoint; a group alone in its class checks only against itself; classes
//   numbered from 0 to num_classes - 1); entries_per_group (layers each group copies);
//   dst_capacity: at least every dst_limit (the stamp row length).
// src_ids, dst_ids: all groups' ids concatenated; group_lens[G].
// packed: out, room for 2 * (G + 1) + 4 * total ids + 1 words: the packed call, then
//   the fused CUDA kernel's block prefix (R + 1 words right after the runs:
//   prefix[r] = blocks in the runs before r), so the `cuda` call array is
//   packed[0 : n + R + 1] as written.
// Returns n, the words of the packed call (without the prefix); -1 on the first bad
// id, with packed[0..2] = (PlanError, group, id); -2 when the stamp array cannot grow;
// -3 for a plan struct shorter than this build's.
int64_t kvcopy_plan_call(const kvcopy_plan_static* plan, const int64_t* src_ids,
                         const int64_t* dst_ids, const int64_t* group_lens, int64_t* packed) {
  if (!KVCOPY_STRUCT_OK(plan)) return -3;
  Stamps& st = t_stamps;
  const int64_t num_classes = plan->num_classes, dst_capacity = plan->dst_capacity;
  const uint64_t need = (uint64_t)(num_classes > 0 ? num_classes : 0) *
                        (uint64_t)(dst_capacity > 0 ? dst_capacity : 0);
  if (st.seen.size() < need) {
    try {
      st.seen.resize(need, 0);
    } catch (const std::bad_alloc&) {
      return -2;
    }
  }
  st.stamp += 1;
  return plan_call(plan->num_groups, src_ids, dst_ids, group_lens, plan->src_limit, plan->dst_limit,
                   plan->dst_class, plan->entries_per_group, st.seen.data(), dst_capacity, st.stamp,
                   packed);
}

// Does nothing and returns 0 (success): `kvcopy-bench overhead` calls it through ctypes
// typed as a launch function, to time the host path without a device.
int kvcopy_host_noop() { return 0; }

}  // extern "C"

namespace {

int64_t fail(int64_t* packed, int64_t code, int64_t group, int64_t id) {
  packed[0] = code;
  packed[1] = group;
  packed[2] = id;
  return -1;
}

int64_t plan_call(int64_t num_groups, const int64_t* src_ids, const int64_t* dst_ids,
                  const int64_t* group_lens, const int64_t* src_limit, const int64_t* dst_limit,
                  const int64_t* dst_class, const int64_t* entries_per_group, int64_t* seen,
                  int64_t dst_capacity, int64_t stamp, int64_t* packed) {
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
      if (s < 0 || s >= src_limit[g]) return fail(packed, kSrcRange, g, s);
      if (d < 0 || d >= dst_limit[g] || d >= dst_capacity) return fail(packed, kDstRange, g, d);
      if (seen_class[d] == stamp) return fail(packed, kDuplicate, g, d);
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
  int64_t* prefix = packed + n;
  prefix[0] = 0;
  for (int64_t k = 0; k < r; ++k) prefix[k + 1] = prefix[k] + runs[3 * k + 2];
  return n;
}

}  // namespace
