// The CPU's group quantizer on the device (quant/quant_reference.cc, operation for operation), shared
// by the kivi and zipcache appends: one channel's parameters from its group's min / max, and a unit
// of 32 rows of codes packed into the CPU's bit-plane layout (kvslim/zipcache.h packed_row_bytes).
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

namespace kvslim::cuda {

// The CPU's make_params rule for one channel: zero = fp16(min), scale = the smallest fp16 >=
// max((max - zero) / levels, 1e-8); both as fp16 bits and as the floats the codes are made with.
__device__ inline void make_params(float mn, float mx, int bits, std::uint16_t& scale_h, std::uint16_t& zero_h,
                                   float& scale_f, float& zero_f) {
  const float levels = static_cast<float>((1u << bits) - 1u);
  const __half z = __float2half_rn(mn);
  const float zf = __half2float(z);
  const float s = fmaxf(__fdiv_rn(__fsub_rn(mx, zf), levels), 1e-8f);
  __half sh = __float2half_rn(s);
  std::uint16_t shb = *reinterpret_cast<const std::uint16_t*>(&sh);
  if (__half2float(sh) < s) ++shb;
  if (shb > 0x7bffu) shb = 0x7bffu;
  zero_h = *reinterpret_cast<const std::uint16_t*>(&z);
  scale_h = shb;
  zero_f = zf;
  const __half sh2 = *reinterpret_cast<const __half*>(&shb);
  scale_f = __half2float(sh2);
}

// code = clamp(rint((x - zero) / scale), 0, levels), as the CPU rounds.
__device__ __forceinline__ unsigned char quantize_code(float x, float zero_f, float scale_f, int bits) {
  const float levels = static_cast<float>((1u << bits) - 1u);
  const float q = rintf(__fdiv_rn(__fsub_rn(x, zero_f), scale_f));
  return static_cast<unsigned char>(fminf(fmaxf(q, 0.f), levels));
}

// codes [32][D] (one byte a code, shared memory) -> out [32][D * bits / 8]: byte i of a row holds
// channels i, i + RB, ... at bit offsets 0, bits, ... Every thread of the block takes part.
__device__ inline void pack_unit(const unsigned char* codes, int D, int bits, std::uint8_t* out) {
  const int RB = D * bits / 8, per_byte = 8 / bits;
  for (int idx = threadIdx.x; idx < 32 * RB; idx += blockDim.x) {
    const int r = idx / RB, i = idx % RB;
    unsigned byte = 0;
    for (int j = 0; j < per_byte; ++j) byte |= static_cast<unsigned>(codes[r * D + i + j * RB]) << (j * bits);
    out[idx] = static_cast<std::uint8_t>(byte);
  }
}

}  // namespace kvslim::cuda
