// Backend `cuda`: launcher of the fused block-copy kernel (kernels/block_copy_kernel.cuh).
//
// C ABI, loaded with ctypes by kvcopy/copy_backends/cuda.py. Every function returns a CUDA
// error code (0 = success); kvcopy_cuda_error_name turns it into the CUDA error name
// the Python side raises with. The caller picks the grid (it knows the SM count and
// max_ctas) and passes the stream as a raw cudaStream_t (torch's current stream).
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "block_copy_kernel.cuh"
#include "kvcopy_abi.h"

KVCOPY_DEFINE_KERNELS

namespace {

using KernelFn = void (*)(const kvcopy::KernelParams);

KernelFn kernel_for(int word_bytes) {
  switch (word_bytes) {
    case 16:
      return kvcopy_block_copy_w16;
    case 8:
      return kvcopy_block_copy_w8;
    case 4:
      return kvcopy_block_copy_w4;
    case 2:
      return kvcopy_block_copy_w2;
    case 1:
      return kvcopy_block_copy_w1;
    default:
      return nullptr;
  }
}

KernelFn sums_kernel_for(int word_bytes) {
  switch (word_bytes) {
    case 16:
      return kvcopy_block_copy_sums_w16;
    case 8:
      return kvcopy_block_copy_sums_w8;
    case 4:
      return kvcopy_block_copy_sums_w4;
    case 2:
      return kvcopy_block_copy_sums_w2;
    case 1:
      return kvcopy_block_copy_sums_w1;
    default:
      return nullptr;
  }
}

// The kernel parameters of one launch (see kvcopy_cuda_copy), or an error code.
int fill_params(kvcopy::KernelParams* p, const kvcopy_cuda_tables* t, const kvcopy_cuda_call* c,
                const int64_t* call_host) {
  p->tables = t->tables;
  p->num_entries = t->num_entries;
  p->num_groups = t->num_groups;
  p->num_group_entries = t->num_group_entries;
  p->total_bytes = c->total_bytes;
  p->sums = nullptr;
  if (call_host != nullptr && c->call_words <= KVCOPY_INLINE_WORDS) {
    p->call = nullptr;
    memcpy(p->inline_call, call_host, sizeof(int64_t) * (size_t)c->call_words);
  } else if (c->call_device != nullptr) {
    p->call = c->call_device;
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

// What every launch checks first: the structs' sizes, the word width, the grid.
int check_launch(const kvcopy_cuda_tables* t, const kvcopy_cuda_call* c, KernelFn fn) {
  if (!KVCOPY_STRUCT_OK(t) || !KVCOPY_STRUCT_OK(c)) return cudaErrorInvalidValue;
  if (fn == nullptr || c->grid < 1 || c->total_bytes % t->word_bytes != 0)
    return cudaErrorInvalidValue;
  return cudaSuccess;
}

// Codes above this are driver-API CUresult values (from the copy-engine path),
// offset so the two enumerations never collide.
constexpr int kDriverErrorBase = 100000;

}  // namespace

extern "C" {

// The ABI version kvcopy/native.py checks (its rule: csrc/kvcopy_abi.h; history:
// CHANGELOG.md). 4: option structs by pointer, kvcopy_cuda_entry_fields.
int kvcopy_cuda_abi_version() { return 4; }
// The entry-table width compiled in (kernels/entry_layout.cuh), checked at load.
int kvcopy_cuda_entry_fields() { return KVCOPY_ENTRY_FIELDS; }
int kvcopy_cuda_threads() { return KVCOPY_THREADS; }
int kvcopy_cuda_inline_words() { return KVCOPY_INLINE_WORDS; }
int kvcopy_cuda_params_bytes() { return (int)sizeof(kvcopy::KernelParams); }
int kvcopy_cuda_runtime_version() { return CUDART_VERSION; }

const char* kvcopy_cuda_error_name(int code) {
  if (code >= kDriverErrorBase) return "CUDA driver error (see kvcopy_ce_error_name)";
  return cudaGetErrorName(static_cast<cudaError_t>(code));
}

const char* kvcopy_cuda_error_string(int code) {
  if (code >= kDriverErrorBase) return "CUDA driver error";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

int kvcopy_cuda_device_count(int* count) { return cudaGetDeviceCount(count); }

// Multiprocessors of `device`, and whether it reads registered host memory through
// the host pointer itself (else a kernel needs cudaHostGetDevicePointer's address).
int kvcopy_cuda_device_info(int device, int* sm_count, int* host_pointer_ok) {
  cudaError_t err = cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  return cudaDeviceGetAttribute(host_pointer_ok, cudaDevAttrCanUseHostPointerForRegisteredMem,
                                device);
}

// The device address of pinned or registered host memory (identity under UVA on x86).
int kvcopy_cuda_host_device_pointer(void* host, void** device_pointer) {
  return cudaHostGetDevicePointer(device_pointer, host, 0);
}

// One launch of the fused kernel on `stream` (kvcopy_abi.h): the tables' static array in
// device memory (entries[E][KVCOPY_ENTRY_FIELDS] | group_offsets[G+1] | group_entries[GE]
// | entry_bytes_prefix[GE+1]) and word width (16/8/4/2/1, dividing every address and
// size); the call array (packed call | block prefix) on the device or, in call_host,
// on the host, inlined into the kernel's parameters when it fits; the bytes it moves;
// the grid (CTAs of KVCOPY_THREADS threads, >= 1).
int kvcopy_cuda_copy(const kvcopy_cuda_tables* tables, const kvcopy_cuda_call* call,
                     const int64_t* call_host, void* stream) {
  if (KVCOPY_STRUCT_OK(call) && call->total_bytes <= 0) return cudaSuccess;
  KernelFn fn = KVCOPY_STRUCT_OK(tables) ? kernel_for((int)tables->word_bytes) : nullptr;
  int err = check_launch(tables, call, fn);
  if (err != cudaSuccess) return err;
  kvcopy::KernelParams p;
  err = fill_params(&p, tables, call, call_host);
  if (err != cudaSuccess) return err;
  void* args[] = {&p};
  return cudaLaunchKernel(reinterpret_cast<const void*>(fn), dim3((unsigned)call->grid),
                          dim3(KVCOPY_THREADS), args, 0, static_cast<cudaStream_t>(stream));
}

// kvcopy_cuda_copy with checksums (kernels/page_checksum.cuh): `sums` (device, one
// uint64 per block of the call, num_sums of them) is zeroed on `stream`, then the
// checksum kernel copies and adds each page's sum into it. The call array must hold
// the block prefix after the packed call (it always does: the planner writes both).
int kvcopy_cuda_copy_sums(const kvcopy_cuda_tables* tables, const kvcopy_cuda_call* call,
                          const int64_t* call_host, void* stream, int64_t* sums, int64_t num_sums) {
  if (!KVCOPY_STRUCT_OK(tables) || !KVCOPY_STRUCT_OK(call)) return cudaErrorInvalidValue;
  if (num_sums < 0 || (num_sums > 0 && sums == nullptr)) return cudaErrorInvalidValue;
  if (num_sums > 0) {
    const cudaError_t err = cudaMemsetAsync(sums, 0, sizeof(int64_t) * (size_t)num_sums,
                                            static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) return err;
  }
  if (call->total_bytes <= 0) return cudaSuccess;
  KernelFn fn = sums_kernel_for((int)tables->word_bytes);
  int err = check_launch(tables, call, fn);
  if (err != cudaSuccess) return err;
  kvcopy::KernelParams p;
  err = fill_params(&p, tables, call, call_host);
  if (err != cudaSuccess) return err;
  p.sums = reinterpret_cast<unsigned long long*>(sums);
  void* args[] = {&p};
  return cudaLaunchKernel(reinterpret_cast<const void*>(fn), dim3((unsigned)call->grid),
                          dim3(KVCOPY_THREADS), args, 0, static_cast<cudaStream_t>(stream));
}

// Put `count` int64 words from host memory into device memory at `dst`, carried by
// value in the parameters of ceil(count / KVCOPY_INLINE_WORDS) small kernel launches:
// captured into a CUDA graph, the words live in the graph's nodes, not in host memory
// that could change or be freed before a replay.
int kvcopy_cuda_store_words(int64_t* dst, const int64_t* src, int64_t count, void* stream) {
  kvcopy::StoreParams p;
  for (int64_t done = 0; done < count; done += KVCOPY_INLINE_WORDS) {
    const int64_t n = count - done < KVCOPY_INLINE_WORDS ? count - done : KVCOPY_INLINE_WORDS;
    p.dst = dst + done;
    p.count = n;
    memcpy(p.words, src + done, sizeof(int64_t) * (size_t)n);
    void* args[] = {&p};
    cudaError_t err = cudaLaunchKernel(reinterpret_cast<const void*>(kvcopy_store_words), dim3(1),
                                       dim3(256), args, 0, static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// Whether `stream` is being captured into a CUDA graph (1) or not (0).
int kvcopy_cuda_stream_capturing(void* stream, int* capturing) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status);
  *capturing = status == cudaStreamCaptureStatusActive ? 1 : 0;
  return err;
}

// A stream of kvcopy's own (P's layer-wise side stream, kvcopy/nixl/modes/side_stream.py)
// on `device`, which must be the calling thread's current device (the caller sets it: a
// device switched here and back would leave a thread that had none on device 0):
// non-blocking (no implicit wait on the legacy default stream) and at the lowest
// priority the device has (`*priority`), so the block scheduler never starts its CTAs
// ahead of pending ones of a stream at the default priority or above. Not one of
// torch's pooled streams: no other user of torch.cuda.Stream() is handed it.
int kvcopy_cuda_stream_create(int device, void** stream, int* priority) {
  if (stream == nullptr || priority == nullptr) return cudaErrorInvalidValue;
  *stream = nullptr;
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err != cudaSuccess) return err;
  if (current != device) return cudaErrorInvalidDevice;
  int least = 0, greatest = 0;
  err = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (err != cudaSuccess) return err;
  cudaStream_t s = nullptr;
  err = cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, least);
  if (err != cudaSuccess) return err;
  *stream = s;
  *priority = least;
  return cudaSuccess;
}

// Destroy a stream of kvcopy_cuda_stream_create. Work still queued on it completes
// first (the stream's resources are released then); nothing may be queued on it after.
int kvcopy_cuda_stream_destroy(void* stream) {
  if (stream == nullptr) return cudaErrorInvalidValue;
  return cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

}  // extern "C"
