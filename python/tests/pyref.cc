// kvslim_pyref: the C++ side of the Python binding tests. Runs a CacheSet over blocks read from a
// file and writes the final views and stats, so a test can feed the same blocks through the
// binding and compare bit for bit.
//
//   kvslim_pyref IN OUT LAYERS KV_HEADS HEAD_DIM [field=value ...]
// IN:  repeated steps: int64 S, then per layer keys f32 [1, KV_HEADS, S, HEAD_DIM] and values
//      (same shape); positions continue after the last one. S = 0 ends the file.
// After every update of a cache that asks for attention, it observes probs_rule() below (the
//      Python test computes the same numbers from the view it got back).
// OUT: per layer: uint64 T, int64 positions [KV_HEADS, T], fp16 keys [KV_HEADS, T, HEAD_DIM],
//      fp16 values (same), then uint64 resident_bytes, tokens_seen, tokens_kept.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "kvslim/kvslim.h"

using namespace kvslim;

namespace {

// Synthetic attention weight query q of a step gives row i of head h (exact in fp32: k/32).
float probs_rule(std::int64_t position, std::size_t q, std::size_t h, std::size_t layer) {
  return static_cast<float>((position * 7 + static_cast<std::int64_t>(q * 3 + h * 5 + layer)) % 17 + 1) / 32.0f;
}

template <class T>
void put(std::ofstream& out, const T* p, std::size_t n) {
  out.write(reinterpret_cast<const char*>(p), static_cast<std::streamsize>(n * sizeof(T)));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::cerr << "usage: kvslim_pyref IN OUT LAYERS KV_HEADS HEAD_DIM [field=value ...]\n";
    return 2;
  }
  try {
    const int layers = std::stoi(argv[3]), heads = std::stoi(argv[4]), dim = std::stoi(argv[5]);
    KVCacheConfig config;
    for (int i = 6; i < argc; ++i) {
      const std::string kv = argv[i];
      const auto eq = kv.find('=');
      if (eq == std::string::npos) throw std::invalid_argument("expected field=value, got " + kv);
      config.set(kv.substr(0, eq), kv.substr(eq + 1));
    }
    CacheSet set = KVCacheBuilder::for_model(ModelSpec::uniform(layers, heads, dim), config);
    std::ifstream in(argv[1], std::ios::binary);
    if (!in) throw std::runtime_error(std::string("cannot read ") + argv[1]);
    std::vector<float> keys, values, probs;
    std::vector<std::int64_t> qpos;
    std::int64_t next = 0;
    for (;;) {
      std::int64_t s = 0;
      if (!in.read(reinterpret_cast<char*>(&s), sizeof s)) throw std::runtime_error("truncated input");
      if (s == 0) break;
      const std::size_t n = static_cast<std::size_t>(heads) * static_cast<std::size_t>(s) * static_cast<std::size_t>(dim);
      keys.resize(n);
      values.resize(n);
      qpos.resize(static_cast<std::size_t>(s));
      for (std::int64_t i = 0; i < s; ++i) qpos[static_cast<std::size_t>(i)] = next + i;
      for (int l = 0; l < layers; ++l) {
        in.read(reinterpret_cast<char*>(keys.data()), static_cast<std::streamsize>(n * sizeof(float)));
        in.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(n * sizeof(float)));
        if (!in) throw std::runtime_error("truncated input");
        KVCache& cache = set.at(static_cast<std::size_t>(l));
        const auto S = static_cast<std::size_t>(s), H = static_cast<std::size_t>(heads), D = static_cast<std::size_t>(dim);
        const CacheView v = cache.update_and_fetch(make_block(keys.data(), 1, H, S, D), make_block(values.data(), 1, H, S, D));
        if (cache.needs().attention) {
          probs.resize(H * S * v.tokens);
          for (std::size_t h = 0; h < H; ++h)
            for (std::size_t q = 0; q < S; ++q)
              for (std::size_t i = 0; i < v.tokens; ++i)
                probs[(h * S + q) * v.tokens + i] = probs_rule(v.position(0, h, i), q, h, static_cast<std::size_t>(l));
          cache.observe_attention(AttentionObservation{probs.data(), 1, H, S, v.tokens, v.tokens, qpos});
        }
      }
      next += s;
    }
    std::ofstream out(argv[2], std::ios::binary);
    for (int l = 0; l < layers; ++l) {
      const KVCache& cache = set.at(static_cast<std::size_t>(l));
      const CacheView v = cache.view();
      const std::uint64_t t = v.tokens;
      put(out, &t, 1);
      for (std::size_t h = 0; h < v.heads; ++h) put(out, v.positions + h * v.head_stride, v.tokens);
      for (std::size_t h = 0; h < v.heads; ++h) put(out, v.key_row(0, h, 0), v.tokens * v.head_dim);
      for (std::size_t h = 0; h < v.heads; ++h) put(out, v.value_row(0, h, 0), v.tokens * v.head_dim);
      const CacheStats st = cache.stats();
      const std::uint64_t figures[3] = {st.resident_bytes, st.tokens_seen, st.tokens_kept};
      put(out, figures, 3);
    }
    return out ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "kvslim_pyref: " << e.what() << "\n";
    return 1;
  }
}
