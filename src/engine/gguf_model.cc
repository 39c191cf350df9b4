#include "engine/gguf_model.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <new>
#include <stdexcept>
#include <set>

#include <sys/mman.h>

#include <nlohmann/json.hpp>

#include "engine/json_util.h"
#include "engine/model.h"
#include "engine/ops.h"
#include "engine/quant_gemv.h"
#include "engine/tokenizer.h"
#include "engine/utf8.h"
#include "kvslim/dtype.h"

namespace kvslim::engine {
namespace {

using gguf::TensorType;
using nlohmann::json;

// The pre-tokenizer regexes of the byte-level BPE tokenizers llama.cpp names in tokenizer.ggml.pre.
constexpr std::string_view kLlama3Regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr std::string_view kQwen2Regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

// llama.cpp token types (tokenizer.ggml.token_type).
enum TokenType : int { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

// ---------------------------------------------------------------------------------------------
// Metadata access with errors naming the file and key.

struct Meta {
  const gguf::Header& h;
  const std::string& file;

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw ModelFileError(file + ": metadata '" + key + "': " + what);
  }
  const gguf::Value* find(const std::string& key) const { return h.find(key); }
  std::int64_t integer(const std::string& key) const {
    const gguf::Value* v = find(key);
    if (v == nullptr) fail(key, "required key is missing");
    if (v->type == gguf::ValueType::array) fail(key, "per-layer arrays are not supported (expected one integer)");
    if (!v->is_integer()) fail(key, std::string("expected an integer, found ") + gguf::value_type_name(v->type));
    return v->i;
  }
  int positive_int(const std::string& key) const {
    const std::int64_t v = integer(key);
    if (v <= 0 || v > INT_MAX) fail(key, "must be a positive integer, found " + std::to_string(v));
    return static_cast<int>(v);
  }
  std::optional<int> optional_positive_int(const std::string& key) const {
    if (find(key) == nullptr) return std::nullopt;
    return positive_int(key);
  }
  double number(const std::string& key) const {
    const gguf::Value* v = find(key);
    if (v == nullptr) fail(key, "required key is missing");
    if (v->is_float()) return v->f;
    if (v->is_integer()) return static_cast<double>(v->i);
    fail(key, std::string("expected a number, found ") + gguf::value_type_name(v->type));
  }
  double positive_number(const std::string& key) const {
    const double v = number(key);
    if (!(v > 0) || !std::isfinite(v)) fail(key, "must be a positive number, found " + std::to_string(v));
    return v;
  }
  std::string string(const std::string& key) const {
    const gguf::Value* v = find(key);
    if (v == nullptr) fail(key, "required key is missing");
    if (v->type != gguf::ValueType::string) fail(key, std::string("expected a string, found ") + gguf::value_type_name(v->type));
    return v->s;
  }
  std::optional<std::string> optional_string(const std::string& key) const {
    if (find(key) == nullptr) return std::nullopt;
    return string(key);
  }
  std::optional<bool> optional_bool(const std::string& key) const {
    const gguf::Value* v = find(key);
    if (v == nullptr) return std::nullopt;
    if (v->type != gguf::ValueType::boolean) fail(key, std::string("expected a bool, found ") + gguf::value_type_name(v->type));
    return v->b;
  }
  std::optional<int> optional_token_id(const std::string& key) const {
    if (find(key) == nullptr) return std::nullopt;
    const std::int64_t v = integer(key);
    if (v < 0 || v > INT_MAX) fail(key, "token id out of range: " + std::to_string(v));
    return static_cast<int>(v);
  }
  const gguf::Value& array(const std::string& key, gguf::ValueType element) const {
    const gguf::Value* v = find(key);
    if (v == nullptr) fail(key, "required key is missing");
    const bool ints_ok = element == gguf::ValueType::i32 && v->type == gguf::ValueType::array &&
                         v->element_type != gguf::ValueType::string && v->element_type != gguf::ValueType::array &&
                         v->element_type != gguf::ValueType::f32 && v->element_type != gguf::ValueType::f64;
    if (v->type != gguf::ValueType::array || (v->element_type != element && !ints_ok)) {
      fail(key, std::string("expected an array of ") + gguf::value_type_name(element));
    }
    return *v;
  }
};

// ---------------------------------------------------------------------------------------------
// Tensors

// GGUF name -> HF name for one layer's tensors ("attn_q.weight" -> "self_attn.q_proj.weight").
const std::map<std::string, std::string>& layer_tensor_names() {
  static const std::map<std::string, std::string> names = {
      {"attn_norm.weight", "input_layernorm.weight"},  {"ffn_norm.weight", "post_attention_layernorm.weight"},
      {"attn_q.weight", "self_attn.q_proj.weight"},    {"attn_k.weight", "self_attn.k_proj.weight"},
      {"attn_v.weight", "self_attn.v_proj.weight"},    {"attn_output.weight", "self_attn.o_proj.weight"},
      {"attn_q.bias", "self_attn.q_proj.bias"},        {"attn_k.bias", "self_attn.k_proj.bias"},
      {"attn_v.bias", "self_attn.v_proj.bias"},        {"ffn_gate.weight", "mlp.gate_proj.weight"},
      {"ffn_up.weight", "mlp.up_proj.weight"},         {"ffn_down.weight", "mlp.down_proj.weight"},
  };
  return names;
}
const std::map<std::string, std::string>& global_tensor_names() {
  static const std::map<std::string, std::string> names = {
      {"token_embd.weight", "model.embed_tokens.weight"},
      {"output_norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"},
  };
  return names;
}

// "blk.N.rest" -> HF name, or "" when the name is not a tensor of these architectures.
std::string hf_name(const std::string& gguf_name, int num_layers) {
  if (auto it = global_tensor_names().find(gguf_name); it != global_tensor_names().end()) return it->second;
  if (gguf_name.rfind("blk.", 0) != 0) return "";
  const std::size_t dot = gguf_name.find('.', 4);
  if (dot == std::string::npos) return "";
  const std::string layer = gguf_name.substr(4, dot - 4);
  if (layer.empty() || layer.size() > 6 || !std::all_of(layer.begin(), layer.end(), ::isdigit)) return "";
  if (std::stoi(layer) >= num_layers) return "";
  auto it = layer_tensor_names().find(gguf_name.substr(dot + 1));
  if (it == layer_tensor_names().end()) return "";
  return "model.layers." + layer + "." + it->second;
}

// Row r of a llama-arch GGUF q/k tensor holds HF row inverse_permuted_row(r): within each head
// of d rows, llama.cpp's converter interleaves the two rotary halves (HF row t*d/2 + i goes to
// GGUF row 2i + t), because ggml's llama rope rotates adjacent pairs.
std::size_t hf_row_of_gguf_row(std::size_t r, std::size_t head_dim) {
  const std::size_t head = r / head_dim, within = r % head_dim;
  return head * head_dim + (within % 2) * (head_dim / 2) + within / 2;
}

// KVSLIM_GGUF_DEQUANTIZE=1: block-quantized weights are expanded to fp32 at load, as kvslim did
// before it had quantized kernels (4-7x the memory; for A/B benchmarks of those kernels).
bool dequantize_at_load() {
  const char* v = std::getenv("KVSLIM_GGUF_DEQUANTIZE");
  return v != nullptr && std::string(v) == "1";
}

// KVSLIM_GGUF_REPACK=0: Q4_0 / Q4_K / Q6_K matrices stay in the file's layout instead of being
// repacked into Q4_0x16 / Q4_Kx16 / Q6_Kx16 at load (for A/B benchmarks of the repacked kernels).
bool repack_at_load() {
  const char* v = std::getenv("KVSLIM_GGUF_REPACK");
  return v == nullptr || std::string(v) != "0";
}

// Memory the store's tensor views point into: the mapped file and converted copies.
struct Owner {
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  std::shared_ptr<const void> keep_alive;  // the mapped file
  std::vector<std::unique_ptr<std::byte[]>> buffers;
  std::vector<std::unique_ptr<void, Free>> aligned;
  std::byte* allocate(std::size_t n) {
    buffers.push_back(std::make_unique<std::byte[]>(std::max<std::size_t>(n, 1)));
    return buffers.back().get();
  }
  // One arena for the repacked matrices (reserve() once with their total, then slices of
  // it): 64-byte aligned slices (the kernels' vectors), left uninitialised (the caller writes
  // all). From 2 MiB on, the arena sits on a 2 MiB boundary and is marked for transparent huge
  // pages before the first write (decode streams every byte once per token: fewer TLB misses);
  // one arena rather than one buffer per matrix, so at most one huge page is partly unused.
  // KVSLIM_GGUF_HUGEPAGES=0: 4 KiB pages.
  std::byte* arena = nullptr;
  std::size_t arena_size = 0, arena_used = 0;
  static std::size_t slice(std::size_t n) { return (n + 63) / 64 * 64; }
  void reserve(std::size_t n) {
    if (n == 0) return;
    constexpr std::size_t kHuge = std::size_t{2} << 20;
    const char* env = std::getenv("KVSLIM_GGUF_HUGEPAGES");
    const bool huge = n >= kHuge && !(env != nullptr && std::string(env) == "0");
    const std::size_t align = huge ? kHuge : 64;
    arena_size = (n + align - 1) / align * align;
    void* p = std::aligned_alloc(align, arena_size);
    if (p == nullptr) throw std::bad_alloc();
    aligned.emplace_back(p);
#ifdef MADV_HUGEPAGE
    if (huge) ::madvise(p, arena_size, MADV_HUGEPAGE);  // advice only: without it the pages are 4 KiB
#endif
    arena = static_cast<std::byte*>(p);
  }
  std::byte* allocate_aligned(std::size_t n) {
    if (arena == nullptr || arena_used + slice(n) > arena_size) throw std::logic_error("gguf loader: repack arena too small");
    std::byte* p = arena + arena_used;
    arena_used += slice(n);
    return p;
  }
};

std::string regex_of_pre(const std::string& pre, bool& ignore_merges, bool& nfc, bool& gpt2_bytelevel_regex,
                         const std::string& file) {
  ignore_merges = false;
  nfc = false;
  gpt2_bytelevel_regex = false;
  if (pre == "llama-bpe" || pre == "llama3" || pre == "smaug-bpe") {
    ignore_merges = true;  // llama.cpp's LLAMA3 pre-tokenizer sets ignore_merges, as Llama-3's tokenizer.json
    return std::string(kLlama3Regex);
  }
  if (pre == "qwen2") {
    nfc = true;  // Qwen2's tokenizer.json normalizes to NFC
    return std::string(kQwen2Regex);
  }
  if (pre == "gpt-2" || pre == "gpt2" || pre == "default") {
    gpt2_bytelevel_regex = true;
    return "";
  }
  throw ModelFileError(file + ": metadata 'tokenizer.ggml.pre': pre-tokenizer '" + pre +
                       "' is not supported (supported: llama-bpe, qwen2, gpt-2, default)");
}

}  // namespace

bool is_gguf_path(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  if (path.extension() == ".gguf") return true;
  char magic[4] = {};
  std::ifstream in(path, std::ios::binary);
  return in.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;  // a GGUF by content
}

GgufModel read_gguf_model(const std::filesystem::path& path) { return read_gguf_model(gguf::File::open(path)); }

GgufModel read_gguf_model(std::shared_ptr<const gguf::File> file) {
  const gguf::Header& h = file->header();
  const std::string name = file->name();
  const gguf::File* mapped = file.get();
  return read_gguf_model(h, name, std::move(file), mapped);
}

GgufModel read_gguf_model(const gguf::Header& h, const std::string& fname, std::shared_ptr<const void> keep_alive,
                          const gguf::File* mapped) {
  const Meta meta{h, fname};

  // Every tensor type kvslim cannot read, each with its tensors, in one message.
  std::map<std::string, std::vector<std::string>> unsupported;
  for (const gguf::TensorEntry& t : h.tensors) {
    if (!gguf::tensor_type_supported(t.type)) unsupported[gguf::tensor_type_name(t.type)].push_back(t.name);
  }
  if (!unsupported.empty()) {
    std::string list;
    for (const auto& [type, names] : unsupported) {
      list += (list.empty() ? "" : "; ") + type + " (" + names.front();
      if (names.size() > 1) list += " and " + std::to_string(names.size() - 1) + " more";
      list += ")";
    }
    throw ModelFileError(fname + ": unsupported tensor types: " + list +
                         " (kvslim reads F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K)");
  }

  ModelConfig c;
  const std::string arch = meta.string("general.architecture");
  if (arch != "llama" && arch != "qwen2") {
    meta.fail("general.architecture", "architecture '" + arch + "' is not supported (supported: llama, qwen2)");
  }
  c.architecture = arch;
  const std::string a = arch + ".";
  c.hidden_size = meta.positive_int(a + "embedding_length");
  c.intermediate_size = meta.positive_int(a + "feed_forward_length");
  c.num_layers = meta.positive_int(a + "block_count");
  c.num_heads = meta.positive_int(a + "attention.head_count");
  c.num_kv_heads = meta.optional_positive_int(a + "attention.head_count_kv").value_or(c.num_heads);
  if (c.num_heads % c.num_kv_heads != 0) {
    meta.fail(a + "attention.head_count_kv", std::to_string(c.num_kv_heads) + " does not divide head_count " +
                                                 std::to_string(c.num_heads));
  }
  if (auto kl = meta.optional_positive_int(a + "attention.key_length")) {
    c.head_dim = *kl;
  } else {
    if (c.hidden_size % c.num_heads != 0) {
      meta.fail(a + "embedding_length", "not divisible by head_count (and attention.key_length is not given)");
    }
    c.head_dim = c.hidden_size / c.num_heads;
  }
  if (auto vl = meta.optional_positive_int(a + "attention.value_length"); vl && *vl != c.head_dim) {
    meta.fail(a + "attention.value_length", std::to_string(*vl) + " differs from key_length " + std::to_string(c.head_dim) +
                                                " (not supported)");
  }
  if (auto rd = meta.optional_positive_int(a + "rope.dimension_count"); rd && *rd != c.head_dim) {
    meta.fail(a + "rope.dimension_count", "partial rotary embedding (" + std::to_string(*rd) + " of " +
                                              std::to_string(c.head_dim) + " dims) is not supported");
  }
  if (c.head_dim % 2 != 0) meta.fail(a + "attention.key_length", "head size must be even for RoPE");
  c.max_position_embeddings = meta.positive_int(a + "context_length");
  c.rms_norm_eps = meta.positive_number(a + "attention.layer_norm_rms_epsilon");
  c.rope_theta = meta.find(a + "rope.freq_base") ? meta.positive_number(a + "rope.freq_base") : 10000.0;
  if (auto type = meta.optional_string(a + "rope.scaling.type"); type && *type != "none") {
    if (*type != "linear") {
      meta.fail(a + "rope.scaling.type", "RoPE scaling '" + *type + "' is not supported (supported: none, linear)");
    }
    c.rope_scaling.type = "linear";
    c.rope_scaling.factor = meta.positive_number(a + "rope.scaling.factor");
  }

  const gguf::TensorEntry* embd = h.tensor("token_embd.weight");
  if (embd == nullptr) throw ModelFileError(fname + ": tensor 'token_embd.weight' not found");
  if (embd->ne.size() != 2) throw ModelFileError(fname + ": tensor 'token_embd.weight' must be 2-D");
  c.vocab_size = meta.optional_positive_int(a + "vocab_size").value_or(static_cast<int>(std::min<std::int64_t>(embd->ne[1], INT_MAX)));
  c.tie_word_embeddings = h.tensor("output.weight") == nullptr;
  c.attention_bias = h.tensor("blk.0.attn_q.bias") != nullptr;
  c.bos_token_id = meta.optional_token_id("tokenizer.ggml.bos_token_id");
  for (const char* key : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"}) {
    if (auto id = meta.optional_token_id(key); id && std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), *id) == c.eos_token_ids.end()) {
      c.eos_token_ids.push_back(*id);
    }
  }
  if (const gguf::TensorEntry* q = h.tensor("blk.0.attn_q.weight")) c.dtype = gguf::tensor_type_name(q->type);

  // Tensors under HF names; q/k of llama-arch files back in HF row order; quantized -> fp32.
  auto owner = std::make_shared<Owner>();
  owner->keep_alive = std::move(keep_alive);
  std::vector<TensorInfo> tensors;
  // Q4_0 / Q4_K / Q6_K matrices are repacked into Q4_0x16 / Q4_Kx16 / Q6_Kx16 (quant_gemv.h: 16
  // rows side by side, what decode's kernel reads in one pass; Q4_0's bytes rearranged, Q6_K's
  // codes regrouped in as many bytes, Q4_K's with the 6-bit scales unpacked, 148 bytes a row-block
  // against 144). The embedding keeps
  // the file's layout: its rows are read one token at a time.
  auto weight_type_of = [](TensorType type) {
    switch (type) {
      case TensorType::q4_0: return WeightType::q4_0;
      case TensorType::q4_k: return WeightType::q4_k;
      case TensorType::q6_k: return WeightType::q6_k;
      default: return WeightType::f32;  // no interleaved form
    }
  };
  auto repacked = [&](const gguf::TensorEntry& t) {
    const WeightType w = weight_type_of(static_cast<TensorType>(t.type));
    return qgemv::interleaved_type(w) != w && t.ne.size() == 2 && t.ne[1] % 16 == 0 && t.name != "token_embd.weight" &&
           !dequantize_at_load() && repack_at_load();
  };
  auto repacked_bytes = [&](const gguf::TensorEntry& t) {
    const WeightType to = qgemv::interleaved_type(weight_type_of(static_cast<TensorType>(t.type)));
    return weight_bytes(to, static_cast<std::size_t>(t.ne[0])) * static_cast<std::size_t>(t.ne[1]);
  };
  std::size_t repack_bytes = 0;
  for (const gguf::TensorEntry& t : h.tensors) {
    if (repacked(t)) repack_bytes += Owner::slice(repacked_bytes(t));
  }
  owner->reserve(repack_bytes);
  const std::size_t d = static_cast<std::size_t>(c.head_dim);
  for (const gguf::TensorEntry& t : h.tensors) {
    if (t.name == "rope_freqs.weight") {
      if (t.ne.size() != 1 || t.ne[0] != c.head_dim / 2) {
        throw ModelFileError(fname + ": tensor 'rope_freqs.weight' must have " + std::to_string(c.head_dim / 2) + " elements");
      }
      c.rope_scaling.type = "freq_factors";
      c.rope_scaling.freq_factors.resize(static_cast<std::size_t>(t.ne[0]));
      gguf::to_float(t.data, static_cast<TensorType>(t.type), c.rope_scaling.freq_factors.data(), c.rope_scaling.freq_factors.size());
      continue;
    }
    const std::string name = hf_name(t.name, c.num_layers);
    if (name.empty()) {
      throw ModelFileError(fname + ": tensor '" + t.name + "' is not part of a " + arch + " model (unexpected tensor)");
    }
    TensorInfo info;
    info.name = name;
    info.file = fname + " (tensor '" + t.name + "')";
    info.shape = t.shape();
    const auto type = static_cast<TensorType>(t.type);
    const std::size_t n = static_cast<std::size_t>(t.elements());
    const std::byte* data = t.data;
    std::size_t nbytes = t.nbytes;
    switch (type) {
      case TensorType::f32: info.type = WeightType::f32; break;
      case TensorType::f16: info.type = WeightType::f16; break;
      case TensorType::bf16: info.type = WeightType::bf16; break;
      // Block formats stay as stored: the engine's kernels read them (engine/quant_gemv.h).
      case TensorType::q8_0: info.type = WeightType::q8_0; break;
      case TensorType::q4_0: info.type = WeightType::q4_0; break;
      case TensorType::q4_k: info.type = WeightType::q4_k; break;
      case TensorType::q5_k: info.type = WeightType::q5_k; break;
      case TensorType::q6_k: info.type = WeightType::q6_k; break;
    }
    if (is_block_type(info.type) && dequantize_at_load()) {
      // The previous behaviour, for A/B benchmarks: fp32 copies (ggml's own decoding).
      std::byte* out = owner->allocate(n * 4);
      convert_weights(data, info.type, reinterpret_cast<float*>(out), n);
      data = out;
      nbytes = n * 4;
      info.type = WeightType::f32;
    }
    const bool qk = t.name.ends_with(".attn_q.weight") || t.name.ends_with(".attn_k.weight") ||
                    t.name.ends_with(".attn_q.bias") || t.name.ends_with(".attn_k.bias");
    const bool permute = arch == "llama" && qk;
    const std::size_t rows = static_cast<std::size_t>(t.ne.size() == 1 ? t.ne[0] : t.ne[1]);
    if (permute && rows % d != 0) {
      throw ModelFileError(fname + ": tensor '" + t.name + "' has " + std::to_string(rows) +
                           " rows, not a multiple of the head size " + std::to_string(d));
    }
    // A repacked matrix takes the q/k rows in HF order on the way; the mapped originals' pages
    // are handed back, so the weights stay resident once.
    if (repacked(t)) {
      const std::size_t row_bytes = nbytes / rows;
      std::vector<const std::uint8_t*> src(rows);
      for (std::size_t r = 0; r < rows; ++r) {
        src[permute ? hf_row_of_gguf_row(r, d) : r] = reinterpret_cast<const std::uint8_t*>(data) + r * row_bytes;
      }
      const std::size_t out_bytes = repacked_bytes(t);
      std::byte* out = owner->allocate_aligned(out_bytes);
      qgemv::interleave(info.type, src.data(), rows, static_cast<std::size_t>(t.ne[0]), reinterpret_cast<std::uint8_t*>(out));
      if (mapped != nullptr) mapped->release_pages(data, nbytes);
      data = out;
      nbytes = out_bytes;
      info.type = qgemv::interleaved_type(info.type);
    } else if (permute) {
      // Rows are whole blocks in every type, so the permutation moves bytes, not values.
      const std::size_t row_bytes = nbytes / rows;
      std::byte* out = owner->allocate(nbytes);
      for (std::size_t r = 0; r < rows; ++r) std::memcpy(out + hf_row_of_gguf_row(r, d) * row_bytes, data + r * row_bytes, row_bytes);
      if (mapped != nullptr) mapped->release_pages(data, nbytes);  // the copy is what is read now
      data = out;
    } else if (!is_block_type(info.type) && data == t.data &&
               reinterpret_cast<std::uintptr_t>(data) % weight_type_size(info.type) != 0) {
      std::byte* out = owner->allocate(nbytes);  // alignment 1..2 files: keep the aligned-view promise
      std::memcpy(out, data, nbytes);
      data = out;
    }
    info.data = data;
    info.nbytes = nbytes;
    tensors.push_back(std::move(info));
  }
  return GgufModel{std::move(c), WeightStore::from_tensors(std::move(tensors), owner)};
}

// ---------------------------------------------------------------------------------------------
// Tokenizer

std::string gguf_tokenizer_json(const gguf::Header& h, const std::string& fname) {
  const Meta meta{h, fname};
  if (auto embedded = meta.optional_string("tokenizer.huggingface.json")) return *embedded;
  const std::string model = meta.string("tokenizer.ggml.model");
  if (model != "gpt2") {
    meta.fail("tokenizer.ggml.model", "tokenizer model '" + model +
                                          "' is not supported (kvslim reads gpt2-style byte-level BPE: 'gpt2')");
  }
  const gguf::Value& tokens = meta.array("tokenizer.ggml.tokens", gguf::ValueType::string);
  const gguf::Value& merges = meta.array("tokenizer.ggml.merges", gguf::ValueType::string);
  // Token and merge strings become JSON text: invalid UTF-8 is refused here, naming the entry.
  for (const auto* key : {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"}) {
    const gguf::Value& list = std::string_view(key) == "tokenizer.ggml.tokens" ? tokens : merges;
    for (std::size_t i = 0; i < list.strings.size(); ++i) {
      if (utf8::find_invalid(list.strings[i]) != std::string_view::npos) {
        meta.fail(key, "entry " + std::to_string(i) + " is not valid UTF-8");
      }
    }
  }
  std::vector<std::int64_t> types(tokens.strings.size(), kNormal);
  if (meta.find("tokenizer.ggml.token_type")) {
    const gguf::Value& tt = meta.array("tokenizer.ggml.token_type", gguf::ValueType::i32);
    if (tt.ints.size() != types.size()) {
      meta.fail("tokenizer.ggml.token_type", std::to_string(tt.ints.size()) + " types for " +
                                                 std::to_string(types.size()) + " tokens");
    }
    types = tt.ints;
  }
  bool ignore_merges = false, nfc = false, gpt2_regex = false;
  const std::string pre = meta.optional_string("tokenizer.ggml.pre").value_or("default");
  const std::string regex = regex_of_pre(pre, ignore_merges, nfc, gpt2_regex, fname);

  json vocab = json::object();
  json added = json::array();
  for (std::size_t id = 0; id < tokens.strings.size(); ++id) {
    const std::string& tok = tokens.strings[id];
    if (tok.empty()) continue;  // unusable as a token; a hole
    if (types[id] == kControl || types[id] == kUserDefined) {
      added.push_back({{"id", id}, {"content", tok}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                       {"normalized", types[id] == kUserDefined}, {"special", types[id] == kControl}});
    } else if (!vocab.contains(tok)) {
      vocab[tok] = id;  // a repeated string keeps its first id
    }
  }
  json pre_tokenizer;
  if (gpt2_regex) {
    pre_tokenizer = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  } else {
    pre_tokenizer = {{"type", "Sequence"},
                     {"pretokenizers",
                      json::array({{{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}},
                                   {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}})}};
  }
  json doc = {{"version", "1.0"},
              {"added_tokens", added},
              {"normalizer", nfc ? json{{"type", "NFC"}} : json(nullptr)},
              {"pre_tokenizer", pre_tokenizer},
              {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
              {"model", {{"type", "BPE"}, {"ignore_merges", ignore_merges}, {"vocab", vocab}, {"merges", merges.strings}}}};
  // BOS: tokenizer.ggml.add_bos_token, defaulting as llama.cpp does (on for llama-bpe).
  const bool add_bos = meta.optional_bool("tokenizer.ggml.add_bos_token").value_or(ignore_merges);
  if (auto bos = meta.optional_token_id("tokenizer.ggml.bos_token_id"); add_bos && bos) {
    if (static_cast<std::size_t>(*bos) >= tokens.strings.size()) {
      meta.fail("tokenizer.ggml.bos_token_id", std::to_string(*bos) + " is not a token id");
    }
    const std::string& name = tokens.strings[*bos];
    doc["post_processor"] = {{"type", "TemplateProcessing"},
                             {"single", json::array({{{"SpecialToken", {{"id", name}, {"type_id", 0}}}},
                                                     {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
                             {"special_tokens", {{name, {{"id", name}, {"ids", {*bos}}, {"tokens", {name}}}}}}};
  }
  return doc.dump();
}

Tokenizer load_model_tokenizer(const std::filesystem::path& model) {
  if (is_gguf_path(model)) {
    const auto file = gguf::File::open(model);
    return Tokenizer::from_json_text(gguf_tokenizer_json(file->header(), file->name()), file->name() + " (tokenizer)");
  }
  return Tokenizer::load(model / "tokenizer.json");
}

// ---------------------------------------------------------------------------------------------
// Export

gguf::TensorType parse_tensor_type(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), ::tolower);
  if (n == "f32") return TensorType::f32;
  if (n == "f16") return TensorType::f16;
  if (n == "bf16") return TensorType::bf16;
  if (n == "q8_0") return TensorType::q8_0;
  if (n == "q4_0") return TensorType::q4_0;
  if (n == "q4_k") return TensorType::q4_k;
  if (n == "q5_k") return TensorType::q5_k;
  if (n == "q6_k") return TensorType::q6_k;
  throw std::invalid_argument("unknown weight type '" + name + "' (supported: f32, f16, bf16, q8_0, q4_0, q4_k, q5_k, q6_k)");
}

namespace {

// fp32 values in `type`'s encoding.
std::vector<std::byte> encode(const std::vector<float>& x, TensorType type) {
  const std::size_t n = x.size();
  std::vector<std::byte> out(n / gguf::block_elements(type) * gguf::block_bytes(type));
  switch (type) {
    case TensorType::f32: std::memcpy(out.data(), x.data(), n * 4); break;
    case TensorType::f16:
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint16_t h = f32_to_fp16(x[i]);
        std::memcpy(out.data() + 2 * i, &h, 2);
      }
      break;
    case TensorType::bf16:
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint16_t h = f32_to_bf16(x[i]);
        std::memcpy(out.data() + 2 * i, &h, 2);
      }
      break;
    case TensorType::q8_0: gguf::quantize_q8_0(x.data(), out.data(), n); break;
    case TensorType::q4_0: gguf::quantize_q4_0(x.data(), out.data(), n); break;
    case TensorType::q4_k: gguf::quantize_q4_k(x.data(), out.data(), n); break;
    case TensorType::q5_k: gguf::quantize_q5_k(x.data(), out.data(), n); break;
    case TensorType::q6_k: gguf::quantize_q6_k(x.data(), out.data(), n); break;
  }
  return out;
}

// llama.cpp's file_type (llama_ftype) for the matrix type.
std::uint32_t file_type_of(TensorType t) {
  switch (t) {
    case TensorType::f32: return 0;
    case TensorType::f16: return 1;
    case TensorType::q4_0: return 2;
    case TensorType::q8_0: return 7;
    case TensorType::q4_k: return 15;  // LLAMA_FTYPE_MOSTLY_Q4_K_M
    case TensorType::q5_k: return 17;  // LLAMA_FTYPE_MOSTLY_Q5_K_M
    case TensorType::q6_k: return 18;  // LLAMA_FTYPE_MOSTLY_Q6_K
    case TensorType::bf16: return 32;
  }
  return 1;
}

// The pre-tokenizer name llama.cpp knows for this tokenizer.json.
std::string pre_name_of(const json& tok, const std::string& source) {
  const json* pre = tok.contains("pre_tokenizer") ? &tok["pre_tokenizer"] : nullptr;
  std::string regex;
  bool byte_level_regex = false;
  std::function<void(const json&)> walk = [&](const json& p) {
    if (!p.is_object()) return;
    const std::string type = p.value("type", "");
    if (type == "Sequence" && p.contains("pretokenizers")) {
      for (const json& q : p["pretokenizers"]) walk(q);
    } else if (type == "Split" && p.contains("pattern") && p["pattern"].contains("Regex")) {
      regex = p["pattern"]["Regex"].get<std::string>();
    } else if (type == "ByteLevel" && p.value("use_regex", true)) {
      byte_level_regex = true;
    }
  };
  if (pre != nullptr) walk(*pre);
  if (regex == kLlama3Regex) return "llama-bpe";
  if (regex == kQwen2Regex) return "qwen2";
  if (regex.empty() && byte_level_regex) return "gpt-2";
  throw ModelFileError(source + ": the pre-tokenizer is none llama.cpp names (known: the Llama-3 regex -> llama-bpe, "
                                "the Qwen2 regex -> qwen2, plain ByteLevel -> gpt-2)");
}

void write_tokenizer(gguf::Writer& w, const std::string& tokenizer_json, const ModelConfig& c, bool embed) {
  const std::string source = "tokenizer.json";
  const json tok = json_util::parse(tokenizer_json, source);
  const Tokenizer parsed = Tokenizer::from_json_text(tokenizer_json, source);  // validates it fully
  const json& model = tok.at("model");
  const int n_vocab = std::max(c.vocab_size, parsed.vocab_size());
  if (parsed.vocab_size() > c.vocab_size) {
    throw ModelFileError(source + ": " + std::to_string(parsed.vocab_size()) + " token ids for a model vocab of " +
                         std::to_string(c.vocab_size));
  }
  std::vector<std::string> tokens(static_cast<std::size_t>(n_vocab));
  std::vector<std::int32_t> types(static_cast<std::size_t>(n_vocab), kUnused);
  for (auto it = model.at("vocab").begin(); it != model.at("vocab").end(); ++it) {
    const int id = it.value().get<int>();
    tokens[id] = it.key();
    types[id] = kNormal;
  }
  if (tok.contains("added_tokens")) {
    for (const json& t : tok["added_tokens"]) {
      const int id = t.at("id").get<int>();
      tokens[id] = t.at("content").get<std::string>();
      types[id] = t.value("special", false) ? kControl : kUserDefined;
    }
  }
  for (int id = 0; id < n_vocab; ++id) {
    if (tokens[id].empty()) tokens[id] = "[PAD" + std::to_string(id) + "]";  // holes, as llama.cpp's converter names them
  }
  std::vector<std::string> merges;
  for (const json& m : model.at("merges")) {
    merges.push_back(m.is_array() ? m.at(0).get<std::string>() + " " + m.at(1).get<std::string>() : m.get<std::string>());
  }
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string("tokenizer.ggml.pre", pre_name_of(tok, source));
  w.add_strings("tokenizer.ggml.tokens", tokens);
  w.add_i32s("tokenizer.ggml.token_type", types);
  w.add_strings("tokenizer.ggml.merges", merges);
  const std::optional<int> bos = c.bos_token_id ? c.bos_token_id : parsed.bos_id();
  if (bos) w.add_u32("tokenizer.ggml.bos_token_id", static_cast<std::uint32_t>(*bos));
  if (!c.eos_token_ids.empty()) w.add_u32("tokenizer.ggml.eos_token_id", static_cast<std::uint32_t>(c.eos_token_ids.front()));
  w.add_bool("tokenizer.ggml.add_bos_token", parsed.bos_id().has_value());
  w.add_bool("tokenizer.ggml.add_eos_token", false);
  if (embed) w.add_string("tokenizer.huggingface.json", tokenizer_json);
}

}  // namespace

void write_gguf(const Model& model, const std::string& tokenizer_json, const std::filesystem::path& out,
                const GgufExportOptions& options) {
  const ModelConfig& c = model.config();
  // Mistral is a llama-arch model to llama.cpp.
  const std::string arch = c.architecture == "qwen2" ? "qwen2" : "llama";
  if (c.architecture != "llama" && c.architecture != "qwen2" && c.architecture != "mistral") {
    throw ModelFileError("cannot write architecture '" + c.architecture + "' as GGUF (supported: llama, qwen2, mistral)");
  }
  gguf::Writer w;
  const std::string a = arch + ".";
  w.add_string("general.architecture", arch);
  w.add_string("general.name", "kvslim export");
  w.add_u32("general.file_type", file_type_of(options.matrix_type));
  w.add_u32(a + "context_length", static_cast<std::uint32_t>(c.max_position_embeddings));
  w.add_u32(a + "embedding_length", static_cast<std::uint32_t>(c.hidden_size));
  w.add_u32(a + "block_count", static_cast<std::uint32_t>(c.num_layers));
  w.add_u32(a + "feed_forward_length", static_cast<std::uint32_t>(c.intermediate_size));
  w.add_u32(a + "attention.head_count", static_cast<std::uint32_t>(c.num_heads));
  w.add_u32(a + "attention.head_count_kv", static_cast<std::uint32_t>(c.num_kv_heads));
  w.add_u32(a + "attention.key_length", static_cast<std::uint32_t>(c.head_dim));
  w.add_u32(a + "attention.value_length", static_cast<std::uint32_t>(c.head_dim));
  w.add_u32(a + "rope.dimension_count", static_cast<std::uint32_t>(c.head_dim));
  w.add_f32(a + "rope.freq_base", static_cast<float>(c.rope_theta));
  w.add_f32(a + "attention.layer_norm_rms_epsilon", static_cast<float>(c.rms_norm_eps));
  w.add_u32(a + "vocab_size", static_cast<std::uint32_t>(c.vocab_size));
  if (c.rope_scaling.type == "linear") {
    w.add_string(a + "rope.scaling.type", "linear");
    w.add_f32(a + "rope.scaling.factor", static_cast<float>(c.rope_scaling.factor));
  }
  if (!tokenizer_json.empty()) write_tokenizer(w, tokenizer_json, c, options.embed_hf_tokenizer);

  // HF name -> GGUF name.
  std::map<std::string, std::string> names;
  for (const auto& [g, hf] : global_tensor_names()) names[hf] = g;
  for (int l = 0; l < c.num_layers; ++l) {
    for (const auto& [g, hf] : layer_tensor_names()) {
      names["model.layers." + std::to_string(l) + "." + hf] = "blk." + std::to_string(l) + "." + g;
    }
  }
  const WeightStore& store = model.store();
  const std::size_t d = static_cast<std::size_t>(c.head_dim);
  auto add = [&](const std::string& hf, const TensorInfo& t) {
    auto it = names.find(hf);
    if (it == names.end()) throw ModelFileError(t.file + ": tensor '" + hf + "' has no GGUF name (not a Llama-family tensor)");
    const std::string& g = it->second;
    std::size_t n = 1;
    for (std::int64_t dim : t.shape) n *= static_cast<std::size_t>(dim);
    std::vector<float> x(n);
    convert_tensor(t, x.data());
    const bool qk = g.ends_with(".attn_q.weight") || g.ends_with(".attn_k.weight") || g.ends_with(".attn_q.bias") ||
                    g.ends_with(".attn_k.bias");
    if (arch == "llama" && qk) {
      const std::size_t rows = static_cast<std::size_t>(t.shape[0]), cols = n / rows;
      std::vector<float> p(n);
      for (std::size_t r = 0; r < rows; ++r) std::copy_n(x.data() + hf_row_of_gguf_row(r, d) * cols, cols, p.data() + r * cols);
      x.swap(p);
    }
    TensorType type = TensorType::f32;
    if (t.shape.size() == 2) {
      type = options.matrix_type;
      if (options.override_type) type = options.override_type(g, type);
      // Block types need whole blocks per row; such rows stay F16 (llama.cpp's quantizer falls back too).
      if (static_cast<std::size_t>(t.shape[1]) % gguf::block_elements(type) != 0) type = TensorType::f16;
    } else if (options.override_type) {
      type = options.override_type(g, type);
      if (gguf::block_elements(type) != 1 && n % gguf::block_elements(type) != 0) type = TensorType::f32;
    }
    w.add_tensor(g, type, {t.shape.rbegin(), t.shape.rend()}, encode(x, type));
  };
  add("model.embed_tokens.weight", *store.find("model.embed_tokens.weight"));
  if (c.rope_scaling.type == "llama3" || c.rope_scaling.type == "freq_factors") {
    // llama.cpp's form of llama3 scaling: per-frequency divisors of the unscaled frequencies.
    const RopeTable plain(c.head_dim, c.rope_theta, RopeScaling{});
    const RopeTable scaled(c);
    std::vector<float> factors(plain.inv_freq().size());
    for (std::size_t i = 0; i < factors.size(); ++i) factors[i] = plain.inv_freq()[i] / scaled.inv_freq()[i];
    w.add_tensor("rope_freqs.weight", TensorType::f32, {static_cast<std::int64_t>(factors.size())}, encode(factors, TensorType::f32));
  }
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (const char* part : {"input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.q_proj.bias",
                             "self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                             "self_attn.v_proj.bias", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                             "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}) {
      if (const TensorInfo* t = store.find(p + part)) add(p + part, *t);
    }
  }
  add("model.norm.weight", *store.find("model.norm.weight"));
  if (!c.tie_word_embeddings || store.has("lm_head.weight")) {
    if (const TensorInfo* t = store.find("lm_head.weight")) add("lm_head.weight", *t);
  }
  w.write(out);
}

}  // namespace kvslim::engine
