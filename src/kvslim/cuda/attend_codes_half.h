// The decode step's kernel over kivi codes (attend_codes_half.cu: keys on the int8 tensor cores,
// values on the fp16 ones), behind
// launch_packed / packed_splits (attend_codes.cu), which choose between it and the int8 kernel.
#pragma once
#include <cuda_runtime.h>

#include "cuda/attend.h"

namespace kvslim::cuda {

// Whether the fp16 kernel takes this query over these rows: at most 4 query vectors per KV head (a
// decode step with up to 4 query heads per KV head) and groups of 2+ units; head_dim 64 / 128 and
// widths 2 / 4 / 8 are checked by the caller.
bool half_codes_take(const QueryArgs& q, const PackedRows& rows);
// CTAs of the kernel for these widths and head_dim resident per SM.
int half_codes_resident(const QueryArgs& q, const PackedRows& rows);
// Launch on `stream`: `splits` CTAs per (b, h), each `units_per_split` units (whole groups).
void launch_half_codes(const QueryArgs& q, const PackedRows& rows, const Partials& parts, int part_base, int splits,
                       int units_per_split, cudaStream_t stream);

}  // namespace kvslim::cuda
