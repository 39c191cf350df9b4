#include "engine/eval/kld_file.h"

#include "engine/output_file.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kvslim::engine::eval {
namespace {

constexpr char kMagic[8] = {'_', 'l', 'o', 'g', 'i', 't', 's', '_'};

}  // namespace

KldReader::KldReader(const std::filesystem::path& path) : name_(path.string()) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw std::runtime_error(name_ + ": is a directory, expected a logits file");
  in_.open(path, std::ios::binary);
  if (!in_) throw std::runtime_error(name_ + ": cannot open");
  char magic[8];
  in_.read(magic, 8);
  if (!in_ || std::memcmp(magic, kMagic, 8) != 0) throw std::runtime_error(name_ + ": not a llama-perplexity logits file");
  in_.read(reinterpret_cast<char*>(&header_.n_ctx), 4);
  in_.read(reinterpret_cast<char*>(&header_.n_vocab), 4);
  in_.read(reinterpret_cast<char*>(&header_.n_chunk), 4);
  if (!in_ || header_.n_ctx < 4 || header_.n_ctx > (1u << 24) || header_.n_vocab <= 0 || header_.n_vocab > (1 << 24) ||
      header_.n_chunk <= 0 || header_.n_chunk > (1 << 20)) {
    throw std::runtime_error(name_ + ": implausible header (n_ctx " + std::to_string(header_.n_ctx) + ", n_vocab " +
                             std::to_string(header_.n_vocab) + ", n_chunk " + std::to_string(header_.n_chunk) + ")");
  }
  // One chunk's rows are held in memory: refuse sizes no real run has (n_ctx x n_vocab above 2^31).
  if (static_cast<std::uint64_t>(header_.rows_per_chunk()) * header_.row_u16() > (std::uint64_t{1} << 31) ||
      static_cast<std::uint64_t>(header_.n_chunk) * header_.n_ctx > (std::uint64_t{1} << 28)) {
    throw std::runtime_error(name_ + ": implausible sizes (n_ctx " + std::to_string(header_.n_ctx) + " x n_vocab " +
                             std::to_string(header_.n_vocab) + ", " + std::to_string(header_.n_chunk) + " chunks)");
  }
  // A regular file must hold what its header claims before anything is allocated for it.
  if (std::filesystem::is_regular_file(path, ec)) {
    const std::uint64_t need = 20 + std::uint64_t{4} * header_.n_chunk * header_.n_ctx +
                               std::uint64_t{2} * header_.n_chunk * header_.rows_per_chunk() * header_.row_u16();
    const std::uint64_t have = std::filesystem::file_size(path, ec);
    if (!ec && have < need) {
      throw std::runtime_error(name_ + ": truncated (its header claims " + std::to_string(need) + " bytes, the file has " +
                               std::to_string(have) + ")");
    }
  }
  header_.tokens.resize(static_cast<std::size_t>(header_.n_chunk) * header_.n_ctx);
  in_.read(reinterpret_cast<char*>(header_.tokens.data()), static_cast<std::streamsize>(header_.tokens.size() * 4));
  if (!in_) throw std::runtime_error(name_ + ": truncated token list");
  rows_.resize(header_.rows_per_chunk() * header_.row_u16());
}

const std::vector<std::uint16_t>& KldReader::next_chunk() {
  in_.read(reinterpret_cast<char*>(rows_.data()), static_cast<std::streamsize>(rows_.size() * 2));
  if (!in_) throw std::runtime_error(name_ + ": truncated log-probabilities");
  return rows_;
}

KldWriter::KldWriter(const std::filesystem::path& path, const KldHeader& header)
    : name_(path.string()), out_(std::make_unique<AtomicFile>(path, path.string())), header_(header) {
  out_->write(kMagic, 8);
  out_->write(&header_.n_ctx, 4);
  out_->write(&header_.n_vocab, 4);
  out_->write(&header_.n_chunk, 4);
  out_->write(header_.tokens.data(), header_.tokens.size() * 4);
  row_.resize(header_.row_u16());
}

KldWriter::~KldWriter() = default;

void KldWriter::finish() {
  if (chunks_ != static_cast<std::size_t>(header_.n_chunk)) {
    throw std::logic_error(name_ + ": " + std::to_string(chunks_) + " of " + std::to_string(header_.n_chunk) + " chunks written");
  }
  out_->commit();
}

void KldWriter::add_chunk(std::span<const float> logits) {
  const std::size_t n_vocab = static_cast<std::size_t>(header_.n_vocab);
  if (logits.size() != header_.rows_per_chunk() * n_vocab) throw std::invalid_argument("KldWriter: wrong chunk size");
  for (std::size_t r = 0; r < header_.rows_per_chunk(); ++r) {
    const float* l = logits.data() + r * n_vocab;
    // llama-perplexity's encoding, step for step.
    float max_logit = l[0], min_logit = l[0];
    for (std::size_t i = 1; i < n_vocab; ++i) {
      max_logit = std::max(max_logit, l[i]);
      min_logit = std::min(min_logit, l[i]);
    }
    min_logit = std::max(min_logit, max_logit - 16);
    double sum_exp = 0;
    for (std::size_t i = 0; i < n_vocab; ++i) sum_exp += std::exp(l[i] - max_logit);
    const float log_sum_exp = static_cast<float>(std::log(sum_exp));
    const float min_log_prob = min_logit - max_logit - log_sum_exp;
    const float scale = (max_logit - min_logit) / 65535.f;
    std::memcpy(row_.data(), &scale, 4);
    std::memcpy(row_.data() + 2, &min_log_prob, 4);
    std::fill(row_.begin() + 4, row_.end(), 0);
    if (scale != 0) {
      const float inv_scale = 1 / scale;
      for (std::size_t i = 0; i < n_vocab; ++i) {
        row_[4 + i] = l[i] > min_logit ? static_cast<std::uint16_t>(std::lround(inv_scale * (l[i] - min_logit))) : 0;
      }
    }
    out_->write(row_.data(), row_.size() * 2);
  }
  ++chunks_;
}

void KldStats::add(std::span<const float> logits, const std::uint16_t* base_row, int token) {
  const std::size_t n = logits.size();
  float max_logit = logits[0];
  std::size_t imax = 0;
  for (std::size_t i = 1; i < n; ++i) {
    if (logits[i] > max_logit) {
      max_logit = logits[i];
      imax = i;
    }
  }
  double sum_exp = 0;
  for (std::size_t i = 0; i < n; ++i) sum_exp += std::exp(logits[i] - max_logit);
  const float log_sum_exp = static_cast<float>(std::log(sum_exp));
  float scale, min_log_prob;
  std::memcpy(&scale, base_row, 4);
  std::memcpy(&min_log_prob, base_row + 2, 4);
  const std::uint16_t* codes = base_row + 4;
  const float nll = max_logit + log_sum_exp - logits[static_cast<std::size_t>(token)];
  sum_nll += nll;
  sum_nll_base += -(scale * codes[token] + min_log_prob);
  const float lse = max_logit + log_sum_exp;
  double kld = 0;
  std::size_t imax_base = 0;
  float best = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float lp_base = scale * codes[i] + min_log_prob;
    if (i == 0 || lp_base > best) {
      best = lp_base;
      imax_base = i;
    }
    if (lp_base > -16.f) kld += std::exp(lp_base) * (lp_base - logits[i] + lse);
  }
  sum_kld += kld;
  sum_kld2 += kld * kld;
  max_kld = std::max(max_kld, kld);
  ++count;
  same_top += imax == imax_base;
}

}  // namespace kvslim::engine::eval
