// llama-perplexity's --kl-divergence-base file, read and written bit-compatibly, and its KL
// statistics, so kvslim and llama.cpp are scored against the same reference log-probabilities
// on the same tokens.
//
// Layout (little-endian): "_logits_" | u32 n_ctx | i32 n_vocab | i32 n_chunk |
// i32 tokens[n_chunk * n_ctx] | per chunk, n_ctx - 1 - n_ctx/2 rows (positions n_ctx/2 ..
// n_ctx - 2, row i predicting token i + 1 of the chunk) of nv = 2*((n_vocab + 1)/2) + 4 u16:
// f32 scale, f32 min_log_prob, then n_vocab codes, log p = scale * code + min_log_prob (log-probs
// below max - 16 clamp to the minimum). The first token of every chunk is replaced by BOS when
// the model adds one.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <vector>

namespace kvslim::engine {
class AtomicFile;
}

namespace kvslim::engine::eval {

struct KldHeader {
  std::uint32_t n_ctx = 0;
  std::int32_t n_vocab = 0, n_chunk = 0;
  std::vector<std::int32_t> tokens;  // [n_chunk * n_ctx]
  std::size_t first() const { return n_ctx / 2; }
  std::size_t rows_per_chunk() const { return n_ctx - 1 - n_ctx / 2; }
  std::size_t row_u16() const { return 2 * ((static_cast<std::size_t>(n_vocab) + 1) / 2) + 4; }
};

// Reads the header and streams the chunks' rows in order. Throws std::runtime_error naming the file.
class KldReader {
 public:
  explicit KldReader(const std::filesystem::path& path);
  const KldHeader& header() const { return header_; }
  // The next chunk's rows, [rows_per_chunk * row_u16].
  const std::vector<std::uint16_t>& next_chunk();

 private:
  std::string name_;
  std::ifstream in_;
  KldHeader header_;
  std::vector<std::uint16_t> rows_;
};

// Writes a file in the same layout (the header first, then chunks in order), streamed into a
// temporary file beside `path`; finish() renames it over `path` once every chunk is written, so an
// error (or an exception before finish()) leaves any previous file as it was.
class KldWriter {
 public:
  KldWriter(const std::filesystem::path& path, const KldHeader& header);
  ~KldWriter();
  // logits [rows_per_chunk, n_vocab] of positions first .. n_ctx - 2 of the chunk.
  void add_chunk(std::span<const float> logits);
  void finish();

 private:
  std::string name_;
  std::unique_ptr<AtomicFile> out_;
  std::size_t chunks_ = 0;
  KldHeader header_;
  std::vector<std::uint16_t> row_;
};

// llama-perplexity's statistics of a run against the base (sums; means below).
struct KldStats {
  double sum_kld = 0, sum_kld2 = 0, sum_nll = 0, sum_nll_base = 0;
  std::size_t count = 0, same_top = 0;
  double max_kld = 0;

  // One position: `logits` [n_vocab] of this run, `base_row` the base file's row, `token` the
  // true next token. Computed as llama-perplexity does (fp32 log-softmax, base terms below
  // log p = -16 skipped).
  void add(std::span<const float> logits, const std::uint16_t* base_row, int token);
  double mean_kld() const { return count ? sum_kld / static_cast<double>(count) : 0.0; }
  double mean_nll() const { return count ? sum_nll / static_cast<double>(count) : 0.0; }
  double mean_nll_base() const { return count ? sum_nll_base / static_cast<double>(count) : 0.0; }
  double same_top_fraction() const { return count ? static_cast<double>(same_top) / static_cast<double>(count) : 0.0; }
};

}  // namespace kvslim::engine::eval
