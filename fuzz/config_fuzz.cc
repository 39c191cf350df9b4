// libFuzzer target: the cache configuration as text, the way `--set key=value` and bindings hand
// it over. Lines "key=value" go through KVCacheConfig::set, then validate(); a config that passes
// is built into a CacheSet for a small model and driven through the public API: a prefill block,
// decode steps, the observation hooks each layer asks for, stats(), view() and reset().
// The guarantee under test (docs/methods.md): a bad config fails in set() or validate() with
// ConfigError naming the field; a config that passes never throws, crashes or trips ASan/UBSan
// later. Harness-only keys (not KVCacheConfig fields) pick the model and the run:
//   @layers=1..6  @kv_heads=1..4  @head_dim=1..64  @prompt=1..96  @steps=0..48  @seed=N
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "kvslim/errors.h"
#include "kvslim/factory.h"

namespace {

struct Run {
  int layers = 3, kv_heads = 2, head_dim = 8, prompt = 24, steps = 8;
  unsigned seed = 1;
};

// A harness key's value, clamped to its range (these are not what is under test).
int harness_int(std::string_view text, int lo, int hi) {
  long v = 0;
  for (char c : text.substr(0, 9)) {
    if (c < '0' || c > '9') break;
    v = v * 10 + (c - '0');
  }
  return static_cast<int>(std::clamp<long>(v, lo, hi));
}

// Drives one layer's cache through a block of `s` tokens at `first_position`.
void step(kvslim::KVCache& cache, const Run& run, std::size_t s, std::int64_t first_position, std::mt19937& rng,
          std::vector<float>& k, std::vector<float>& v, std::vector<std::int64_t>& pos) {
  const std::size_t h = static_cast<std::size_t>(run.kv_heads), d = static_cast<std::size_t>(run.head_dim);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  k.resize(h * s * d);
  v.resize(h * s * d);
  for (float& x : k) x = dist(rng);
  for (float& x : v) x = dist(rng);
  pos.resize(s);
  for (std::size_t i = 0; i < s; ++i) pos[i] = first_position + static_cast<std::int64_t>(i);
  const kvslim::KVBlock keys = kvslim::make_block(k.data(), 1, h, s, d);
  const kvslim::KVBlock values = kvslim::make_block(v.data(), 1, h, s, d);
  const kvslim::CacheView view = cache.update_and_fetch(keys, values, pos);
  if (view.tokens == 0 || view.tokens > view.head_stride || view.heads != h || view.head_dim != d) std::abort();
  const kvslim::ObservationNeeds needs = cache.needs();
  if (needs.attention) {
    // Uniform causal attention of the s queries over the view (what an engine would report).
    std::vector<float> probs(h * s * view.tokens, 1.0f / static_cast<float>(view.tokens));
    cache.observe_attention(kvslim::AttentionObservation{probs.data(), 1, h, s, view.tokens, view.tokens, pos});
  }
  if (needs.hidden_states && s > 1) {
    const std::size_t hidden = 16;
    std::vector<float> before(s * hidden), after(s * hidden);
    for (float& x : before) x = dist(rng);
    for (float& x : after) x = dist(rng);
    cache.observe_hidden(kvslim::HiddenObservation{before.data(), after.data(), 1, s, hidden});
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  kvslim::KVCacheConfig config;
  Run run;
  // 1. The text: every failure here must be a ConfigError.
  try {
    std::size_t start = 0;
    while (start < text.size()) {
      std::size_t end = text.find('\n', start);
      if (end == std::string_view::npos) end = text.size();
      const std::string_view line = text.substr(start, end - start);
      start = end + 1;
      const std::size_t eq = line.find('=');
      if (line.empty() || eq == std::string_view::npos) continue;
      const std::string_view key = line.substr(0, eq), value = line.substr(eq + 1);
      if (key == "@layers") run.layers = harness_int(value, 1, 6);
      else if (key == "@kv_heads") run.kv_heads = harness_int(value, 1, 4);
      else if (key == "@head_dim") run.head_dim = harness_int(value, 1, 64);
      else if (key == "@prompt") run.prompt = harness_int(value, 1, 96);
      else if (key == "@steps") run.steps = harness_int(value, 0, 48);
      else if (key == "@seed") run.seed = static_cast<unsigned>(harness_int(value, 0, 1 << 30));
      else config.set(key, value);
    }
    config.validate();
  } catch (const kvslim::ConfigError&) {
    return 0;
  }
  // 2. A valid config: building and running it must not throw at all.
  kvslim::CacheSet caches =
      kvslim::KVCacheBuilder::for_model(kvslim::ModelSpec::uniform(run.layers, run.kv_heads, run.head_dim), config);
  std::mt19937 rng(run.seed);
  std::vector<float> k, v;
  std::vector<std::int64_t> pos;
  for (int round = 0; round < 2; ++round) {  // the second round after reset(): a new sequence
    const std::size_t prompt = static_cast<std::size_t>(run.prompt);
    for (std::size_t l = 0; l < caches.size(); ++l) step(caches.at(l), run, prompt, 0, rng, k, v, pos);
    for (int t = 0; t < run.steps; ++t) {
      for (std::size_t l = 0; l < caches.size(); ++l) {
        step(caches.at(l), run, 1, static_cast<std::int64_t>(prompt) + t, rng, k, v, pos);
      }
    }
    for (std::size_t l = 0; l < caches.size(); ++l) {
      const kvslim::CacheStats st = caches.at(l).stats();
      if (st.tokens_seen != prompt + static_cast<std::size_t>(run.steps)) std::abort();
      if (st.tokens_kept != caches.at(l).view().tokens) std::abort();
    }
    (void)caches.resident_bytes();
    caches.reset();
  }
  return 0;
}
