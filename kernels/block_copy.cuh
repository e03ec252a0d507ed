// kvcopy item body: where the bytes of one unit of a fused block copy sit.
//
// Raw pointers and integers only: no torch, no CUDA host API. The same header is
// compiled by nvcc for the GPU kernels (csrc/cuda_copy.cu) and by the host C++
// compiler for the `cpu` backend (csrc/cpu_copy.cpp), so every CPU test run exercises
// the addressing code the GPU runs.
//
// Data model (built in kvcopy/tables.py, documented there in full):
//
//   entries[E][8]   int64, static per copier and direction. One row per copied layer
//                   (deduplicated by storage): src base address, dst base address,
//                   src/dst block stride (bytes), src/dst chunk stride (bytes),
//                   chunk bytes, chunks per block (1, or 2 for KV-first tensors).
//   group_offsets[G+1], group_entries[...]
//                   int64, static: group g copies entries
//                   group_entries[group_offsets[g] .. group_offsets[g+1]).
//   call (per call, one int64 array):
//       run_offsets[G+1]   runs of group g are runs[run_offsets[g] .. run_offsets[g+1])
//       item_offsets[G+1]  items of group g are [item_offsets[g], item_offsets[g+1]),
//                          item_offsets[g+1]-item_offsets[g] = entries(g) * runs(g)
//       runs[R][3]         (src first block, dst first block, number of blocks)
//
// An item is one (entry, run) pair: entry-major within a group, so consecutive items
// walk the runs of one layer. An item is made of segments: byte ranges that are
// contiguous on both sides. When a run's blocks are adjacent on both sides
// (block stride == chunk bytes) a chunk of the whole run is one segment; otherwise
// each (block, chunk) is one.
//
// All offsets are 64-bit: a 48-layer cache of 2 MiB pages passes 2^31 bytes per layer.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVCOPY_HD __host__ __device__ __forceinline__
#else
#define KVCOPY_HD inline
#endif

namespace kvcopy {

enum EntryField : int {
  kSrcBase = 0,
  kDstBase = 1,
  kSrcBlockStride = 2,
  kDstBlockStride = 3,
  kSrcChunkStride = 4,
  kDstChunkStride = 5,
  kChunkBytes = 6,
  kNumChunks = 7,
  kEntryFields = 8,
};

// The per-call array, split into its three parts.
struct CallView {
  const int64_t* run_offsets;   // [G+1]
  const int64_t* item_offsets;  // [G+1]
  const int64_t* runs;          // [R][3]
  int64_t num_groups;

  KVCOPY_HD static CallView from_packed(const int64_t* packed, int64_t num_groups) {
    CallView v;
    v.run_offsets = packed;
    v.item_offsets = packed + (num_groups + 1);
    v.runs = packed + 2 * (num_groups + 1);
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
  bool merged;           // run adjacent on both sides: one segment per chunk

  KVCOPY_HD int64_t chunk_bytes() const { return entry[kChunkBytes]; }
  KVCOPY_HD int64_t num_segments() const {
    return merged ? entry[kNumChunks] : entry[kNumChunks] * num_blocks;
  }
  KVCOPY_HD int64_t segment_bytes() const {
    return merged ? entry[kChunkBytes] * num_blocks : entry[kChunkBytes];
  }
  KVCOPY_HD int64_t total_bytes() const {
    return entry[kNumChunks] * entry[kChunkBytes] * num_blocks;
  }
  // Segment k (0 <= k < num_segments()): source and destination addresses.
  KVCOPY_HD void segment(int64_t k, int64_t* src, int64_t* dst) const {
    int64_t block = merged ? 0 : k / entry[kNumChunks];
    int64_t chunk = merged ? k : k % entry[kNumChunks];
    *src = entry[kSrcBase] + (src_block + block) * entry[kSrcBlockStride] +
           chunk * entry[kSrcChunkStride];
    *dst = entry[kDstBase] + (dst_block + block) * entry[kDstBlockStride] +
           chunk * entry[kDstChunkStride];
  }
};

// Resolve item i of a call. Groups are few (1-8 in practice; 7 for Gemma-3), so a
// linear scan over item_offsets costs less than a binary search's branches.
KVCOPY_HD Item locate_item(int64_t i, const CallView& call, const int64_t* entries,
                           const int64_t* group_offsets, const int64_t* group_entries) {
  int64_t g = 0;
  while (g + 1 < call.num_groups && i >= call.item_offsets[g + 1]) ++g;
  const int64_t local = i - call.item_offsets[g];
  const int64_t first_run = call.run_offsets[g];
  const int64_t runs_in_group = call.run_offsets[g + 1] - first_run;
  const int64_t entry_index = group_entries[group_offsets[g] + local / runs_in_group];
  const int64_t* run = call.runs + 3 * (first_run + local % runs_in_group);
  Item it;
  it.entry = entries + kEntryFields * entry_index;
  it.src_block = run[0];
  it.dst_block = run[1];
  it.num_blocks = run[2];
  const int64_t cb = it.entry[kChunkBytes];
  it.merged = it.num_blocks == 1 ||
              (it.entry[kSrcBlockStride] == cb && it.entry[kDstBlockStride] == cb);
  return it;
}

}  // namespace kvcopy
