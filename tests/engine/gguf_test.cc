// GGUF import and export (engine/gguf.h, engine/gguf_model.h): block formats bit for bit, the
// round trip HF directory -> GGUF -> kvslim against the safetensors logits and the HF golden
// logits, one file with every supported weight type, the rebuilt tokenizer, and the errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <map>
#include <set>

#include "engine/model_file_limits.h"
#include "engine/gguf.h"
#include "engine/gguf_model.h"
#include "engine/json_util.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"
#include "kvslim/dtype.h"
#include "loader_test_util.h"

namespace kvslim::engine {
namespace {

namespace fs = std::filesystem;
using gguf::TensorType;
using testing::expect_error;
using testing::TempDir;

using testing::source_dir;

CacheSet full_cache(const Model& m) { return KVCacheBuilder::for_model(m.cache_spec(), KVCacheConfig{}); }

// Logits of every position of `ids` through the full cache.
std::vector<float> all_logits(const Model& model, const std::vector<int>& ids) {
  CacheSet caches = full_cache(model);
  Transformer t(model, caches);
  const auto l = t.forward(ids, {}, /*all_logits=*/true, /*prefill=*/true);
  return {l.begin(), l.end()};
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) d = std::max(d, static_cast<double>(std::abs(a[i] - b[i])));
  return d;
}

std::vector<float> tensor_as_float(const TensorInfo& t) {
  std::vector<float> out(weight_elements(t.type, t.nbytes));
  convert_tensor(t, out.data());  // row-major also for the repacked Q4_0x16 matrices
  return out;
}

std::string read_text(const fs::path& p) { return json_util::read_text_file(p, limits::kTokenizerJsonBytes); }

// ---------------------------------------------------------------------------------------------
// Block formats

TEST(GgufBlocks, Q8_0MatchesGgmlDefinition) {
  // amax 2.54 -> d = 0.02 (as f16), q = round(x / d).
  std::vector<float> x(32);
  for (int j = 0; j < 32; ++j) x[j] = (j - 16) * 0.02f * 7.9375f;  // spans [-2.54, 2.38]
  std::vector<std::byte> b(34);
  gguf::quantize_q8_0(x.data(), b.data(), 32);
  std::uint16_t dh;
  std::memcpy(&dh, b.data(), 2);
  const float d = fp16_to_f32(dh);
  EXPECT_EQ(dh, f32_to_fp16(2.54f / 127.0f));
  std::vector<float> y(32);
  gguf::dequantize_q8_0(b.data(), y.data(), 32);
  for (int j = 0; j < 32; ++j) {
    const int q = static_cast<std::int8_t>(b[2 + j]);
    EXPECT_EQ(q, static_cast<int>(std::round(x[j] * (1.0f / (2.54f / 127.0f))))) << j;
    EXPECT_EQ(y[j], q * d) << j;
    // half a step, plus what rounding d to f16 moves a code of up to 127 steps
    EXPECT_LE(std::abs(y[j] - x[j]), d * 0.5f + 127 * std::abs(d - 2.54f / 127.0f) + 1e-6f) << j;
  }
}

TEST(GgufBlocks, Q4_0IsExactOnItsGridAndPacksNibblesLowFirst) {
  // Values k * 0.5 for k in [-8, 7]: the largest magnitude is -4 -> d = -4 / -8 = 0.5, codes k + 8.
  std::vector<float> x(32);
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>((j % 16) - 8) * 0.5f;
  std::vector<std::byte> b(18);
  gguf::quantize_q4_0(x.data(), b.data(), 32);
  std::uint16_t dh;
  std::memcpy(&dh, b.data(), 2);
  EXPECT_EQ(fp16_to_f32(dh), 0.5f);
  for (int j = 0; j < 16; ++j) {
    // element j in the low nibble, element j + 16 in the high one
    EXPECT_EQ(std::to_integer<int>(b[2 + j]), (j % 16) | ((j % 16) << 4)) << j;
  }
  std::vector<float> y(32);
  gguf::dequantize_q4_0(b.data(), y.data(), 32);
  EXPECT_EQ(y, x);
}

TEST(GgufBlocks, ZeroBlocksStayZero) {
  std::vector<float> x(64, 0.0f), y(64, 1.0f);
  std::vector<std::byte> b8(68), b4(36);
  gguf::quantize_q8_0(x.data(), b8.data(), 64);
  gguf::dequantize_q8_0(b8.data(), y.data(), 64);
  EXPECT_EQ(y, x);
  gguf::quantize_q4_0(x.data(), b4.data(), 64);
  gguf::dequantize_q4_0(b4.data(), y.data(), 64);
  EXPECT_EQ(y, x);
}

// ---------------------------------------------------------------------------------------------
// Round trip: HF directory -> GGUF -> kvslim

class GgufRoundTrip : public ::testing::TestWithParam<std::string> {};

TEST_P(GgufRoundTrip, SameTypeExportReproducesSafetensorsLogitsAndHf) {
  const fs::path dir = source_dir() / "tests/golden/models" / GetParam();
  if (!fs::exists(dir / "golden.json")) GTEST_SKIP() << "no " << (dir / "golden.json");
  const nlohmann::json golden = nlohmann::json::parse(read_text(dir / "golden.json"));
  const Model hf = Model::load(dir);
  const TensorInfo& q = *hf.store().find("model.layers.0.self_attn.q_proj.weight");
  const TensorType native = q.type == WeightType::f32 ? TensorType::f32 : q.type == WeightType::f16 ? TensorType::f16 : TensorType::bf16;
  TempDir tmp;
  const fs::path file = tmp / "model.gguf";
  write_gguf(hf, "", file, {.matrix_type = native});
  const Model back = Model::load(file);

  // Config and every tensor, bit for bit (the q/k permutation undone).
  const ModelConfig &a = hf.config(), &b = back.config();
  EXPECT_EQ(b.architecture, a.architecture);
  EXPECT_EQ(b.hidden_size, a.hidden_size);
  EXPECT_EQ(b.num_layers, a.num_layers);
  EXPECT_EQ(b.num_kv_heads, a.num_kv_heads);
  EXPECT_EQ(b.head_dim, a.head_dim);
  EXPECT_EQ(b.tie_word_embeddings, a.tie_word_embeddings && !hf.store().has("lm_head.weight"));
  EXPECT_FLOAT_EQ(static_cast<float>(b.rms_norm_eps), static_cast<float>(a.rms_norm_eps));
  EXPECT_FLOAT_EQ(static_cast<float>(b.rope_theta), static_cast<float>(a.rope_theta));
  for (const std::string& name : hf.store().names()) {
    const TensorInfo* t = back.store().find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(tensor_as_float(*t), tensor_as_float(*hf.store().find(name))) << name;
  }
  const RopeTable ra(a), rb(b);
  for (std::size_t i = 0; i < ra.inv_freq().size(); ++i) EXPECT_NEAR(rb.inv_freq()[i], ra.inv_freq()[i], 1e-6 * ra.inv_freq()[i]);

  const auto ids = golden["input_ids"].get<std::vector<int>>();
  const std::vector<float> from_hf = all_logits(hf, ids), from_gguf = all_logits(back, ids);
  const double diff = max_abs_diff(from_gguf, from_hf);
  // Same weights, same kernels: identical, except llama3 RoPE, which GGUF stores as per-frequency
  // divisors (fp32 rounding of inv_freq, ~1e-7 relative).
  if (a.rope_scaling.type == "none") {
    EXPECT_EQ(diff, 0.0);
  } else {
    EXPECT_LT(diff, 1e-4);
  }
  std::vector<float> ref;
  for (const auto& row : golden["logits"]) for (float v : row) ref.push_back(v);
  EXPECT_LT(max_abs_diff(from_gguf, ref), 1e-2);  // as golden_model_test: fp16 K/V vs HF fp32
  std::printf("%s: GGUF vs safetensors max |diff| %.3g\n", GetParam().c_str(), diff);
}

TEST_P(GgufRoundTrip, F32ExportMatchesToFloatRounding) {
  const fs::path dir = source_dir() / "tests/golden/models" / GetParam();
  if (!fs::exists(dir / "golden.json")) GTEST_SKIP() << "no " << (dir / "golden.json");
  const nlohmann::json golden = nlohmann::json::parse(read_text(dir / "golden.json"));
  const Model hf = Model::load(dir);
  TempDir tmp;
  write_gguf(hf, "", tmp / "m.gguf", {.matrix_type = TensorType::f32});
  const Model back = Model::load(tmp / "m.gguf");
  const auto ids = golden["input_ids"].get<std::vector<int>>();
  // bf16/f16 widen to f32 exactly; only the summation order of the f32 vs 16-bit kernels differs.
  EXPECT_LT(max_abs_diff(all_logits(back, ids), all_logits(hf, ids)), 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Golden, GgufRoundTrip, ::testing::Values("llama_gqa", "qwen2_tied", "llama_f32"));

class GgufMini : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = source_dir() / "models/mini";
    golden_dir_ = source_dir() / "tests/golden/mini";
    if (!fs::exists(dir_ / "config.json") || !fs::exists(golden_dir_ / "golden.json")) GTEST_SKIP() << "models/mini not present";
  }
  fs::path dir_, golden_dir_;
};

TEST_F(GgufMini, Bf16ExportReproducesSafetensorsAndHfGoldenLogits) {
  const Model hf = Model::load(dir_);
  TempDir tmp;
  write_gguf(hf, read_text(dir_ / "tokenizer.json"), tmp / "mini.gguf", {.matrix_type = TensorType::bf16});
  const Model back = Model::load(tmp / "mini.gguf");
  const nlohmann::json golden = nlohmann::json::parse(read_text(golden_dir_ / "golden.json"));
  const std::size_t vocab = back.config().vocab_size;
  for (const auto& w : golden["windows"]) {
    const auto ids = w["input_ids"].get<std::vector<int>>();
    const std::vector<float> l_gguf = all_logits(back, ids);
    EXPECT_EQ(max_abs_diff(l_gguf, all_logits(hf, ids)), 0.0);
    const auto positions = w["logit_positions"].get<std::vector<std::size_t>>();
    std::vector<float> ref(positions.size() * vocab), got;
    std::ifstream in(golden_dir_ / w["logits_file"].get<std::string>(), std::ios::binary);
    in.read(reinterpret_cast<char*>(ref.data()), static_cast<std::streamsize>(ref.size() * sizeof(float)));
    ASSERT_TRUE(in);
    for (std::size_t p : positions) got.insert(got.end(), l_gguf.begin() + p * vocab, l_gguf.begin() + (p + 1) * vocab);
    EXPECT_LT(max_abs_diff(got, ref), 1e-2);
  }
  // The embedded tokenizer.json gives the same ids as the directory's.
  const Tokenizer t_dir = Tokenizer::load(dir_ / "tokenizer.json");
  const Tokenizer t_gguf = load_model_tokenizer(tmp / "mini.gguf");
  const std::string text = read_text(dir_ / "heldout_sample.txt").substr(0, 20000);
  EXPECT_EQ(t_gguf.encode(text), t_dir.encode(text));
}

TEST_F(GgufMini, TokenizerRebuiltFromGgmlFieldsMatchesHf) {
  const Model hf = Model::load(dir_);
  TempDir tmp;
  write_gguf(hf, read_text(dir_ / "tokenizer.json"), tmp / "mini.gguf", {.embed_hf_tokenizer = false});
  const auto file = gguf::File::open(tmp / "mini.gguf");
  EXPECT_EQ(file->header().find("tokenizer.huggingface.json"), nullptr);
  EXPECT_EQ(file->header().find("tokenizer.ggml.pre")->s, "llama-bpe");
  const Tokenizer t_dir = Tokenizer::load(dir_ / "tokenizer.json");
  const Tokenizer t_gguf = load_model_tokenizer(tmp / "mini.gguf");
  EXPECT_EQ(t_gguf.vocab_size(), t_dir.vocab_size());
  EXPECT_EQ(t_gguf.bos_id(), t_dir.bos_id());
  const std::string text = read_text(dir_ / "heldout_sample.txt").substr(0, 20000) + " <|eos|> x";
  EXPECT_EQ(t_gguf.encode(text), t_dir.encode(text));
  const auto ids = t_dir.encode(text);
  EXPECT_EQ(t_gguf.decode(ids), t_dir.decode(ids));
}

TEST_F(GgufMini, EverySupportedWeightTypeInOneFile) {
  const Model hf = Model::load(dir_);
  // Matrices cycle through the five types; norms go Q8_0 too where they fill whole blocks.
  const TensorType cycle[] = {TensorType::f32, TensorType::f16, TensorType::bf16, TensorType::q8_0, TensorType::q4_0};
  int k = 0;
  GgufExportOptions options;
  options.override_type = [&](const std::string&, TensorType) { return cycle[k++ % 5]; };
  TempDir tmp;
  write_gguf(hf, read_text(dir_ / "tokenizer.json"), tmp / "mixed.gguf", options);
  const auto file = gguf::File::open(tmp / "mixed.gguf");
  std::set<std::uint32_t> types;
  for (const auto& t : file->header().tensors) types.insert(t.type);
  EXPECT_EQ(types, (std::set<std::uint32_t>{0, 1, 2, 8, 30}));

  const Model back = Model::load(tmp / "mixed.gguf");
  // Every tensor is exactly the format's decoding of the HF tensor (block rows commute with the
  // q/k row permutation, so the expectation needs no permutation).
  for (const std::string& name : hf.store().names()) {
    const TensorInfo& src = *hf.store().find(name);
    std::vector<float> x = tensor_as_float(src);
    const TensorInfo* t = back.store().find(name);
    ASSERT_NE(t, nullptr) << name;
    const std::vector<float> got = tensor_as_float(*t);
    ASSERT_EQ(got.size(), x.size()) << name;
    // Find which type it was written as: the one whose round trip reproduces `got`.
    bool matched = false;
    for (TensorType type : cycle) {
      if (x.size() % gguf::block_elements(type) != 0) continue;
      std::vector<std::byte> enc(x.size() / gguf::block_elements(type) * gguf::block_bytes(type));
      std::vector<float> dec(x.size());
      if (type == TensorType::q8_0) gguf::quantize_q8_0(x.data(), enc.data(), x.size());
      else if (type == TensorType::q4_0) gguf::quantize_q4_0(x.data(), enc.data(), x.size());
      else if (type == TensorType::f32) std::memcpy(enc.data(), x.data(), enc.size());
      else {
        for (std::size_t i = 0; i < x.size(); ++i) {
          const std::uint16_t h = type == TensorType::f16 ? f32_to_fp16(x[i]) : f32_to_bf16(x[i]);
          std::memcpy(enc.data() + 2 * i, &h, 2);
        }
      }
      gguf::to_float(enc.data(), type, dec.data(), dec.size());
      if (dec == got) matched = true;
    }
    EXPECT_TRUE(matched) << name << " is not the decoding of any supported type";
  }
  // And the model runs close to the bf16 original (Q4_0 layers cost some accuracy).
  const nlohmann::json golden = nlohmann::json::parse(read_text(golden_dir_ / "golden.json"));
  const auto ids = golden["windows"][0]["input_ids"].get<std::vector<int>>();
  const std::vector<float> a = all_logits(back, ids), b = all_logits(hf, ids);
  const std::size_t vocab = hf.config().vocab_size;
  std::size_t same = 0;
  for (std::size_t s = 0; s < ids.size(); ++s) {
    same += argmax(std::span(a).subspan(s * vocab, vocab)) == argmax(std::span(b).subspan(s * vocab, vocab));
  }
  EXPECT_GE(same, ids.size() * 3 / 4);
  std::printf("mixed-type GGUF: top-1 agreement with bf16 %zu/%zu, max |logit diff| %.3g\n", same, ids.size(), max_abs_diff(a, b));
}

// ---------------------------------------------------------------------------------------------
// Errors

// A minimal llama GGUF (one layer, hidden 32) for the error tests; `edit` changes it first.
gguf::Writer tiny_writer(const std::string& arch = "llama", bool with_tensors = true) {
  gguf::Writer w;
  w.add_string("general.architecture", arch);
  const std::string a = arch + ".";
  w.add_u32(a + "context_length", 64);
  w.add_u32(a + "embedding_length", 32);
  w.add_u32(a + "block_count", 1);
  w.add_u32(a + "feed_forward_length", 64);
  w.add_u32(a + "attention.head_count", 2);
  w.add_f32(a + "attention.layer_norm_rms_epsilon", 1e-5f);
  if (with_tensors) {
    auto f32 = [](std::size_t n) { return std::vector<std::byte>(n * 4); };
    w.add_tensor("token_embd.weight", TensorType::f32, {32, 10}, f32(320));
    w.add_tensor("output_norm.weight", TensorType::f32, {32}, f32(32));
    for (const char* n : {"attn_norm", "ffn_norm"}) w.add_tensor(std::string("blk.0.") + n + ".weight", TensorType::f32, {32}, f32(32));
    for (const char* n : {"attn_q", "attn_k", "attn_v", "attn_output"}) {
      w.add_tensor(std::string("blk.0.") + n + ".weight", TensorType::f32, {32, 32}, f32(1024));
    }
    w.add_tensor("blk.0.ffn_gate.weight", TensorType::f32, {32, 64}, f32(2048));
    w.add_tensor("blk.0.ffn_up.weight", TensorType::f32, {32, 64}, f32(2048));
    w.add_tensor("blk.0.ffn_down.weight", TensorType::f32, {64, 32}, f32(2048));
  }
  return w;
}

TEST(GgufErrors, MinimalFileLoads) {
  TempDir tmp;
  tiny_writer().write(tmp / "m.gguf");
  const Model m = Model::load(tmp / "m.gguf");
  EXPECT_EQ(m.config().hidden_size, 32);
  EXPECT_EQ(m.config().head_dim, 16);
  EXPECT_EQ(m.config().vocab_size, 10);
  EXPECT_TRUE(m.config().tie_word_embeddings);
}

TEST(GgufErrors, AGgufIsRecognisedByContentToo) {
  TempDir tmp;
  tiny_writer().write(tmp / "model.bin");
  EXPECT_TRUE(is_gguf_path(tmp / "model.bin"));
  EXPECT_EQ(Model::load(tmp / "model.bin").config().hidden_size, 32);
  testing::write_file(tmp / "other.bin", "GGUX");
  EXPECT_FALSE(is_gguf_path(tmp / "other.bin"));
  EXPECT_FALSE(is_gguf_path(tmp.path()));
}

TEST(GgufErrors, UnsupportedArchitectureIsNamed) {
  TempDir tmp;
  tiny_writer("gemma").write(tmp / "m.gguf");
  expect_error([&] { Model::load(tmp / "m.gguf"); }, {"m.gguf", "general.architecture", "'gemma'", "supported: llama, qwen2"});
}

TEST(GgufErrors, EveryUnsupportedTensorTypeIsNamed) {
  TempDir tmp;
  gguf::Writer w = tiny_writer("llama", false);
  // Q3_K (11) and Q2_K (10) blocks: 110 and 84 bytes per 256 values (the K-quants kvslim reads,
  // Q4_K / Q5_K / Q6_K, are tested in quant_gemv_test.cc).
  w.add_tensor("token_embd.weight", static_cast<TensorType>(10), {256, 1}, std::vector<std::byte>(84));
  w.add_tensor("blk.0.attn_q.weight", static_cast<TensorType>(11), {256, 1}, std::vector<std::byte>(110));
  w.add_tensor("blk.0.attn_k.weight", static_cast<TensorType>(11), {256, 1}, std::vector<std::byte>(110));
  w.add_tensor("blk.0.attn_v.weight", TensorType::q8_0, {256, 1}, std::vector<std::byte>(272));
  w.write(tmp / "m.gguf");
  expect_error([&] { Model::load(tmp / "m.gguf"); },
               {"unsupported tensor types", "Q3_K (blk.0.attn_q.weight and 1 more)", "Q2_K (token_embd.weight)",
                "F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K"});
}

TEST(GgufErrors, KQuantRowsAndSizesAreChecked) {
  // A Q4_K row must be whole 256-value super-blocks.
  {
    gguf::Writer w;
    w.add_string("general.architecture", "llama");
    w.add_tensor("a", TensorType::q4_k, {128, 2}, std::vector<std::byte>(144));
    expect_error([&] { gguf::parse(w.bytes(), "x.gguf"); }, {"tensor 'a'", "Q4_K", "multiple of 256", "128"});
  }
  // A Q6_K tensor whose blocks run past the end of the file (2 super-blocks claimed, 1 stored).
  {
    gguf::Writer w;
    w.add_string("general.architecture", "llama");
    w.add_tensor("b", TensorType::q6_k, {256, 2}, std::vector<std::byte>(210));
    std::vector<std::byte> bytes = w.bytes();
    expect_error([&] { gguf::parse(bytes, "x.gguf"); }, {"tensor 'b'", "420 bytes"});
  }
  // Sizes follow the block counts: 3 rows of 512 Q5_K values = 6 super-blocks of 176 bytes.
  {
    gguf::Writer w;
    w.add_string("general.architecture", "llama");
    w.add_tensor("c", TensorType::q5_k, {512, 3}, std::vector<std::byte>(6 * 176));
    const std::vector<std::byte> bytes = w.bytes();
    const gguf::Header h = gguf::parse(bytes, "x.gguf");
    EXPECT_EQ(h.tensors.at(0).nbytes, 6u * 176u);
  }
}

TEST(GgufErrors, MissingKeyAndUnexpectedTensorAreNamed) {
  TempDir tmp;
  {
    gguf::Writer w;
    w.add_string("general.architecture", "llama");
    w.write(tmp / "a.gguf");
  }
  expect_error([&] { Model::load(tmp / "a.gguf"); }, {"a.gguf", "llama.embedding_length", "missing"});
  gguf::Writer w = tiny_writer();
  w.add_tensor("blk.0.attn_sinks.weight", TensorType::f32, {2}, std::vector<std::byte>(8));
  w.write(tmp / "b.gguf");
  expect_error([&] { Model::load(tmp / "b.gguf"); }, {"b.gguf", "blk.0.attn_sinks.weight", "not part of a llama model"});
  gguf::Writer w2 = tiny_writer();
  w2.add_string("llama.rope.scaling.type", "yarn");
  w2.write(tmp / "c.gguf");
  expect_error([&] { Model::load(tmp / "c.gguf"); }, {"llama.rope.scaling.type", "'yarn'", "not supported"});
}

TEST(GgufErrors, MalformedHeadersAreRejectedByName) {
  const std::vector<std::byte> good = tiny_writer().bytes();
  auto parse = [](std::vector<std::byte> b) { gguf::parse(b, "x.gguf"); };
  EXPECT_NO_THROW(parse(good));
  auto patched = [&](std::size_t at, std::uint64_t v, std::size_t width) {
    std::vector<std::byte> b = good;
    std::memcpy(b.data() + at, &v, width);
    return b;
  };
  expect_error([&] { parse(patched(0, 0x46554746, 4)); }, {"x.gguf", "not a GGUF file"});
  expect_error([&] { parse(patched(4, 4, 4)); }, {"unsupported GGUF version 4"});
  expect_error([&] { parse(patched(8, 1ull << 60, 8)); }, {"tensor count", "does not fit"});
  expect_error([&] { parse(patched(16, 1ull << 60, 8)); }, {"metadata count", "does not fit"});
  expect_error([&] { parse(std::vector<std::byte>(good.begin(), good.begin() + 40)); }, {"x.gguf"});
  expect_error([&] { parse(std::vector<std::byte>(good.begin(), good.end() - 64)); }, {"runs past the end of the file"});
  // The first key's length (at byte 24) made huge.
  expect_error([&] { parse(patched(24, 1ull << 40, 8)); }, {"metadata key 0", "runs past the end"});
}

TEST(GgufErrors, AlignmentOffsetsAndOverlapAreChecked) {
  gguf::Writer w = tiny_writer("llama", false);
  w.add_u32("general.alignment", 24);
  expect_error([&] { gguf::parse(w.bytes(), "x.gguf"); }, {"general.alignment", "power of two"});
  // Two tensors at the same offset: hand-edit the second tensor's offset to 0.
  gguf::Writer v = tiny_writer("llama", false);
  v.add_tensor("a", TensorType::f32, {8}, std::vector<std::byte>(32));
  v.add_tensor("b", TensorType::f32, {8}, std::vector<std::byte>(32));
  std::vector<std::byte> b = v.bytes();
  // The last 8 bytes before the data padding of the tensor table are b's offset (32); find it.
  const std::string needle = std::string("\x01\x00\x00\x00\x00\x00\x00\x00", 8) + "b";
  std::string s(reinterpret_cast<const char*>(b.data()), b.size());
  const std::size_t at = s.find(needle) + needle.size() + 4 + 8 + 4;  // n_dims, ne[0], type
  std::uint64_t off = 0;
  std::memcpy(&off, b.data() + at, 8);
  ASSERT_EQ(off, 32u);
  std::uint64_t zero = 0, odd = 8;
  std::memcpy(b.data() + at, &zero, 8);
  expect_error([&] { gguf::parse(b, "x.gguf"); }, {"tensor 'b' overlaps tensor 'a'"});
  std::memcpy(b.data() + at, &odd, 8);
  expect_error([&] { gguf::parse(b, "x.gguf"); }, {"tensor 'b'", "offset 8 is not a multiple of the alignment 32"});
}

TEST(GgufErrors, UnsupportedTokenizersAreNamed) {
  TempDir tmp;
  gguf::Writer w = tiny_writer();
  w.add_string("tokenizer.ggml.model", "llama");
  w.write(tmp / "a.gguf");
  expect_error([&] { load_model_tokenizer(tmp / "a.gguf"); }, {"tokenizer.ggml.model", "'llama'", "gpt2"});
  gguf::Writer v = tiny_writer();
  v.add_string("tokenizer.ggml.model", "gpt2");
  v.add_string("tokenizer.ggml.pre", "deepseek-coder");
  v.add_strings("tokenizer.ggml.tokens", {"a", "b"});
  v.add_strings("tokenizer.ggml.merges", {});
  v.write(tmp / "b.gguf");
  expect_error([&] { load_model_tokenizer(tmp / "b.gguf"); }, {"tokenizer.ggml.pre", "'deepseek-coder'", "llama-bpe"});
}

}  // namespace
}  // namespace kvslim::engine
