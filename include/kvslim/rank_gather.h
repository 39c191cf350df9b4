// The one seam through which a cache set that holds only some KV heads of each layer agrees with
// the sets holding the others (tensor parallelism: every rank the same layers and tokens, a slice
// of the heads). kvslim itself moves no bytes between processes: the caller installs a RankGather
// (Python: kvslim.distributed, over torch.distributed) and kvslim combines what every rank gathered
// in the single-process head order, so each rank decides what one process over all heads would.
#pragma once
#include <vector>

namespace kvslim {

class RankGather {
 public:
  virtual ~RankGather() = default;
  // Every rank's `local`, in rank order (lengths may differ). Rank r holds the heads right after
  // rank r - 1's. A collective: every rank of the group calls it the same number of times in the
  // same order, which the set's layers guarantee when every rank runs the same model steps.
  virtual std::vector<std::vector<double>> all_gather(const std::vector<double>& local) = 0;
};

}  // namespace kvslim
