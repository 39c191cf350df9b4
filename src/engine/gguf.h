// GGUF v3 files (llama.cpp's model format): parsing the header, metadata and tensor table from the
// bytes of a whole file, the block formats kvslim can read (Q8_0, Q4_0) and a writer.
//
// File layout (little-endian):
//   u32 magic "GGUF" | u32 version (3) | u64 tensor count | u64 metadata count
//   metadata: { string key | u32 value type | value }*   (string = u64 length + bytes, no NUL)
//   tensors:  { string name | u32 n_dims | u64 ne[n_dims] | u32 ggml type | u64 offset }*
//   padding to `general.alignment` (default 32) | tensor data (each offset relative to here,
//   a multiple of the alignment)
// Dimensions are in ggml order: ne[0] is the innermost (contiguous) one, the reverse of a PyTorch
// shape; a [rows, cols] weight matrix has ne = {cols, rows}.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/model_file_error.h"

namespace kvslim::engine::gguf {

// Metadata value types as numbered in the file.
enum class ValueType : std::uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7, string = 8, array = 9,
  u64 = 10, i64 = 11, f64 = 12,
};
const char* value_type_name(ValueType type);

// ggml tensor types as numbered in the file (ggml.h). kvslim reads F32, F16, BF16, Q8_0, Q4_0 and
// the K-quants Q4_K, Q5_K, Q6_K (what Q4_K_M / Q5_K_M files hold); the others are named so an error
// can say which types a file uses.
enum class TensorType : std::uint32_t {
  f32 = 0, f16 = 1, q4_0 = 2, q8_0 = 8, q4_k = 12, q5_k = 13, q6_k = 14, bf16 = 30,
};
// "F32", "Q4_K", ... for any ggml type id (unknown ids as "type N").
std::string tensor_type_name(std::uint32_t ggml_type);
// Whether kvslim can read tensors of this type.
bool tensor_type_supported(std::uint32_t ggml_type);
// Elements per block and bytes per block of a supported type (1 and the element size for the
// plain float types, 32 and 34 / 18 for Q8_0 / Q4_0, 256 and 144 / 176 / 210 for Q4_K / Q5_K / Q6_K).
std::size_t block_elements(TensorType type);
std::size_t block_bytes(TensorType type);

// One metadata value. Scalars: integers in `i` (u64 values above INT64_MAX are rejected), floats
// in `f`, bools in `b`, strings in `s`. Arrays: `element_type` and one of `strings` / `ints` /
// `floats` (bool arrays in `ints`); arrays of arrays are skipped (`element_type` array, no items).
struct Value {
  ValueType type = ValueType::u8;
  ValueType element_type = ValueType::u8;  // arrays only
  std::int64_t i = 0;
  double f = 0;
  bool b = false;
  std::string s;
  std::vector<std::string> strings;
  std::vector<std::int64_t> ints;
  std::vector<double> floats;
  std::uint64_t array_size = 0;

  bool is_integer() const;
  bool is_float() const { return type == ValueType::f32 || type == ValueType::f64; }
};

struct TensorEntry {
  std::string name;
  std::uint32_t type = 0;           // ggml type id (maybe unsupported)
  std::vector<std::int64_t> ne;     // ggml order, ne[0] innermost
  std::uint64_t offset = 0;         // relative to the data section
  const std::byte* data = nullptr;  // into the file bytes; nullptr for an unsupported type
  std::size_t nbytes = 0;           // 0 for an unsupported type (its size is not known here)

  std::int64_t elements() const;
  // PyTorch-order shape: ne reversed.
  std::vector<std::int64_t> shape() const;
};

// The parsed header of one GGUF file; views point into the bytes given to parse().
struct Header {
  std::uint32_t version = 0;
  std::uint64_t alignment = 32;
  std::map<std::string, Value> metadata;
  std::vector<TensorEntry> tensors;  // in file order

  const Value* find(std::string_view key) const;
  const TensorEntry* tensor(std::string_view name) const;
};

// Parses and checks a whole GGUF file held in memory (this is also the fuzz entry point). Checks:
// magic, version 3 (2 is read too), every length and count against the bytes left, known value
// types, unique keys and tensor names, 1..4 dimensions each >= 1 without overflow, alignment a
// power of two, offsets aligned, supported tensors in bounds and not overlapping. `file_name`
// names the file in errors. Throws ModelFileError.
Header parse(std::span<const std::byte> file_bytes, const std::string& file_name);

// A GGUF file mmap'ed and parsed; the header's views stay valid while this object lives.
class File {
 public:
  static std::shared_ptr<const File> open(const std::filesystem::path& path);  // throws ModelFileError
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  const Header& header() const { return header_; }
  const std::string& name() const { return name_; }
  // Hands the whole pages inside [p, p + n) (a range of this file's mapping) back to the kernel
  // (madvise DONTNEED: a later read maps them from the file again). For tensors the loader copied
  // elsewhere, so the copy and the mapping are not both resident. A range outside the mapping is
  // ignored.
  void release_pages(const std::byte* p, std::size_t n) const;

 private:
  File() = default;
  std::string name_;
  void* map_ = nullptr;
  std::size_t size_ = 0;
  Header header_;
};

// Block formats (ggml's, bit for bit). Q8_0: 32 values = f16 scale d + 32 int8, x = q * d.
// Q4_0: 32 values = f16 scale d + 16 bytes, x[j] = ((byte[j] & 15) - 8) * d and
// x[j + 16] = ((byte[j] >> 4) - 8) * d. n must be a multiple of 32.
void dequantize_q8_0(const std::byte* blocks, float* out, std::size_t n);
void dequantize_q4_0(const std::byte* blocks, float* out, std::size_t n);
// ggml's reference quantizers (quantize_row_q8_0_ref / quantize_row_q4_0_ref): the same codes.
void quantize_q8_0(const float* x, std::byte* blocks, std::size_t n);
void quantize_q4_0(const float* x, std::byte* blocks, std::size_t n);

// K-quants: super-blocks of 256 values (n must be a multiple of 256), ggml's layouts bit for bit.
// Q4_K (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32
//   (sub-block j < 4: scale = s[j] & 63, min = s[j+4] & 63; j >= 4: scale = (s[j+4] & 15) |
//   (s[j-4] >> 6) << 4, min = (s[j+4] >> 4) | (s[j] >> 6) << 4), 128 bytes of 4-bit codes: bytes
//   32i..32i+31 hold sub-block 2i in their low nibbles and 2i+1 in their high ones;
//   x = d * scale * q - dmin * min.
// Q5_K (176 bytes): as Q4_K with 32 bytes qh (after the scales, before the codes): bit 2i / 2i+1 of
//   qh[l] is bit 4 of element l of sub-block 2i / 2i+1 (q in 0..31).
// Q6_K (210 bytes): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales (one per
//   16 values), f16 d. Per half h of 128 values (ql + 64h, qh + 32h), l < 32: element l takes ql[l]
//   low nibble and qh[l] bits 0-1, l+32: ql[l+32] low and bits 2-3, l+64: ql[l] high and bits 4-5,
//   l+96: ql[l+32] high and bits 6-7; x = d * scale[element / 16] * (q - 32).
void dequantize_q4_k(const std::byte* blocks, float* out, std::size_t n);
void dequantize_q5_k(const std::byte* blocks, float* out, std::size_t n);
void dequantize_q6_k(const std::byte* blocks, float* out, std::size_t n);
// Sub-block j's (0..7) 6-bit scale and min in the 12 packed scale bytes of a Q4_K / Q5_K
// super-block (blk + 4), and their inverse (writes the bits of sub-block j, keeps the others).
void k_scale_min(const std::byte* s, int j, int& scale, int& min);
void k_set_scale_min(std::byte* s, int j, int scale, int min);
// Simple K-quant encoders (round to nearest with per-sub-block min/max scales, not llama.cpp's
// searched ones): valid files for tests and `kvslim convert --type q4_k/q5_k/q6_k`.
void quantize_q4_k(const float* x, std::byte* blocks, std::size_t n);
void quantize_q5_k(const float* x, std::byte* blocks, std::size_t n);
void quantize_q6_k(const float* x, std::byte* blocks, std::size_t n);
// Any supported type to fp32 (exact for F32/F16/BF16; the format's own decoding for the others).
void to_float(const std::byte* data, TensorType type, float* out, std::size_t n);

// Writes a GGUF v3 file: metadata in the order added, tensors in the order added (alignment 32).
class Writer {
 public:
  void add_string(const std::string& key, const std::string& value);
  void add_u32(const std::string& key, std::uint32_t value);
  void add_i32(const std::string& key, std::int32_t value);
  void add_f32(const std::string& key, float value);
  void add_bool(const std::string& key, bool value);
  void add_strings(const std::string& key, const std::vector<std::string>& values);
  void add_i32s(const std::string& key, const std::vector<std::int32_t>& values);
  // `data` holds the tensor in `type`'s encoding; `ne` in ggml order.
  void add_tensor(const std::string& name, TensorType type, std::vector<std::int64_t> ne, std::vector<std::byte> data);
  // The whole file as bytes / written to `path` (throws ModelFileError when it cannot write).
  std::vector<std::byte> bytes() const;
  void write(const std::filesystem::path& path) const;

 private:
  struct Tensor {
    std::string name;
    TensorType type;
    std::vector<std::int64_t> ne;
    std::vector<std::byte> data;
  };
  std::vector<std::byte> kv_;  // encoded metadata entries
  std::uint64_t kv_count_ = 0;
  std::vector<Tensor> tensors_;
};

}  // namespace kvslim::engine::gguf
