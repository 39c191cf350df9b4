// Shared by the eval_*_test.cc files: a small random model on disk and a byte-level encoder, so
// the evaluation tests need neither models/tiny nor a tokenizer.json.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "engine/model.h"
#include "engine/random_model.h"

namespace kvslim::engine::eval::testing {

// A 2-layer GQA model (4 query / 2 KV heads of 16) with a 260-token vocabulary: bytes 0..255,
// then 256 = BOS. Written once per process.
inline const Model& small_model() {
  static const Model model = [] {
    const auto dir = std::filesystem::temp_directory_path() / ("kvslim_eval_test_" + std::to_string(getpid()));
    RandomModelSpec spec;
    spec.vocab_size = 260;
    spec.num_layers = 2;
    spec.seed = 11;
    write_random_model(dir, spec, /*force=*/true);  // a stale directory of a reused pid is replaced
    Model m = Model::load(dir);
    return m;
  }();
  return model;
}

constexpr int kBos = 256;

// One token per byte.
inline std::vector<int> byte_encode(std::string_view text) {
  std::vector<int> ids;
  ids.reserve(text.size());
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

inline std::string byte_decode(const std::vector<int>& ids, std::size_t first, std::size_t count) {
  std::string s;
  for (std::size_t i = first; i < first + count && i < ids.size(); ++i) s += static_cast<char>(ids[i]);
  return s;
}

// Prose-like filler lines.
inline std::vector<std::string> filler_lines() {
  std::vector<std::string> lines;
  for (int i = 0; i < 60; ++i) {
    lines.push_back("Line " + std::to_string(i) + " of the filler text talks about weather, rivers and old books.");
  }
  return lines;
}

}  // namespace kvslim::engine::eval::testing
