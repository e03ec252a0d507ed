// The entry table's row: one int64 row per copied layer, KVCOPY_ENTRY_FIELDS wide.
//
// The one definition of the width and of the columns, for every consumer: the C++ and
// CUDA code include this header, NVRTC compiles it with the kernel, and Python reads
// it (kvcopy.native.ENTRY_FIELDS / ENTRY_COLUMNS, by a strict parse of the lines
// below). Each native library exports the width it was compiled with
// (kvcopy_cpu_entry_fields, kvcopy_cuda_entry_fields), and kvcopy.native refuses one
// whose width is not this header's. kvcopy/core/tables.py documents what each column
// holds.
#pragma once

#define KVCOPY_ENTRY_FIELDS 20

namespace kvcopy {

enum EntryField : int {
  kSrcBase = 0,
  kDstBase = 1,
  kSrcBlockStride = 2,
  kDstBlockStride = 3,
  kRunBytes = 4,
  kRunsPerPage = 5,
  kRunDims = 6,      // 3 x (count, src stride, dst stride), outermost first
  kKeyStrides = 16,  // 3 x the dims' strides in the staging page counted densely
  kEntryFields = KVCOPY_ENTRY_FIELDS,
};

}  // namespace kvcopy
