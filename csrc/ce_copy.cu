// Backend `ce`: the copy engines move every segment of a call in one batched memcpy.
//
// The segments come from the same item body the kernels use (kernels/block_copy.cuh,
// compiled here for the host): merged runs make them large (a run of adjacent pages is
// one descriptor per chunk), which is where copy engines are fast.
//
// cudaMemcpyBatchAsync exists from CUDA 12.8, and its signature changed in 13.0 (the
// failIdx argument went away). The driver entry point cuMemcpyBatchAsync is resolved
// at run time, by ABI version (13.0 first, then 12.8), so this file builds with any
// toolkit and runs on any driver; without the entry point, on the legacy default
// stream's capture, or when asked, it falls back to one cudaMemcpyAsync per segment.
//
// Source access order: STREAM (the copy waits for earlier work on the stream) for
// device sources; ANY for host sources, which no stream writes (kvcopy's own d2h into
// the same host buffer earlier on the stream is the exception: callers that chain
// to_host and to_device on one buffer pass host_access_any = 0).
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <mutex>
#include <vector>

#include "block_copy.cuh"
#include "kvcopy_abi.h"

namespace {

constexpr int kDriverErrorBase = 100000;

#if defined(CUDA_VERSION) && CUDA_VERSION >= 12080 && defined(CUDART_VERSION) && \
    CUDART_VERSION >= 12050
#define KVCOPY_HAVE_BATCH 1
using BatchV13 = CUresult(CUDAAPI*)(CUdeviceptr*, CUdeviceptr*, size_t*, size_t,
                                    CUmemcpyAttributes*, size_t*, size_t, CUstream);
using BatchV12 = CUresult(CUDAAPI*)(CUdeviceptr*, CUdeviceptr*, size_t*, size_t,
                                    CUmemcpyAttributes*, size_t*, size_t, size_t*, CUstream);
using ErrorNameFn = CUresult(CUDAAPI*)(CUresult, const char**);

struct Driver {
  BatchV13 batch13 = nullptr;
  BatchV12 batch12 = nullptr;
  ErrorNameFn error_name = nullptr;
  int abi = 0;  // 13000, 12080 or 0 (no batch entry point)
};

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuMemcpyBatchAsync", &fn, 13000, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess && fn != nullptr) {
      d.batch13 = reinterpret_cast<BatchV13>(fn);
      d.abi = 13000;
    } else {
      fn = nullptr;
      if (cudaGetDriverEntryPointByVersion("cuMemcpyBatchAsync", &fn, 12080, cudaEnableDefault,
                                           &q) == cudaSuccess &&
          q == cudaDriverEntryPointSuccess && fn != nullptr) {
        d.batch12 = reinterpret_cast<BatchV12>(fn);
        d.abi = 12080;
      }
    }
    fn = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuGetErrorName", &fn, 6000, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess) {
      d.error_name = reinterpret_cast<ErrorNameFn>(fn);
    }
    cudaGetLastError();  // a failed lookup must not leak into the caller's next check
  });
  return d;
}
#else
#define KVCOPY_HAVE_BATCH 0
#endif

// Per-thread scratch: the descriptor arrays are rebuilt every call, never reallocated
// once warm.
struct Scratch {
  std::vector<void*> src, dst;
  std::vector<size_t> sizes;
};
thread_local Scratch scratch;

// A side stream per device for the legacy default stream, which the batch API rejects:
// ordered after the caller's stream by events, and the caller's stream after it.
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t before = nullptr, after = nullptr;
};
std::mutex side_mutex;
std::vector<SideStream> side_streams;

cudaError_t side_stream(int device, SideStream** out) {
  std::lock_guard<std::mutex> lock(side_mutex);
  if ((int)side_streams.size() <= device) side_streams.resize(device + 1);
  SideStream& s = side_streams[device];
  if (s.stream == nullptr) {
    cudaError_t err = cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&s.before, cudaEventDisableTiming);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&s.after, cudaEventDisableTiming);
    if (err != cudaSuccess) {
      s = SideStream();
      return err;
    }
  }
  *out = &s;
  return cudaSuccess;
}

bool is_legacy(cudaStream_t stream) { return stream == nullptr || stream == cudaStreamLegacy; }

void collect_segments(const int64_t* entries, const int64_t* group_offsets,
                      const int64_t* group_entries, int64_t num_groups, const int64_t* packed) {
  scratch.src.clear();
  scratch.dst.clear();
  scratch.sizes.clear();
  const kvcopy::CallView call = kvcopy::CallView::from_packed(packed, num_groups);
  const int64_t items = call.num_items();
  for (int64_t i = 0; i < items; ++i) {
    const kvcopy::Item it = kvcopy::locate_item(i, call, entries, group_offsets, group_entries);
    const int64_t n = it.num_segments();
    const int64_t bytes = it.segment_bytes();
    if (bytes <= 0) continue;
    for (int64_t k = 0; k < n; ++k) {
      int64_t s, d;
      it.segment(k, &s, &d);
      scratch.src.push_back(reinterpret_cast<void*>(s));
      scratch.dst.push_back(reinterpret_cast<void*>(d));
      scratch.sizes.push_back(static_cast<size_t>(bytes));
    }
  }
}

int copy_loop(cudaStream_t stream, cudaMemcpyKind kind) {
  for (size_t k = 0; k < scratch.sizes.size(); ++k) {
    cudaError_t err =
        cudaMemcpyAsync(scratch.dst[k], scratch.src[k], scratch.sizes[k], kind, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

#if KVCOPY_HAVE_BATCH
int copy_batch(const Driver& drv, cudaStream_t stream, bool src_host, bool dst_host, int device,
               bool host_access_any) {
  CUmemcpyAttributes attr = {};
  attr.srcAccessOrder = (src_host && host_access_any) ? CU_MEMCPY_SRC_ACCESS_ORDER_ANY
                                                      : CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
  attr.srcLocHint.type = src_host ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE;
  attr.srcLocHint.id = src_host ? 0 : device;
  attr.dstLocHint.type = dst_host ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE;
  attr.dstLocHint.id = dst_host ? 0 : device;
  attr.flags = 0;
  size_t attr_index = 0;
  auto* dsts = reinterpret_cast<CUdeviceptr*>(scratch.dst.data());
  auto* srcs = reinterpret_cast<CUdeviceptr*>(scratch.src.data());
  static_assert(sizeof(CUdeviceptr) == sizeof(void*), "CUdeviceptr is pointer-sized");
  CUresult r;
  if (drv.abi == 13000) {
    r = drv.batch13(dsts, srcs, scratch.sizes.data(), scratch.sizes.size(), &attr, &attr_index, 1,
                    reinterpret_cast<CUstream>(stream));
  } else {
    size_t fail_index = 0;
    r = drv.batch12(dsts, srcs, scratch.sizes.data(), scratch.sizes.size(), &attr, &attr_index, 1,
                    &fail_index, reinterpret_cast<CUstream>(stream));
  }
  return r == CUDA_SUCCESS ? 0 : kDriverErrorBase + static_cast<int>(r);
}
#endif

}  // namespace

extern "C" {

// 13000 or 12080: the cuMemcpyBatchAsync ABI found in the driver; 0: none (loop only).
int kvcopy_ce_batch_abi() {
#if KVCOPY_HAVE_BATCH
  return driver().abi;
#else
  return 0;
#endif
}

const char* kvcopy_ce_error_name(int code) {
  if (code < kDriverErrorBase) return cudaGetErrorName(static_cast<cudaError_t>(code));
#if KVCOPY_HAVE_BATCH
  const char* name = nullptr;
  if (driver().error_name != nullptr &&
      driver().error_name(static_cast<CUresult>(code - kDriverErrorBase), &name) == CUDA_SUCCESS &&
      name)
    return name;
#endif
  return "CUDA_ERROR_UNKNOWN";
}

// Copy every segment of one call (tables and packed call in host memory, as built by
// kvcopy/core/tables.py) on `stream`. options (kvcopy_abi.h): which sides are host memory,
// whether the device reads any host memory, and mode 0: batch when available, else loop;
// 1: batch or fail; 2: loop.
//   used_batch  out: 1 when one batched call carried the segments
//   segments    out: number of descriptors
int kvcopy_ce_copy(const kvcopy_tables* tables, const int64_t* packed,
                   const kvcopy_ce_options* options, void* stream_ptr, int* used_batch,
                   int64_t* segments) {
  *used_batch = 0;
  *segments = 0;
  if (!KVCOPY_STRUCT_OK(tables) || !KVCOPY_STRUCT_OK(options)) return cudaErrorInvalidValue;
  const bool src_is_host = options->src_is_host != 0, dst_is_host = options->dst_is_host != 0;
  const bool host_access_any = options->host_access_any != 0;
  const int64_t mode = options->mode;
  collect_segments(tables->entries, tables->group_offsets, tables->group_entries,
                   tables->num_groups, packed);
  *segments = static_cast<int64_t>(scratch.sizes.size());
  if (scratch.sizes.empty()) return cudaSuccess;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const cudaMemcpyKind kind = cudaMemcpyDefault;  // UVA: the pointers say where they are
  if (mode == 2) return copy_loop(stream, kind);
#if KVCOPY_HAVE_BATCH
  const Driver& drv = driver();
  if (drv.abi == 0) return mode == 1 ? cudaErrorNotSupported : copy_loop(stream, kind);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(stream, &capture);
  if (err != cudaSuccess) return err;
  if (capture != cudaStreamCaptureStatusNone) {
    // Graph capture: memcpy nodes from the loop are what every CUDA version captures.
    return mode == 1 ? cudaErrorStreamCaptureUnsupported : copy_loop(stream, kind);
  }
  int device = 0;
  err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (!is_legacy(stream)) {
    int rc = copy_batch(drv, stream, src_is_host, dst_is_host, device, host_access_any);
    if (rc == 0) *used_batch = 1;
    return rc;
  }
  SideStream* side = nullptr;
  err = side_stream(device, &side);
  if (err == cudaSuccess) err = cudaEventRecord(side->before, stream);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(side->stream, side->before, 0);
  if (err != cudaSuccess) return err;
  int rc = copy_batch(drv, side->stream, src_is_host, dst_is_host, device, host_access_any);
  if (rc == 0) *used_batch = 1;
  // Order the caller's stream after the side stream even when the batch failed.
  err = cudaEventRecord(side->after, side->stream);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(stream, side->after, 0);
  return rc != 0 ? rc : err;
#else
  return mode == 1 ? cudaErrorNotSupported : copy_loop(stream, kind);
#endif
}

}  // extern "C"
