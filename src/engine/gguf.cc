#include "engine/gguf.h"

#include "engine/output_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>

#include "kvslim/dtype.h"

namespace kvslim::engine::gguf {
namespace {

constexpr std::uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr std::size_t kMaxDims = 4;           // GGML_MAX_DIMS
constexpr int kMaxArrayDepth = 8;             // nested arrays are skipped, but not without bound

// Bounds-checked little-endian reader over the file bytes; every failure names the file and what
// was being read.
class Reader {
 public:
  Reader(std::span<const std::byte> bytes, const std::string& file) : bytes_(bytes), file_(file) {}

  std::size_t pos() const { return pos_; }
  std::size_t left() const { return bytes_.size() - pos_; }

  template <class T>
  T read(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string read_string(const std::string& what) {
    const auto n = read<std::uint64_t>(what + " length");
    if (n > left()) fail(what + ": string length " + std::to_string(n) + " runs past the end of the file");
    std::string s(reinterpret_cast<const char*>(bytes_.data() + pos_), static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return s;
  }
  void skip(std::uint64_t n, const std::string& what) {
    if (n > left()) fail(what + ": runs past the end of the file");
    pos_ += static_cast<std::size_t>(n);
  }
  [[noreturn]] void fail(const std::string& msg) const {
    throw ModelFileError(file_ + ": " + msg + " (at byte " + std::to_string(pos_) + ")");
  }

 private:
  void need(std::size_t n, const std::string& what) const {
    if (n > left()) {
      throw ModelFileError(file_ + ": truncated file: " + what + " needs " + std::to_string(n) + " bytes at byte " +
                           std::to_string(pos_) + ", " + std::to_string(left()) + " left");
    }
  }
  std::span<const std::byte> bytes_;
  const std::string& file_;
  std::size_t pos_ = 0;
};

// Bytes one element of a scalar value type takes in the file (strings: at least their length).
std::size_t min_value_size(ValueType t) {
  switch (t) {
    case ValueType::u8: case ValueType::i8: case ValueType::boolean: return 1;
    case ValueType::u16: case ValueType::i16: return 2;
    case ValueType::u32: case ValueType::i32: case ValueType::f32: return 4;
    case ValueType::u64: case ValueType::i64: case ValueType::f64: case ValueType::string: return 8;
    case ValueType::array: return 12;  // element type + count
  }
  return 1;
}

bool known_value_type(std::uint32_t t) { return t <= static_cast<std::uint32_t>(ValueType::f64); }

ValueType read_value_type(Reader& r, const std::string& what) {
  const auto t = r.read<std::uint32_t>(what);
  if (!known_value_type(t)) r.fail(what + ": unknown value type " + std::to_string(t));
  return static_cast<ValueType>(t);
}

// One integer, float or bool scalar into `v`.
void read_number(Reader& r, ValueType t, Value& v, const std::string& what) {
  switch (t) {
    case ValueType::u8: v.i = r.read<std::uint8_t>(what); break;
    case ValueType::i8: v.i = r.read<std::int8_t>(what); break;
    case ValueType::u16: v.i = r.read<std::uint16_t>(what); break;
    case ValueType::i16: v.i = r.read<std::int16_t>(what); break;
    case ValueType::u32: v.i = r.read<std::uint32_t>(what); break;
    case ValueType::i32: v.i = r.read<std::int32_t>(what); break;
    case ValueType::i64: v.i = r.read<std::int64_t>(what); break;
    case ValueType::u64: {
      const auto u = r.read<std::uint64_t>(what);
      if (u > static_cast<std::uint64_t>(INT64_MAX)) r.fail(what + ": u64 value " + std::to_string(u) + " is too large");
      v.i = static_cast<std::int64_t>(u);
      break;
    }
    case ValueType::f32: v.f = r.read<float>(what); break;
    case ValueType::f64: v.f = r.read<double>(what); break;
    case ValueType::boolean: {
      const auto b = r.read<std::uint8_t>(what);
      if (b > 1) r.fail(what + ": bool value " + std::to_string(b) + " is neither 0 nor 1");
      v.b = b != 0;
      v.i = b;
      break;
    }
    default: r.fail(what + ": not a number type");
  }
}

void skip_array(Reader& r, const std::string& what, int depth);

Value read_value(Reader& r, ValueType t, const std::string& what, int depth) {
  Value v;
  v.type = t;
  if (t == ValueType::string) {
    v.s = r.read_string(what);
  } else if (t == ValueType::array) {
    v.element_type = read_value_type(r, what + " element type");
    const auto n = r.read<std::uint64_t>(what + " array length");
    // Every element takes at least min_value_size bytes: a count that cannot fit is rejected
    // before anything is allocated.
    if (n > r.left() / min_value_size(v.element_type)) {
      r.fail(what + ": array of " + std::to_string(n) + " " + value_type_name(v.element_type) +
             " runs past the end of the file");
    }
    v.array_size = n;
    if (v.element_type == ValueType::string) {
      v.strings.reserve(static_cast<std::size_t>(n));
      for (std::uint64_t k = 0; k < n; ++k) v.strings.push_back(r.read_string(what));
    } else if (v.element_type == ValueType::array) {
      if (depth >= kMaxArrayDepth) r.fail(what + ": arrays nested deeper than " + std::to_string(kMaxArrayDepth));
      for (std::uint64_t k = 0; k < n; ++k) skip_array(r, what, depth + 1);
    } else if (v.element_type == ValueType::f32 || v.element_type == ValueType::f64) {
      v.floats.reserve(static_cast<std::size_t>(n));
      Value e;
      for (std::uint64_t k = 0; k < n; ++k) {
        read_number(r, v.element_type, e, what);
        v.floats.push_back(e.f);
      }
    } else {
      v.ints.reserve(static_cast<std::size_t>(n));
      Value e;
      for (std::uint64_t k = 0; k < n; ++k) {
        read_number(r, v.element_type, e, what);
        v.ints.push_back(e.i);
      }
    }
  } else {
    read_number(r, t, v, what);
  }
  return v;
}

void skip_array(Reader& r, const std::string& what, int depth) {
  const ValueType t = read_value_type(r, what + " element type");
  const auto n = r.read<std::uint64_t>(what + " array length");
  if (n > r.left() / min_value_size(t)) r.fail(what + ": nested array runs past the end of the file");
  for (std::uint64_t k = 0; k < n; ++k) {
    if (t == ValueType::array) {
      if (depth >= kMaxArrayDepth) r.fail(what + ": arrays nested deeper than " + std::to_string(kMaxArrayDepth));
      skip_array(r, what, depth + 1);
    } else if (t == ValueType::string) {
      r.skip(r.read<std::uint64_t>(what + " length"), what);
    } else {
      r.skip(min_value_size(t), what);
    }
  }
}

struct TypeInfo {
  std::uint32_t id;
  const char* name;
};
// Every ggml type id a GGUF may hold (ggml.h), for error messages.
constexpr TypeInfo kTypeNames[] = {
    {0, "F32"},       {1, "F16"},     {2, "Q4_0"},    {3, "Q4_1"},    {6, "Q5_0"},    {7, "Q5_1"},   {8, "Q8_0"},
    {9, "Q8_1"},      {10, "Q2_K"},   {11, "Q3_K"},   {12, "Q4_K"},   {13, "Q5_K"},   {14, "Q6_K"},  {15, "Q8_K"},
    {16, "IQ2_XXS"},  {17, "IQ2_XS"}, {18, "IQ3_XXS"}, {19, "IQ1_S"}, {20, "IQ4_NL"}, {21, "IQ3_S"}, {22, "IQ2_S"},
    {23, "IQ4_XS"},   {24, "I8"},     {25, "I16"},    {26, "I32"},    {27, "I64"},    {28, "F64"},   {29, "IQ1_M"},
    {30, "BF16"},     {34, "TQ1_0"},  {35, "TQ2_0"},  {39, "MXFP4"},  {40, "NVFP4"},  {41, "Q1_0"},  {42, "Q2_0"},
};

}  // namespace

const char* value_type_name(ValueType type) {
  switch (type) {
    case ValueType::u8: return "u8";
    case ValueType::i8: return "i8";
    case ValueType::u16: return "u16";
    case ValueType::i16: return "i16";
    case ValueType::u32: return "u32";
    case ValueType::i32: return "i32";
    case ValueType::f32: return "f32";
    case ValueType::boolean: return "bool";
    case ValueType::string: return "string";
    case ValueType::array: return "array";
    case ValueType::u64: return "u64";
    case ValueType::i64: return "i64";
    case ValueType::f64: return "f64";
  }
  return "?";
}

std::string tensor_type_name(std::uint32_t ggml_type) {
  for (const TypeInfo& t : kTypeNames) {
    if (t.id == ggml_type) return t.name;
  }
  return "type " + std::to_string(ggml_type);
}

bool tensor_type_supported(std::uint32_t t) {
  switch (static_cast<TensorType>(t)) {
    case TensorType::f32: case TensorType::f16: case TensorType::bf16: case TensorType::q8_0: case TensorType::q4_0:
    case TensorType::q4_k: case TensorType::q5_k: case TensorType::q6_k:
      return true;
  }
  return false;
}

std::size_t block_elements(TensorType type) {
  switch (type) {
    case TensorType::q8_0: case TensorType::q4_0: return 32;
    case TensorType::q4_k: case TensorType::q5_k: case TensorType::q6_k: return 256;
    default: return 1;
  }
}

std::size_t block_bytes(TensorType type) {
  switch (type) {
    case TensorType::f32: return 4;
    case TensorType::f16: case TensorType::bf16: return 2;
    case TensorType::q8_0: return 34;
    case TensorType::q4_0: return 18;
    case TensorType::q4_k: return 144;
    case TensorType::q5_k: return 176;
    case TensorType::q6_k: return 210;
  }
  return 0;
}

bool Value::is_integer() const {
  switch (type) {
    case ValueType::u8: case ValueType::i8: case ValueType::u16: case ValueType::i16: case ValueType::u32:
    case ValueType::i32: case ValueType::u64: case ValueType::i64:
      return true;
    default:
      return false;
  }
}

std::int64_t TensorEntry::elements() const {
  std::int64_t n = 1;
  for (std::int64_t d : ne) n *= d;  // parse() checked that this does not overflow
  return n;
}

std::vector<std::int64_t> TensorEntry::shape() const { return {ne.rbegin(), ne.rend()}; }

const Value* Header::find(std::string_view key) const {
  auto it = metadata.find(std::string(key));
  return it == metadata.end() ? nullptr : &it->second;
}

const TensorEntry* Header::tensor(std::string_view name) const {
  for (const TensorEntry& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

Header parse(std::span<const std::byte> file_bytes, const std::string& file_name) {
  Reader r(file_bytes, file_name);
  Header h;
  const auto magic = r.read<std::uint32_t>("magic");
  if (magic != kMagic) r.fail("not a GGUF file (the first four bytes are not 'GGUF')");
  h.version = r.read<std::uint32_t>("version");
  if (h.version != 3 && h.version != 2) {
    r.fail("unsupported GGUF version " + std::to_string(h.version) + " (supported: 3, and 2 which has the same layout)");
  }
  const auto n_tensors = r.read<std::uint64_t>("tensor count");
  const auto n_kv = r.read<std::uint64_t>("metadata count");
  // A key/value takes at least 8 (key length) + 4 (type) + 1 bytes; a tensor entry at least 8 + 4
  // + 8 + 4 + 8 bytes. Counts that cannot fit are rejected before any allocation.
  if (n_kv > r.left() / 13) r.fail("metadata count " + std::to_string(n_kv) + " does not fit in the file");
  for (std::uint64_t k = 0; k < n_kv; ++k) {
    const std::string key = r.read_string("metadata key " + std::to_string(k));
    const std::string what = "metadata '" + key + "'";
    const ValueType t = read_value_type(r, what + " type");
    Value v = read_value(r, t, what, 0);
    if (!h.metadata.emplace(key, std::move(v)).second) r.fail("metadata key '" + key + "' appears twice");
  }
  if (const Value* a = h.find("general.alignment")) {
    if (!a->is_integer() || a->i <= 0 || (a->i & (a->i - 1)) != 0) {
      r.fail("general.alignment must be a positive power of two, found " +
             (a->is_integer() ? std::to_string(a->i) : std::string(value_type_name(a->type))));
    }
    h.alignment = static_cast<std::uint64_t>(a->i);
  }
  if (n_tensors > r.left() / 32) r.fail("tensor count " + std::to_string(n_tensors) + " does not fit in the file");
  std::set<std::string> names;
  h.tensors.reserve(static_cast<std::size_t>(n_tensors));
  for (std::uint64_t k = 0; k < n_tensors; ++k) {
    TensorEntry t;
    t.name = r.read_string("tensor " + std::to_string(k) + " name");
    const std::string who = "tensor '" + t.name + "'";
    if (!names.insert(t.name).second) r.fail(who + " appears twice");
    const auto n_dims = r.read<std::uint32_t>(who + " n_dims");
    if (n_dims < 1 || n_dims > kMaxDims) r.fail(who + ": " + std::to_string(n_dims) + " dimensions (expected 1 to 4)");
    std::uint64_t elements = 1;
    for (std::uint32_t d = 0; d < n_dims; ++d) {
      const auto ne = r.read<std::uint64_t>(who + " dimension");
      if (ne == 0 || ne > static_cast<std::uint64_t>(INT64_MAX) || elements > static_cast<std::uint64_t>(INT64_MAX) / ne) {
        r.fail(who + ": dimension " + std::to_string(d) + " = " + std::to_string(ne) + " is zero or overflows");
      }
      elements *= ne;
      t.ne.push_back(static_cast<std::int64_t>(ne));
    }
    t.type = r.read<std::uint32_t>(who + " type");
    t.offset = r.read<std::uint64_t>(who + " offset");
    if (t.offset % h.alignment != 0) {
      r.fail(who + ": offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
             std::to_string(h.alignment));
    }
    if (tensor_type_supported(t.type)) {
      const auto type = static_cast<TensorType>(t.type);
      const std::uint64_t be = block_elements(type);
      if (static_cast<std::uint64_t>(t.ne[0]) % be != 0) {
        r.fail(who + ": " + tensor_type_name(t.type) + " needs a row length that is a multiple of " + std::to_string(be) +
               ", found " + std::to_string(t.ne[0]));
      }
      const std::uint64_t blocks = elements / be;
      if (blocks > static_cast<std::uint64_t>(INT64_MAX) / block_bytes(type)) r.fail(who + ": size overflows");
      t.nbytes = static_cast<std::size_t>(blocks * block_bytes(type));
    }
    h.tensors.push_back(std::move(t));
  }
  // The data section starts at the next multiple of the alignment.
  const std::uint64_t header_end = r.pos();
  const std::uint64_t data_start = (header_end + h.alignment - 1) / h.alignment * h.alignment;
  if (h.tensors.empty()) return h;
  if (data_start > file_bytes.size()) r.fail("data section starts past the end of the file");
  const std::uint64_t data_size = file_bytes.size() - data_start;
  struct Range {
    std::uint64_t begin, end;
    std::size_t index;
  };
  std::vector<Range> ranges;
  for (std::size_t k = 0; k < h.tensors.size(); ++k) {
    TensorEntry& t = h.tensors[k];
    if (!tensor_type_supported(t.type)) continue;  // its size is unknown here; it is never read
    if (t.offset > data_size || t.nbytes > data_size - t.offset) {
      throw ModelFileError(file_name + ": tensor '" + t.name + "' (" + std::to_string(t.nbytes) + " bytes at data offset " +
                           std::to_string(t.offset) + ") runs past the end of the file (" + std::to_string(data_size) +
                           " bytes of data; file truncated?)");
    }
    t.data = file_bytes.data() + data_start + t.offset;
    ranges.push_back({t.offset, t.offset + t.nbytes, k});
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (std::size_t k = 1; k < ranges.size(); ++k) {
    if (ranges[k].begin < ranges[k - 1].end) {
      throw ModelFileError(file_name + ": tensor '" + h.tensors[ranges[k].index].name + "' overlaps tensor '" +
                           h.tensors[ranges[k - 1].index].name + "'");
    }
  }
  return h;
}

// ---------------------------------------------------------------------------------------------
// File

void File::release_pages(const std::byte* p, std::size_t n) const {
  const auto* base = static_cast<const std::byte*>(map_);
  if (map_ == nullptr || p < base || p + n > base + size_ || n == 0) return;
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const std::uintptr_t begin = (reinterpret_cast<std::uintptr_t>(p) + page - 1) / page * page;
  const std::uintptr_t end = (reinterpret_cast<std::uintptr_t>(p) + n) / page * page;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

std::shared_ptr<const File> File::open(const std::filesystem::path& path) {
  std::shared_ptr<File> f(new File());
  f->name_ = path.string();
  const int fd = ::open(f->name_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw ModelFileError(f->name_ + ": cannot open (" + std::strerror(errno) + ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw ModelFileError(f->name_ + ": not a regular file");
  }
  f->size_ = static_cast<std::size_t>(st.st_size);
  if (f->size_ > 0) {
    void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      throw ModelFileError(f->name_ + ": mmap failed (" + std::strerror(err) + ")");
    }
    f->map_ = p;
  }
  ::close(fd);
  f->header_ = parse({static_cast<const std::byte*>(f->map_), f->size_}, f->name_);
  return f;
}

File::~File() {
  if (map_ != nullptr) ::munmap(map_, size_);
}

// ---------------------------------------------------------------------------------------------
// Block formats

namespace {
float read_scale(const std::byte* p) {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_f32(h);
}
void write_scale(std::byte* p, float d) {
  const std::uint16_t h = f32_to_fp16(d);
  std::memcpy(p, &h, 2);
}
}  // namespace

void dequantize_q8_0(const std::byte* blocks, float* out, std::size_t n) {
  for (std::size_t b = 0; b < n / 32; ++b) {
    const std::byte* blk = blocks + b * 34;
    const float d = read_scale(blk);
    for (int j = 0; j < 32; ++j) out[b * 32 + j] = static_cast<float>(static_cast<std::int8_t>(blk[2 + j])) * d;
  }
}

void dequantize_q4_0(const std::byte* blocks, float* out, std::size_t n) {
  for (std::size_t b = 0; b < n / 32; ++b) {
    const std::byte* blk = blocks + b * 18;
    const float d = read_scale(blk);
    for (int j = 0; j < 16; ++j) {
      const auto q = std::to_integer<int>(blk[2 + j]);
      out[b * 32 + j] = static_cast<float>((q & 15) - 8) * d;
      out[b * 32 + j + 16] = static_cast<float>((q >> 4) - 8) * d;
    }
  }
}

void quantize_q8_0(const float* x, std::byte* blocks, std::size_t n) {
  for (std::size_t b = 0; b < n / 32; ++b) {
    const float* v = x + b * 32;
    std::byte* blk = blocks + b * 34;
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.0f;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    write_scale(blk, d);
    for (int j = 0; j < 32; ++j) blk[2 + j] = static_cast<std::byte>(static_cast<std::int8_t>(std::round(v[j] * id)));
  }
}

void quantize_q4_0(const float* x, std::byte* blocks, std::size_t n) {
  for (std::size_t b = 0; b < n / 32; ++b) {
    const float* v = x + b * 32;
    std::byte* blk = blocks + b * 18;
    float amax = 0, max = 0;  // the value of largest magnitude, with its sign
    for (int j = 0; j < 32; ++j) {
      if (amax < std::fabs(v[j])) {
        amax = std::fabs(v[j]);
        max = v[j];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    write_scale(blk, d);
    for (int j = 0; j < 16; ++j) {
      const int q0 = std::min(15, static_cast<int>(static_cast<std::int8_t>(v[j] * id + 8.5f)));
      const int q1 = std::min(15, static_cast<int>(static_cast<std::int8_t>(v[j + 16] * id + 8.5f)));
      blk[2 + j] = static_cast<std::byte>(q0 | (q1 << 4));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// K-quants

void k_scale_min(const std::byte* s, int j, int& scale, int& min) {
  auto b = [&](int i) { return std::to_integer<int>(s[i]); };
  if (j < 4) {
    scale = b(j) & 63;
    min = b(j + 4) & 63;
  } else {
    scale = (b(j + 4) & 15) | ((b(j - 4) >> 6) << 4);
    min = (b(j + 4) >> 4) | ((b(j) >> 6) << 4);
  }
}
void k_set_scale_min(std::byte* s, int j, int scale, int min) {
  auto set = [&](int i, int v) { s[i] = static_cast<std::byte>(v); };
  auto get = [&](int i) { return std::to_integer<int>(s[i]); };
  if (j < 4) {
    set(j, (get(j) & 0xc0) | scale);
    set(j + 4, (get(j + 4) & 0xc0) | min);
  } else {
    set(j + 4, (scale & 15) | ((min & 15) << 4));
    set(j - 4, (get(j - 4) & 63) | ((scale >> 4) << 6));
    set(j, (get(j) & 63) | ((min >> 4) << 6));
  }
}

namespace {

// Q4_K / Q5_K (bits 4 or 5): values of one super-block.
void dequantize_k_minmax(const std::byte* blk, float* out, int bits) {
  const float d = read_scale(blk), dmin = read_scale(blk + 2);
  const std::byte* scales = blk + 4;
  const std::byte* qh = blk + 16;
  const std::byte* qs = blk + 16 + (bits == 5 ? 32 : 0);
  for (int j = 0; j < 8; ++j) {
    int sc = 0, m = 0;
    k_scale_min(scales, j, sc, m);
    const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
    for (int l = 0; l < 32; ++l) {
      const int byte = std::to_integer<int>(qs[32 * (j / 2) + l]);
      int q = j % 2 == 0 ? byte & 15 : byte >> 4;
      if (bits == 5) q |= ((std::to_integer<int>(qh[l]) >> j) & 1) << 4;
      out[32 * j + l] = d1 * static_cast<float>(q) - m1;
    }
  }
}

void quantize_k_minmax(const float* x, std::byte* blk, int bits) {
  const int qmax = (1 << bits) - 1;
  float scale[8], min[8];  // per sub-block: x ~ scale * q - min, min >= 0
  for (int j = 0; j < 8; ++j) {
    float lo = 0, hi = 0;
    for (int l = 0; l < 32; ++l) {
      lo = std::min(lo, x[32 * j + l]);
      hi = std::max(hi, x[32 * j + l]);
    }
    min[j] = -lo;
    scale[j] = (hi - lo) / static_cast<float>(qmax);
  }
  const float max_scale = *std::max_element(scale, scale + 8), max_min = *std::max_element(min, min + 8);
  const float d = max_scale / 63.0f, dmin = max_min / 63.0f;
  write_scale(blk, d);
  write_scale(blk + 2, dmin);
  const float df = read_scale(blk), dminf = read_scale(blk + 2);  // what the decoder will use
  std::byte* scales = blk + 4;
  std::memset(scales, 0, 12);
  std::byte* qh = blk + 16;
  std::byte* qs = blk + 16 + (bits == 5 ? 32 : 0);
  if (bits == 5) std::memset(qh, 0, 32);
  std::memset(qs, 0, 128);
  for (int j = 0; j < 8; ++j) {
    const int sc = df > 0 ? std::min(63, static_cast<int>(std::lround(scale[j] / df))) : 0;
    const int m = dminf > 0 ? std::min(63, static_cast<int>(std::lround(min[j] / dminf))) : 0;
    k_set_scale_min(scales, j, sc, m);
    const float step = df * static_cast<float>(sc), offset = dminf * static_cast<float>(m);
    for (int l = 0; l < 32; ++l) {
      const int q = step > 0 ? std::clamp(static_cast<int>(std::lround((x[32 * j + l] + offset) / step)), 0, qmax) : 0;
      std::byte& byte = qs[32 * (j / 2) + l];
      byte |= static_cast<std::byte>(j % 2 == 0 ? (q & 15) : (q & 15) << 4);
      if (bits == 5) qh[l] |= static_cast<std::byte>(((q >> 4) & 1) << j);
    }
  }
}

// Q6_K element e (< 256) of a super-block: its 6-bit code (0..63).
int q6_code(const std::byte* blk, int e) {
  const std::byte* ql = blk + 64 * (e / 128);
  const std::byte* qh = blk + 128 + 32 * (e / 128);
  const int p = e % 128, l = p % 32, quarter = p / 32;  // quarter: which 32 of the half
  const int low = std::to_integer<int>(ql[l + (quarter % 2) * 32]);
  const int nib = quarter < 2 ? low & 15 : low >> 4;
  return nib | (((std::to_integer<int>(qh[l]) >> (2 * quarter)) & 3) << 4);
}

}  // namespace

void dequantize_q4_k(const std::byte* blocks, float* out, std::size_t n) {
  for (std::size_t b = 0; b < n / 256; ++b) dequantize_k_minmax(blocks + b * 144, out + b * 256, 4);
}
void dequantize_q5_k(const std::byte* blocks, float* out, std::size_t n) {
  for (std::size_t b = 0; b < n / 256; ++b) dequantize_k_minmax(blocks + b * 176, out + b * 256, 5);
}
void dequantize_q6_k(const std::byte* blocks, float* out, std::size_t n) {
  for (std::size_t b = 0; b < n / 256; ++b) {
    const std::byte* blk = blocks + b * 210;
    const float d = read_scale(blk + 208);
    for (int e = 0; e < 256; ++e) {
      const int sc = static_cast<std::int8_t>(std::to_integer<int>(blk[192 + e / 16]));
      out[b * 256 + e] = d * static_cast<float>(sc) * static_cast<float>(q6_code(blk, e) - 32);
    }
  }
}

void quantize_q4_k(const float* x, std::byte* blocks, std::size_t n) {
  for (std::size_t b = 0; b < n / 256; ++b) quantize_k_minmax(x + b * 256, blocks + b * 144, 4);
}
void quantize_q5_k(const float* x, std::byte* blocks, std::size_t n) {
  for (std::size_t b = 0; b < n / 256; ++b) quantize_k_minmax(x + b * 256, blocks + b * 176, 5);
}
void quantize_q6_k(const float* x, std::byte* blocks, std::size_t n) {
  for (std::size_t b = 0; b < n / 256; ++b) {
    const float* v = x + b * 256;
    std::byte* blk = blocks + b * 210;
    std::memset(blk, 0, 210);
    float scale[16];  // per 16 values: x ~ scale * (q - 32), q - 32 in -32..31
    for (int j = 0; j < 16; ++j) {
      float amax = 0, max = 0;
      for (int l = 0; l < 16; ++l) {
        if (std::fabs(v[16 * j + l]) > amax) {
          amax = std::fabs(v[16 * j + l]);
          max = v[16 * j + l];
        }
      }
      scale[j] = max / -32.0f;
    }
    float amax = 0;
    for (float s : scale) amax = std::max(amax, std::fabs(s));
    write_scale(blk + 208, amax / 127.0f);
    const float d = read_scale(blk + 208);
    for (int j = 0; j < 16; ++j) {
      const int sc = d > 0 ? std::clamp(static_cast<int>(std::lround(scale[j] / d)), -128, 127) : 0;
      blk[192 + j] = static_cast<std::byte>(static_cast<std::uint8_t>(static_cast<std::int8_t>(sc)));
      const float step = d * static_cast<float>(sc);
      for (int l = 0; l < 16; ++l) {
        const int e = 16 * j + l;
        const int q = step != 0 ? std::clamp(static_cast<int>(std::lround(v[e] / step)), -32, 31) + 32 : 32;
        const int p = e % 128, ll = p % 32, quarter = p / 32;
        std::byte& low = blk[64 * (e / 128) + ll + (quarter % 2) * 32];
        low |= static_cast<std::byte>(quarter < 2 ? (q & 15) : (q & 15) << 4);
        blk[128 + 32 * (e / 128) + ll] |= static_cast<std::byte>((q >> 4) << (2 * quarter));
      }
    }
  }
}

void to_float(const std::byte* data, TensorType type, float* out, std::size_t n) {
  switch (type) {
    case TensorType::f32: std::memcpy(out, data, n * 4); return;
    case TensorType::f16:
      for (std::size_t i = 0; i < n; ++i) {
        std::uint16_t h;
        std::memcpy(&h, data + 2 * i, 2);
        out[i] = fp16_to_f32(h);
      }
      return;
    case TensorType::bf16:
      for (std::size_t i = 0; i < n; ++i) {
        std::uint16_t h;
        std::memcpy(&h, data + 2 * i, 2);
        out[i] = bf16_to_f32(h);
      }
      return;
    case TensorType::q8_0: dequantize_q8_0(data, out, n); return;
    case TensorType::q4_0: dequantize_q4_0(data, out, n); return;
    case TensorType::q4_k: dequantize_q4_k(data, out, n); return;
    case TensorType::q5_k: dequantize_q5_k(data, out, n); return;
    case TensorType::q6_k: dequantize_q6_k(data, out, n); return;
  }
}

// ---------------------------------------------------------------------------------------------
// Writer

namespace {
template <class T>
void put(std::vector<std::byte>& out, T v) {
  const auto* p = reinterpret_cast<const std::byte*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}
void put_string(std::vector<std::byte>& out, const std::string& s) {
  put<std::uint64_t>(out, s.size());
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  out.insert(out.end(), p, p + s.size());
}
}  // namespace

void Writer::add_string(const std::string& key, const std::string& value) {
  put_string(kv_, key);
  put(kv_, ValueType::string);
  put_string(kv_, value);
  ++kv_count_;
}
void Writer::add_u32(const std::string& key, std::uint32_t value) {
  put_string(kv_, key);
  put(kv_, ValueType::u32);
  put(kv_, value);
  ++kv_count_;
}
void Writer::add_i32(const std::string& key, std::int32_t value) {
  put_string(kv_, key);
  put(kv_, ValueType::i32);
  put(kv_, value);
  ++kv_count_;
}
void Writer::add_f32(const std::string& key, float value) {
  put_string(kv_, key);
  put(kv_, ValueType::f32);
  put(kv_, value);
  ++kv_count_;
}
void Writer::add_bool(const std::string& key, bool value) {
  put_string(kv_, key);
  put(kv_, ValueType::boolean);
  put<std::uint8_t>(kv_, value ? 1 : 0);
  ++kv_count_;
}
void Writer::add_strings(const std::string& key, const std::vector<std::string>& values) {
  put_string(kv_, key);
  put(kv_, ValueType::array);
  put(kv_, ValueType::string);
  put<std::uint64_t>(kv_, values.size());
  for (const std::string& s : values) put_string(kv_, s);
  ++kv_count_;
}
void Writer::add_i32s(const std::string& key, const std::vector<std::int32_t>& values) {
  put_string(kv_, key);
  put(kv_, ValueType::array);
  put(kv_, ValueType::i32);
  put<std::uint64_t>(kv_, values.size());
  for (std::int32_t v : values) put(kv_, v);
  ++kv_count_;
}

void Writer::add_tensor(const std::string& name, TensorType type, std::vector<std::int64_t> ne, std::vector<std::byte> data) {
  tensors_.push_back({name, type, std::move(ne), std::move(data)});
}

std::vector<std::byte> Writer::bytes() const {
  constexpr std::uint64_t kAlign = 32;
  auto pad = [](std::vector<std::byte>& out, std::uint64_t align) {
    while (out.size() % align != 0) out.push_back(std::byte{0});
  };
  std::vector<std::byte> out;
  put(out, kMagic);
  put<std::uint32_t>(out, 3);
  put<std::uint64_t>(out, tensors_.size());
  put<std::uint64_t>(out, kv_count_);
  out.insert(out.end(), kv_.begin(), kv_.end());
  std::uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    put_string(out, t.name);
    put<std::uint32_t>(out, static_cast<std::uint32_t>(t.ne.size()));
    for (std::int64_t d : t.ne) put<std::uint64_t>(out, static_cast<std::uint64_t>(d));
    put(out, t.type);
    put(out, offset);
    offset += (t.data.size() + kAlign - 1) / kAlign * kAlign;
  }
  pad(out, kAlign);
  for (const Tensor& t : tensors_) {
    out.insert(out.end(), t.data.begin(), t.data.end());
    pad(out, kAlign);
  }
  return out;
}

void Writer::write(const std::filesystem::path& path) const {
  // Streamed from the tensors held (no second copy of the file in memory) into a temporary file
  // beside `path`, renamed over it once complete: a failure leaves any previous file intact.
  constexpr std::uint64_t kAlign = 32;
  AtomicFile f(path, path.string());
  std::vector<std::byte> head;
  put(head, kMagic);
  put<std::uint32_t>(head, 3);
  put<std::uint64_t>(head, tensors_.size());
  put<std::uint64_t>(head, kv_count_);
  head.insert(head.end(), kv_.begin(), kv_.end());
  std::uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    put_string(head, t.name);
    put<std::uint32_t>(head, static_cast<std::uint32_t>(t.ne.size()));
    for (std::int64_t d : t.ne) put<std::uint64_t>(head, static_cast<std::uint64_t>(d));
    put(head, t.type);
    put(head, offset);
    offset += (t.data.size() + kAlign - 1) / kAlign * kAlign;
  }
  static const std::byte zeros[kAlign] = {};
  auto pad = [&](std::uint64_t size) { f.write(zeros, (kAlign - size % kAlign) % kAlign); };
  f.write(head.data(), head.size());
  pad(head.size());
  for (const Tensor& t : tensors_) {
    f.write(t.data.data(), t.data.size());
    pad(t.data.size());
  }
  f.commit();
}

}  // namespace kvslim::engine::gguf
