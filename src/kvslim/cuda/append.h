// Fused appends on the device: one kernel per layer per step converts the step's K/V to the
// storage's form -- dense rows (full), or, for kivi, the staging window plus, once the window is
// full, every complete group quantized and bit-packed with its fp16 parameters in the CPU's layout
// and rules (kvslim/zipcache.h) -- and records positions. Inputs are checked in the same pass:
// the first bad element is reported through a device flag (read by the cache without stalling the
// stream; see device_cache.h).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_common.cuh"
#include "kvslim/dtype.h"

namespace kvslim::cuda {

// The step's input: [B, H, S, D] keys and values of `dtype`, positions first + i or pos[i].
struct AppendInput {
  const void* keys = nullptr;
  const void* values = nullptr;
  DType dtype = DType::f16;
  int BH = 0, S = 0, D = 0;
  std::int64_t first_position = 0;
  const std::int64_t* positions = nullptr;  // device [S], or null: first_position + i
  int* bad_element = nullptr;               // device: min index (bh * S + s) of a row holding a non-finite or
                                            // |x| > 65504 value (INT32_MAX when none)
  int* bad_host = nullptr;                  // mapped pinned host memory: such a row's index is also stored
                                            // there (no copy per step; read once the step's event is done)
};

// Dense store: rows [n, n + S) of [BH, capacity, D] (type), pos [capacity] (pos_per_head: [BH,
// capacity], every head's own table, for stores whose heads keep different rows).
void launch_dense_append(const AppendInput& in, std::uint16_t* k, std::uint16_t* v, DenseType type,
                         long long capacity, int n, std::int64_t* pos, cudaStream_t stream, bool pos_per_head = false);

// kivi: rows r < compress (a multiple of group_rows) of [staging window (staged rows) | input] become
// units n_units .. n_units + compress/32 of the code store (32-row units; groups of group_rows rows,
// one parameter set each); rows [compress, staged + S) go to stage_out (stage_in itself when compress
// == 0, at row staged). Windows are fp16 [BH, stage_capacity, D].
struct KiviStore {
  std::uint8_t* k_codes = nullptr;  // [BH, capacity, D * k_bits / 8]
  std::uint8_t* v_codes = nullptr;  // [BH, capacity, D * v_bits / 8]
  std::uint16_t* k_params = nullptr;  // [BH, capacity / group_rows, 2, D]
  std::uint16_t* v_params = nullptr;
  std::int64_t* pos = nullptr;        // [capacity]
  long long capacity = 0;             // rows, a multiple of group_rows
  int k_bits = 2, v_bits = 2;
  int group_rows = 32;                // a multiple of 32
};
struct StagingWindow {
  const std::uint16_t* k_in = nullptr;  // [BH, stage_capacity, D]
  const std::uint16_t* v_in = nullptr;
  const std::int64_t* pos_in = nullptr;
  std::uint16_t* k_out = nullptr;
  std::uint16_t* v_out = nullptr;
  std::int64_t* pos_out = nullptr;
  long long capacity = 0;
  int staged = 0;
  long long pos_head_stride = 0;  // 0: pos_out [capacity], one table; else [BH, pos_head_stride] (heads keep their own rows)
};
// The whole input into a window's rows [out_row0, out_row0 + S) (window.k_out / v_out / pos_out),
// checked and rounded to fp16 as every append (zipcache's window takes each call whole).
void launch_window_append(const AppendInput& in, const StagingWindow& window, int out_row0, cudaStream_t stream);
void launch_kivi_append(const AppendInput& in, const KiviStore& store, int n_units, int compress,
                        const StagingWindow& window, cudaStream_t stream);

}  // namespace kvslim::cuda
