// zipcache's block compression on the device (DeviceZipCache, device_zip_cache.h): the m oldest rows
// of the fp16 window of every head become one block, as the CPU cache compresses them
// (cache/zipcache_cache.cc): key-norm saliency over the block (the n_hi largest norms, ties to the
// later row: kvslim/zipcache.h saliency_mask), the salient rows' keys at hi_bits and the others'
// at lo_bits, each set group-quantized over its own consecutive rows (zip_compress). The values of
// each set are quantized over that set's rows too (the CPU groups them in token order): a 32-row unit
// of the codes kernel pairs a unit of keys with the same rows' values, so each set is a kivi-like
// segment of its own. A set's last unit of a block may be part-filled: its empty slots hold code 0
// and position INT64_MAX, which every query masks.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kvslim::cuda {

// One precision's rows of every head: 32-row units, one fp16 parameter set (scale row, zero row) per
// unit (a group of more rows repeats its parameters in each of its units), per-head positions.
struct ZipSet {
  std::uint8_t* k_codes = nullptr;    // [BH, capacity, D * k_bits / 8]
  std::uint8_t* v_codes = nullptr;    // [BH, capacity, D * v_bits / 8]
  std::uint16_t* k_params = nullptr;  // [BH, capacity / 32, 2, D]
  std::uint16_t* v_params = nullptr;
  std::int64_t* pos = nullptr;        // [BH, capacity]
  std::uint8_t* unit_starts = nullptr;  // [capacity / 32]: 1 where a group begins (every head alike)
  long long capacity = 0;             // rows per head, a multiple of 32
  int k_bits = 4, v_bits = 4;
  int n_units = 0;                    // units held before this block (where it starts)
};

struct ZipFlush {
  const std::uint16_t* k = nullptr;  // the window, fp16 [BH, window_capacity, D]
  const std::uint16_t* v = nullptr;
  const std::int64_t* pos = nullptr;  // [window_capacity], every head's
  long long window_capacity = 0;
  int BH = 0, D = 0;
  int m = 0;           // rows of the block (the window's oldest)
  int n_hi = 0;        // salient rows of each head (salient_count(m, hi_fraction))
  int group_rows = 32;  // a multiple of 32
  double* norms = nullptr;          // scratch [BH, m]
  std::uint8_t* salient = nullptr;  // scratch [BH, m]
  int* members = nullptr;           // scratch [BH, m]: window rows of the hi set (token order), then the lo set's
  std::uint32_t* mask = nullptr;    // [BH, mask_words]: bit t = token t of the cache is salient
  long long mask_words = 0;
  long long first_token = 0;        // the block's first token (a multiple of 32)
  ZipSet hi, lo;
};

// The block's norms, saliency, both sets' codes and parameters and their positions, on `stream`
// (m == 0: the three launches switched off).
void launch_zip_flush(const ZipFlush& f, cudaStream_t stream);

}  // namespace kvslim::cuda
