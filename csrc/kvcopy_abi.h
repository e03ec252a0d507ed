// kvcopy's C ABI: the option structs the exported functions take by pointer.
//
// Every field is 8 bytes (int64_t or a pointer) and every struct starts with
// struct_bytes, its size as the caller compiled it (kvcopy/native.py mirrors each as a
// ctypes.Structure and checks the sizes at load; the static_asserts below guard this
// side). A function refuses a struct shorter than it needs.
//
// The ABI version (kvcopy_cpu_abi_version, kvcopy_cuda_abi_version) is bumped when a
// function is removed or a parameter or field changes meaning or type. A new knob is a
// field appended to its struct, read only when struct_bytes covers it (else its
// default): no bump. The history of the versions is in CHANGELOG.md.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// A copier direction's static tables (kvcopy/core/tables.py): entries[E][KVCOPY_ENTRY_FIELDS],
// group_offsets[G+1], group_entries[GE]; entry_bytes_prefix[GE+1] (the range walkers only,
// else null).
typedef struct {
  int64_t struct_bytes;
  const int64_t* entries;
  const int64_t* group_offsets;
  const int64_t* group_entries;
  const int64_t* entry_bytes_prefix;
  int64_t num_groups;
} kvcopy_tables;

// The host copy's knobs (kvcopy/copy_backends/cpu.py). num_threads <= 0: OpenMP's
// default; simd: 0 scalar, 1 AVX2, 2 AVX-512 (at most what the CPU has); a call of at
// least stream_min_bytes (> 0) stores with non-temporal stores; in checksummed calls of
// at least piece_min_bytes, runs of at least piece_bytes are copied piece by piece.
typedef struct {
  int64_t struct_bytes;
  int64_t num_threads;
  int64_t simd;
  int64_t stream_min_bytes;
  int64_t piece_bytes;
  int64_t piece_min_bytes;
} kvcopy_cpu_tuning;

// The arena's fold of page sums (kvcopy_fold_page_sums): value v folds
// sums[gather[i]] ^ bounds[i] for i in [starts[v], starts[v + 1]) (the last to
// num_gather); values (or null) receives them, want (or null) is compared.
typedef struct {
  int64_t struct_bytes;
  const int64_t* gather;
  const uint64_t* bounds;
  int64_t num_gather;
  const int64_t* starts;
  int64_t num_values;
  uint64_t* values;
  const uint64_t* want;
} kvcopy_fold;

// A call planner's constants (kvcopy/core/planner.py, csrc/call_plan.cpp): per group the
// id bounds, the class of groups sharing destination bytes and the entries it copies.
typedef struct {
  int64_t struct_bytes;
  int64_t num_groups;
  const int64_t* src_limit;
  const int64_t* dst_limit;
  const int64_t* dst_class;
  int64_t num_classes;
  const int64_t* entries_per_group;
  int64_t dst_capacity;
} kvcopy_plan_static;

// The GPU range walkers run on the host (test helpers): the call cut into num_ranges
// ranges of word_bytes words.
typedef struct {
  int64_t struct_bytes;
  int64_t num_ranges;
  int64_t word_bytes;
} kvcopy_ranges;

// The fused CUDA kernel's static table (kvcopy/copy_backends/kernel_inputs.py), in
// device memory, and the word width the copier picked.
typedef struct {
  int64_t struct_bytes;
  const int64_t* tables;
  int64_t num_entries;
  int64_t num_groups;
  int64_t num_group_entries;
  int64_t word_bytes;
} kvcopy_cuda_tables;

// One CUDA call: its call array on the device (null when the host copy, passed beside
// the struct, is inlined into the kernel's parameters), its length, bytes and grid.
typedef struct {
  int64_t struct_bytes;
  const int64_t* call_device;
  int64_t call_words;
  int64_t total_bytes;
  int64_t grid;
} kvcopy_cuda_call;

// The copy-engine path's choices (kvcopy/copy_backends/ce.py).
typedef struct {
  int64_t struct_bytes;
  int64_t src_is_host;
  int64_t dst_is_host;
  int64_t host_access_any;
  int64_t mode;
} kvcopy_ce_options;

#ifdef __cplusplus
}  // extern "C"

static_assert(sizeof(kvcopy_tables) == 6 * 8, "kvcopy_tables: 8-byte fields only");
static_assert(sizeof(kvcopy_cpu_tuning) == 6 * 8, "kvcopy_cpu_tuning: 8-byte fields only");
static_assert(sizeof(kvcopy_fold) == 8 * 8, "kvcopy_fold: 8-byte fields only");
static_assert(sizeof(kvcopy_plan_static) == 8 * 8, "kvcopy_plan_static: 8-byte fields only");
static_assert(sizeof(kvcopy_ranges) == 3 * 8, "kvcopy_ranges: 8-byte fields only");
static_assert(sizeof(kvcopy_cuda_tables) == 6 * 8, "kvcopy_cuda_tables: 8-byte fields only");
static_assert(sizeof(kvcopy_cuda_call) == 5 * 8, "kvcopy_cuda_call: 8-byte fields only");
static_assert(sizeof(kvcopy_ce_options) == 5 * 8, "kvcopy_ce_options: 8-byte fields only");

// Whether *p is at least as long as this build's struct (kvcopy/native.py passes its own
// size; a shorter one is from another build).
#define KVCOPY_STRUCT_OK(p) ((p) != nullptr && (p)->struct_bytes >= (int64_t)sizeof(*(p)))
#endif
