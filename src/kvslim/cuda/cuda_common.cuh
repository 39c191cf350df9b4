// Device-side building blocks shared by kvslim's CUDA kernels: error checks, fp16/bf16 packing,
// the m16n8k16 tensor-core product (mma.sync), asynchronous global->shared copies.
//
// Fragment layout of mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4 g + t:
//   A (16 x 16, row-major): a[0] = (row g,   k 2t..2t+1)  a[1] = (row g+8, k 2t..2t+1)
//                           a[2] = (row g,   k 2t+8..+9)  a[3] = (row g+8, k 2t+8..+9)
//   B (16 x 8, col-major):  b[0] = (k 2t..2t+1, col g)   b[1] = (k 2t+8..+9, col g)
//   C (16 x 8, fp32):       c0,c1 = (row g, col 2t..2t+1)  c2,c3 = (row g+8, col 2t..2t+1)
// A lane's k indices depend on t only, in A and in B: a kernel may give the 16 k slots of a step any
// channel (or token) it likes, as long as A and B agree -- that is how packed codes are multiplied
// in the order they lie in memory.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kvslim/dtype.h"
#include "kvslim/errors.h"

#ifdef __CUDACC__
#define KVSLIM_HD __host__ __device__
#else
#define KVSLIM_HD
#endif

namespace kvslim::cuda {

// A CUDA runtime error as an exception naming the call and where it was made.
[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);

#define KVSLIM_CUDA_CHECK(call)                                                      \
  do {                                                                               \
    const cudaError_t kvslim_err_ = (call);                                          \
    if (kvslim_err_ != cudaSuccess) ::kvslim::cuda::throw_cuda_error(kvslim_err_, #call, __FILE__, __LINE__); \
  } while (0)

// Element type of a dense (uncompressed) row store.
enum class DenseType : int { f16 = 0, bf16 = 1 };

#ifdef __CUDACC__

// Element i of a caller's block (f32, f16 or bf16), as float.
__device__ __forceinline__ float load_input(const void* src, DType t, long long i) {
  if (t == DType::f32) return static_cast<const float*>(src)[i];
  if (t == DType::f16) return __half2float(static_cast<const __half*>(src)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(src)[i]);
}

__device__ __forceinline__ std::uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&h);
}
__device__ __forceinline__ std::uint32_t pack_bf162(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&h);
}

// x = hi + lo with hi, lo of the 16-bit type: the pair carries ~22 bits (fp16) / ~16 bits (bf16)
// of x, so products with exact small integers keep fp32-like precision through the tensor cores.
template <DenseType T>
__device__ __forceinline__ void split2(float x0, float x1, std::uint32_t& hi, std::uint32_t& lo) {
  if constexpr (T == DenseType::f16) {
    const __half h0 = __float2half_rn(x0), h1 = __float2half_rn(x1);
    hi = pack_half2(__half2float(h0), __half2float(h1));
    lo = pack_half2(x0 - __half2float(h0), x1 - __half2float(h1));
  } else {
    const __nv_bfloat16 h0 = __float2bfloat16_rn(x0), h1 = __float2bfloat16_rn(x1);
    hi = pack_bf162(__bfloat162float(h0), __bfloat162float(h1));
    lo = pack_bf162(x0 - __bfloat162float(h0), x1 - __bfloat162float(h1));
  }
}

template <DenseType T>
__device__ __forceinline__ void mma16816(float c[4], const std::uint32_t a[4], std::uint32_t b0, std::uint32_t b1) {
  if constexpr (T == DenseType::f16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// 16 bytes global -> shared without registers (sm_80+), completed by cp_async_wait. `s`: an address
// in the shared window (__cvta_generic_to_shared).
__device__ __forceinline__ void cp_async16_to(unsigned s, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  cp_async16_to(static_cast<unsigned>(__cvta_generic_to_shared(smem)), gmem);
}
// 8 bytes global -> shared (through L1: .cg takes 16 only) in the lanes where `on` holds: a
// predicated instruction, no branch around it.
__device__ __forceinline__ void cp_async8_if_to(bool on, unsigned s, const void* gmem) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.ca.shared.global [%0], [%1], 8;\n}\n" ::"r"(s),
               "l"(gmem), "r"(static_cast<int>(on)));
}
__device__ __forceinline__ void cp_async8_if(bool on, void* smem, const void* gmem) {
  cp_async8_if_to(on, static_cast<unsigned>(__cvta_generic_to_shared(smem)), gmem);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Max / sum over the lanes that differ in xor bits from, 2 from, ... below to (e.g. 1, 4: the 4
// lanes of a quad, same g; 4, 32: the 8 lanes of one t).
__device__ __forceinline__ float max_over(float v, int from, int to) {
  for (int o = from; o < to; o *= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float sum_over(float v, int from, int to) {
  for (int o = from; o < to; o *= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max4(float v) {  // over the 4 lanes of a quad (same g)
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float warp_sum4(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// 2^e as a float for |e| <= 126 (exact).
__device__ __forceinline__ float pow2i(int e) { return __int_as_float((127 + e) << 23); }

// Adds 1 to a counter at device scope and returns its old value: the "last CTA to arrive" pattern
// (the decode observation's parts, lowest_candidate.cuh). One thread calls it after a barrier: it
// releases what the CTA wrote before that barrier and acquires what the earlier arrivals released
// (the last one then reads their partials after another barrier). __threadfence() before a relaxed
// atomicAdd is a sequentially consistent fence (MEMBAR.SC), stronger and slower than this needs.
__device__ __forceinline__ unsigned arrive_acq_rel(unsigned* counter) {
  unsigned old;
  asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;\n" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

#endif  // __CUDACC__

}  // namespace kvslim::cuda
