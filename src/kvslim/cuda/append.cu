// Fused append kernels (append.h). The quantizer follows the CPU's scalar reference
// (quant/quant_reference.cc) operation for operation: values rounded to fp16 first (the CPU's intake
// stores fp16), per-channel min/max over the group, zero = fp16(min), scale = the smallest fp16 >=
// max((max - zero) / levels, 1e-8), code = clamp(rint((x - zero) / scale)), bit planes as
// packed_row_bytes describes -- so device codes equal the CPU's bit for bit.
#include <climits>
#include <cmath>

#include "cuda/append.h"
#include "cuda/group_quant.cuh"
#include "cuda/kernel_launch.h"

namespace kvslim::cuda {
namespace {

__device__ __forceinline__ float load_as_fp16_float(const void* src, DType t, long long i, bool& bad) {
  const float x = load_input(src, t, i);
  if (!(fabsf(x) <= 65504.f)) bad = true;  // NaN fails too
  return __half2float(__float2half_rn(x));
}

__device__ __forceinline__ std::int64_t input_position(const AppendInput& in, int s) {
  return in.positions ? in.positions[s] : in.first_position + s;
}

// The smallest bad row wins on the device; the host copy gets a bad row (the smallest one but for a
// race between two stores, which only changes the row the error message names).
__device__ void report_bad(const AppendInput& in, int bh, int s, bool bad) {
  if (!bad) return;
  const int row = bh * in.S + s;
  if (row < atomicMin(in.bad_element, row) && in.bad_host) *reinterpret_cast<volatile int*>(in.bad_host) = row;
}

// One thread block per (row, bh): D threads.
__global__ void dense_append_kernel(AppendInput in, std::uint16_t* k, std::uint16_t* v, DenseType type,
                                    long long capacity, int n, std::int64_t* pos, bool pos_per_head) {
  const int s = blockIdx.x, bh = blockIdx.y, c = threadIdx.x;
  const long long src = (static_cast<long long>(bh) * in.S + s) * in.D + c;
  const long long dst = (static_cast<long long>(bh) * capacity + n + s) * in.D + c;
  bool bad = false;
  for (int which = 0; which < 2; ++which) {
    const float x = load_input(which ? in.values : in.keys, in.dtype, src);
    bad |= !(fabsf(x) <= 65504.f);
    std::uint16_t bits;
    if (type == DenseType::f16) {
      const __half h = __float2half_rn(x);
      bits = *reinterpret_cast<const std::uint16_t*>(&h);
    } else {
      const __nv_bfloat16 h = __float2bfloat16_rn(x);
      bits = *reinterpret_cast<const std::uint16_t*>(&h);
    }
    (which ? v : k)[dst] = bits;
  }
  bad = __syncthreads_or(bad);
  if (c == 0) {
    report_bad(in, bh, s, bad);
    if (pos_per_head) {
      pos[bh * capacity + n + s] = input_position(in, s);
    } else if (bh == 0) {
      pos[n + s] = input_position(in, s);
    }
  }
}

// Row `row` of [window | input] for channel c, as fp16 (the CPU's intake); input rows are checked.
__device__ __forceinline__ float window_or_input(const AppendInput& in, const StagingWindow& w, const std::uint16_t* stage,
                                                 const void* src, int bh, int row, int c, bool& bad) {
  if (row < w.staged) {
    const std::uint16_t hbits = stage[(static_cast<long long>(bh) * w.capacity + row) * in.D + c];
    return __half2float(*reinterpret_cast<const __half*>(&hbits));
  }
  return load_as_fp16_float(src, in.dtype, (static_cast<long long>(bh) * in.S + row - w.staged) * in.D + c, bad);
}

// Group blocks: grid (groups, BH, 2 = keys/values), D threads (one channel each): the channel's
// min / max over the group's rows, its parameters, then the codes 32 rows at a time through shared
// memory into the plane layout. Tail blocks: grid (tail rows, BH), D threads.
__global__ void kivi_group_kernel(AppendInput in, KiviStore st, int n_units, StagingWindow w) {
  extern __shared__ unsigned char codes[];  // [32][D]
  const int gi = blockIdx.x, bh = blockIdx.y, which = blockIdx.z, c = threadIdx.x, D = in.D;
  const int bits = which ? st.v_bits : st.k_bits, RB = D * bits / 8, GR = st.group_rows;
  const std::uint16_t* stage = which ? w.v_in : w.k_in;
  const void* src = which ? in.values : in.keys;
  const int row0 = gi * GR;  // first row of [window | input]
  bool bad = false;
  int bad_row = INT_MAX;
  float mn = INFINITY, mx = -INFINITY;
  for (int r = 0; r < GR; ++r) {
    bool b = false;
    const float x = window_or_input(in, w, stage, src, bh, row0 + r, c, b);
    if (b) {
      bad = true;
      bad_row = min(bad_row, row0 + r - w.staged);
    }
    mn = fminf(mn, x);
    mx = fmaxf(mx, x);
  }
  std::uint16_t scale_h, zero_h;
  float scale_f, zero_f;
  make_params(mn, mx, bits, scale_h, zero_h, scale_f, zero_f);
  std::uint16_t* params = (which ? st.v_params : st.k_params) +
                          (static_cast<long long>(bh) * (st.capacity / GR) + n_units * 32LL / GR + gi) * 2 * D;
  params[c] = scale_h;
  params[D + c] = zero_h;
  std::uint8_t* out = (which ? st.v_codes : st.k_codes) + (static_cast<long long>(bh) * st.capacity + n_units * 32LL + row0) * RB;
  for (int u = 0; u < GR / 32; ++u) {
#pragma unroll 4
    for (int r = 0; r < 32; ++r) {
      bool unused = false;
      const float x = window_or_input(in, w, stage, src, bh, row0 + 32 * u + r, c, unused);
      codes[r * D + c] = quantize_code(x, zero_f, scale_f, bits);
    }
    __syncthreads();
    pack_unit(codes, D, bits, out + 32LL * u * RB);
    __syncthreads();  // codes is written again
  }
  report_bad(in, bh, bad_row, bad);
  if (bh == 0 && which == 0) {
    for (int r = c; r < GR; r += blockDim.x) {
      const int row = row0 + r;
      st.pos[n_units * 32LL + row] = row < w.staged ? w.pos_in[row] : input_position(in, row - w.staged);
    }
  }
}

// Rows [first_row, staged + S) of [window | input] -> window_out rows [out_row0, ...). Only input
// rows reach here (see append.h), so the source is the input.
__global__ void kivi_tail_kernel(AppendInput in, StagingWindow w, int first_input_row, int out_row0) {
  const int i = blockIdx.x, bh = blockIdx.y, c = threadIdx.x, D = in.D;
  const int s = first_input_row + i;
  bool bad = false;
  for (int which = 0; which < 2; ++which) {
    const void* src = which ? in.values : in.keys;
    const float x = load_as_fp16_float(src, in.dtype, (static_cast<long long>(bh) * in.S + s) * D + c, bad);
    const __half h = __float2half_rn(x);
    (which ? w.v_out : w.k_out)[(static_cast<long long>(bh) * w.capacity + out_row0 + i) * D + c] =
        *reinterpret_cast<const std::uint16_t*>(&h);
  }
  bad = __syncthreads_or(bad);
  if (c == 0) {
    report_bad(in, bh, s, bad);
    if (w.pos_head_stride != 0) {
      w.pos_out[bh * w.pos_head_stride + out_row0 + i] = input_position(in, s);
    } else if (bh == 0) {
      w.pos_out[out_row0 + i] = input_position(in, s);
    }
  }
}

}  // namespace

void launch_dense_append(const AppendInput& in, std::uint16_t* k, std::uint16_t* v, DenseType type,
                         long long capacity, int n, std::int64_t* pos, cudaStream_t stream, bool pos_per_head) {
  launch_kernel(true, false, dense_append_kernel, dim3(in.S, in.BH), dim3(in.D), 0, stream, in, k, v, type, capacity, n,
                pos, pos_per_head);
}

void launch_window_append(const AppendInput& in, const StagingWindow& window, int out_row0, cudaStream_t stream) {
  launch_kernel(in.S > 0, false, kivi_tail_kernel, dim3(in.S, in.BH), dim3(in.D), 0, stream, in, window, 0, out_row0);
}

void launch_kivi_append(const AppendInput& in, const KiviStore& store, int n_units, int compress,
                        const StagingWindow& window, cudaStream_t stream) {
  const int total = window.staged + in.S;
  // Both kernels are launch sites in every step, switched off when they have nothing to do (a
  // replayed step's graph holds both: kernel_launch.h).
  launch_kernel(compress > 0, false, kivi_group_kernel, dim3(compress / store.group_rows, in.BH, 2), dim3(in.D),
                static_cast<std::size_t>(32 * in.D), stream, in, store, n_units, window);
  // compress == 0: the whole input joins the window after its staged rows; else the input's last
  // total - compress rows start the fresh window.
  const int tail = compress == 0 ? in.S : total - compress;
  const int first_input_row = in.S - tail;
  const int out_row0 = compress == 0 ? window.staged : 0;
  launch_kernel(tail > 0, false, kivi_tail_kernel, dim3(tail, in.BH), dim3(in.D), 0, stream, in, window,
                first_input_row, out_row0);
}

}  // namespace kvslim::cuda
