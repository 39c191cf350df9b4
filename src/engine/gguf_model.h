// A Llama-family model from a GGUF file (llama.cpp's format) and a GGUF file from an HF model
// directory, so that the same model runs in kvslim and llama.cpp.
//
// Import: architectures llama and qwen2; weights F32/F16/BF16 and the block formats Q8_0, Q4_0,
// Q4_K, Q5_K, Q6_K, all read in place from the mmap in their stored type (the engine's kernels
// read the blocks directly, engine/quant_gemv.h); the q/k row permutation llama.cpp's converter
// applies to llama-arch files is undone by copying those rows (whole blocks) into HF order, and
// the mapped pages of the originals are handed back, so resident weights stay the file's tensor
// bytes; qwen2 files keep HF's NeoX layout; rope_freqs.weight (llama3 frequency scaling) becomes
// per-frequency divisors.
// The tokenizer is the embedded tokenizer.huggingface.json when the file has one, else it is
// rebuilt from tokenizer.ggml.* (gpt2-style byte-level BPE, pre-tokenizer by tokenizer.ggml.pre).
#pragma once
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include "engine/gguf.h"
#include "engine/model_config.h"
#include "engine/safetensors.h"

namespace kvslim::engine {

class Model;
class Tokenizer;

// True for a regular file whose name ends in ".gguf" or whose first bytes are "GGUF".
bool is_gguf_path(const std::filesystem::path& path);

struct GgufModel {
  ModelConfig config;
  WeightStore store;  // tensors under their HF names, in HF layout
};
// Throws ModelFileError naming the file and the key/tensor at fault; one error lists every
// unsupported tensor type in the file.
GgufModel read_gguf_model(const std::filesystem::path& path);
GgufModel read_gguf_model(std::shared_ptr<const gguf::File> file);
// From a parsed header whose views stay valid while `keep_alive` lives (the fuzz entry point).
// `mapped`: the file the views point into, whose pages of copied tensors may be released.
GgufModel read_gguf_model(const gguf::Header& header, const std::string& file_name, std::shared_ptr<const void> keep_alive,
                          const gguf::File* mapped = nullptr);

// tokenizer.json text for the file's tokenizer (embedded, or rebuilt from tokenizer.ggml.*).
std::string gguf_tokenizer_json(const gguf::Header& header, const std::string& file_name);

// The tokenizer of a model path: a .gguf file's own, or model_dir/tokenizer.json.
Tokenizer load_model_tokenizer(const std::filesystem::path& model);

// ---------------------------------------------------------------------------------------------
// Export

struct GgufExportOptions {
  // Type of the 2-D weight matrices (embedding, projections, lm_head). Norms and biases are F32.
  gguf::TensorType matrix_type = gguf::TensorType::f16;
  // Optional per-tensor override by GGUF tensor name (e.g. to write every type into one file).
  std::function<gguf::TensorType(const std::string& gguf_name, gguf::TensorType chosen)> override_type;
  // Embed tokenizer.json as tokenizer.huggingface.json (kvslim reads it back exactly; llama.cpp
  // reads tokenizer.ggml.*, which is always written when there is a tokenizer).
  bool embed_hf_tokenizer = true;
};

// Writes `model` (loaded from an HF directory) as a GGUF v3 file llama.cpp can load: llama.cpp's
// tensor names and metadata keys, q/k rows permuted for llama-arch, the tokenizer from
// `tokenizer_json` (empty: no tokenizer). Throws ModelFileError.
void write_gguf(const Model& model, const std::string& tokenizer_json, const std::filesystem::path& out,
                const GgufExportOptions& options = {});

// "f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k" -> type (case-insensitive); throws
// std::invalid_argument.
gguf::TensorType parse_tensor_type(const std::string& name);

}  // namespace kvslim::engine
