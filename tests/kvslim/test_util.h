// Shared helpers of the library tests: seeded data and block builders.
#pragma once
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "kvslim/kvslim.h"

namespace kvslim::testing {

// n normal(0, 1) samples rounded to fp16 and back, seeded (the original's fp16 test data).
inline std::vector<float> normal_fp16(std::size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> out(n);
  for (auto& x : out) x = fp16_to_f32(f32_to_fp16(dist(rng) * scale));
  return out;
}

// Keys and values of one [B, H, S, D] step, owned.
struct KV {
  std::size_t B, H, S, D;
  std::vector<float> k, v;
  KV(std::size_t b, std::size_t h, std::size_t s, std::size_t d, unsigned seed)
      : B(b), H(h), S(s), D(d), k(normal_fp16(b * h * s * d, seed)), v(normal_fp16(b * h * s * d, seed + 7919)) {}
  KVBlock keys() const { return make_block(k.data(), B, H, S, D); }
  KVBlock values() const { return make_block(v.data(), B, H, S, D); }
};

// Positions of head (b, h) in the view, sorted ascending.
inline std::vector<std::int64_t> sorted_positions(const CacheView& v, std::size_t b = 0, std::size_t h = 0) {
  std::vector<std::int64_t> out;
  for (std::size_t i = 0; i < v.tokens; ++i) out.push_back(v.position(b, h, i));
  std::sort(out.begin(), out.end());
  return out;
}

// The conformance tests pin the documented behaviour: the H2O core's "original" profile (key
// proxy, no recent window, no decay). Tests of the query-aware default set it back explicitly.
inline KVCacheConfig config_for(const std::string& method) {
  KVCacheConfig c;
  c.method = method;
  c.evict_profile = "original";
  return c;
}

}  // namespace kvslim::testing
