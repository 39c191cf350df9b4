// Uses the installed library: squeeze over two layers of identical keys (uniform fallback: 8 kept
// once every layer has adopted the schedule, i.e. after one decode step, with the documented core:
// the query-aware default reports a layer's signal only after its attention or, without any, one
// call later), then attend.
#include <kvslim/kvslim.h>
#include <cstdio>
#include <vector>
int main() {
  kvslim::KVCacheConfig c; c.method = "squeeze"; c.squeeze_budget = 8; c.squeeze_n_sink = 2; c.evict_profile = "original";
  auto set = kvslim::KVCacheBuilder::for_model(kvslim::ModelSpec::uniform(2, 1, 4), c);
  std::vector<float> k(20 * 4, 0.5f);
  for (int l = 0; l < 2; ++l) set.at(l).append(kvslim::make_block(k.data(), 1, 1, 20, 4), kvslim::make_block(k.data(), 1, 1, 20, 4));
  for (int l = 0; l < 2; ++l) set.at(l).append(kvslim::make_block(k.data(), 1, 1, 1, 4), kvslim::make_block(k.data(), 1, 1, 1, 4));
  std::vector<float> q(2 * 4, 1.0f), out(2 * 4);
  const std::vector<std::int64_t> pos{20};
  set.at(0).attend(kvslim::QueryBlock{q.data(), 1, 1, 2, 4}, pos, out.data());
  std::printf("kept %zu, out[0] %.3f\n", set.at(0).stats().tokens_kept, out[0]);
  return set.at(0).stats().tokens_kept == 8 && out[0] > 0.49f && out[0] < 0.51f ? 0 : 1;
}
