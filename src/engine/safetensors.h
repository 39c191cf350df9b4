// Model weights from HF safetensors files: one model.safetensors, or shards listed by
// model.safetensors.index.json. Files are mmap'ed; tensors are handed out as views into them.
//
// File layout: [u64 LE header length N][N bytes of JSON header][data]. The header maps each
// tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the data
// section) and may hold a "__metadata__" object of string -> string.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "engine/model_file_error.h"

namespace kvslim::engine {

// How weights are stored. f32/f16/bf16: one value per element (safetensors and GGUF). The others
// are ggml's block formats, read from GGUF files and kept as stored (engine/gguf.h describes them):
// a row of a matrix is a whole number of blocks.
// q4_0x16, q4_kx16 and q6_kx16 are not file formats: Q4_0 / Q4_K / Q6_K matrices repacked at load
// (engine/quant_gemv.h, qgemv::interleave) with 16 rows' blocks side by side, so a row is no
// longer contiguous: whole tensors of them are decoded by shape (convert_tensor in engine/ops.h),
// not by convert_weights. q4_0x16 holds its file type's bytes, q6_kx16 as many (Q6_K's 210 per
// row and 256 values, the 6-bit codes regrouped); q4_kx16 148 bytes per row and 256 values (Q4_K's
// 144, its 6-bit scales and mins unpacked to bytes).
enum class WeightType { f32, f16, bf16, q8_0, q4_0, q4_k, q5_k, q6_k, q4_0x16, q4_kx16, q6_kx16 };

// Bytes per block of a weight type (per element for f32/f16/bf16: their blocks are one element).
std::size_t weight_type_size(WeightType type);
// Elements per block: 1 for f32/f16/bf16, 32 for Q8_0/Q4_0, 256 for the K-quants.
std::size_t weight_block_elements(WeightType type);
// Whether `type` is a block format (quantized).
inline bool is_block_type(WeightType type) { return weight_block_elements(type) > 1; }
// Rows of a matrix stored side by side in an interleaved (repacked) type; 1 for the others.
inline std::size_t weight_interleave_rows(WeightType type) {
  return type == WeightType::q4_0x16 || type == WeightType::q4_kx16 || type == WeightType::q6_kx16 ? 16 : 1;
}
// Elements held by `nbytes` of `type` (whole blocks).
inline std::size_t weight_elements(WeightType type, std::size_t nbytes) {
  return nbytes / weight_type_size(type) * weight_block_elements(type);
}
// Bytes of `elements` values of `type` (a multiple of the block size).
inline std::size_t weight_bytes(WeightType type, std::size_t elements) {
  return elements / weight_block_elements(type) * weight_type_size(type);
}
// "F32", "F16", "BF16" as safetensors spells them; "Q8_0", "Q4_K", ... as ggml does.
const char* weight_type_name(WeightType type);

struct TensorInfo {
  std::string name;
  WeightType type;
  std::vector<std::int64_t> shape;  // PyTorch order, e.g. [out_features, in_features]
  const void* data;                 // points into the mmap'ed file, little-endian; aligned to the
                                    // element size (a misaligned tensor is copied, see WeightStore)
  std::size_t nbytes;
  std::string file;                 // which shard, for error messages
};

// The parsed header of one safetensors file.
struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;              // sorted by name; data points into the bytes given
  std::map<std::string, std::string> metadata;  // "__metadata__"
};

// Parses and checks a whole safetensors file held in memory (this is also the fuzz entry point).
// Checks: the header length fits in the file, the header is a JSON object, every tensor has a
// supported dtype, non-negative shape and in-bounds, ordered, non-overlapping data offsets whose
// size equals shape x dtype size. `file_name` names the file in errors. Throws ModelFileError.
SafetensorsHeader parse_safetensors_header(std::span<const std::byte> file_bytes,
                                           const std::string& file_name);

// A model's weights from model.safetensors or a sharded model.safetensors.index.json (mmap).
// Movable, not copyable; the mappings are released in the destructor.
class WeightStore {
 public:
  WeightStore();  // empty store (no tensors)
  WeightStore(WeightStore&&) noexcept;
  WeightStore& operator=(WeightStore&&) noexcept;
  WeightStore(const WeightStore&) = delete;
  WeightStore& operator=(const WeightStore&) = delete;
  ~WeightStore();

  // `model_dir` holds model.safetensors or model.safetensors.index.json; a path to a single
  // .safetensors file is accepted too. Throws ModelFileError.
  static WeightStore open(const std::filesystem::path& model_dir);
  // A store over tensors from elsewhere (a GGUF file): their data must stay valid while `owner`
  // lives; the store keeps `owner`. Names must be unique (ModelFileError otherwise).
  static WeightStore from_tensors(std::vector<TensorInfo> tensors, std::shared_ptr<const void> owner);

  bool has(std::string_view name) const;
  // The tensor, checked: throws ModelFileError naming file and tensor when missing or when its
  // shape differs from `expected_shape`.
  const TensorInfo& get(std::string_view name, std::span<const std::int64_t> expected_shape) const;
  const TensorInfo& get(std::string_view name, std::initializer_list<std::int64_t> expected_shape) const {
    return get(name, std::span<const std::int64_t>(expected_shape.begin(), expected_shape.size()));
  }
  // The tensor without a shape check, or nullptr when absent.
  const TensorInfo* find(std::string_view name) const;
  std::vector<std::string> names() const;  // sorted
  std::size_t size() const;
  // "__metadata__" of every file, merged (the first file wins on a repeated key).
  const std::map<std::string, std::string>& metadata() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kvslim::engine
