# kvcopy_cuda: the fused CUDA kernel (backend `cuda`) and the copy-engine path (`ce`).
# Included by CMakeLists.txt when a CUDA compiler is found. C ABI, loaded with ctypes.
#   sm_80 and sm_90 machine code, plus compute_90 PTX for newer GPUs (JIT at load).
#   cudart linked statically: the library needs only the driver (libcuda.so.1) at run
#   time, not a toolkit, so a build made here runs on a GPU machine without nvcc.
enable_language(CUDA)
if(NOT DEFINED KVCOPY_CUDA_ARCHS)
  set(KVCOPY_CUDA_ARCHS "80-real;90")
endif()
add_library(kvcopy_cuda SHARED
  "${CMAKE_CURRENT_LIST_DIR}/cuda_copy.cu"
  "${CMAKE_CURRENT_LIST_DIR}/ce_copy.cu")
target_include_directories(kvcopy_cuda PRIVATE "${KVCOPY_KERNELS_DIR}")
set_target_properties(kvcopy_cuda PROPERTIES
  CUDA_ARCHITECTURES "${KVCOPY_CUDA_ARCHS}"
  CUDA_RUNTIME_LIBRARY Static
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON
  LIBRARY_OUTPUT_DIRECTORY "${KVCOPY_OUTPUT_DIR}")
target_compile_options(kvcopy_cuda PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xptxas=-O3 --expt-relaxed-constexpr>)
message(STATUS "kvcopy: building kvcopy_cuda for CUDA architectures ${KVCOPY_CUDA_ARCHS}")
