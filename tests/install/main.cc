// Uses the installed library: squeeze over two layers of identical keys (uniform fallback: 8 kept).
#include <kvslim/kvslim.h>
#include <cstdio>
#include <vector>
int main() {
  kvslim::KVCacheConfig c; c.method = "squeeze"; c.squeeze_budget = 8; c.squeeze_n_sink = 2;
  auto set = kvslim::KVCacheBuilder::for_model(kvslim::ModelSpec::uniform(2, 1, 4), c);
  std::vector<float> k(20 * 4, 0.5f);
  for (int l = 0; l < 2; ++l) set.at(l).update_and_fetch(kvslim::make_block(k.data(), 1, 1, 20, 4), kvslim::make_block(k.data(), 1, 1, 20, 4));
  std::printf("kept %zu\n", set.at(0).stats().tokens_kept);
  return set.at(0).stats().tokens_kept == 8 ? 0 : 1;
}
