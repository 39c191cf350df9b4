// zipcache's choice of a group's salient rows, as the device makes it (group_select_kernel in
// device_packed_rows.cu): row i of m is salient when fewer than n_hi rows rank above it under the
// order (norm, row), ties to the later row -- the tail of a stable ascending sort, which is what
// the CPU's saliency_mask keeps (kvslim/zipcache.h). One thread a row, no sort. Shared with a host
// test (tests/kvslim/group_saliency_test.cc) that holds it to saliency_mask on any machine.
#pragma once

#ifdef __CUDACC__
#define KVSLIM_SALIENCY_FN __host__ __device__ __forceinline__
#else
#define KVSLIM_SALIENCY_FN inline
#endif

namespace kvslim::cuda {

// norms [m] (no NaN: the CPU refuses those); n_hi = salient_count(m, hi_fraction).
KVSLIM_SALIENCY_FN bool salient_by_rank(const double* norms, int m, int i, int n_hi) {
  if (n_hi >= m) return true;
  if (n_hi <= 0) return false;
  const double n = norms[i];
  int above = 0;
  for (int r = 0; r < m; ++r) above += (norms[r] > n || (norms[r] == n && r > i)) ? 1 : 0;
  return above < n_hi;
}

}  // namespace kvslim::cuda
