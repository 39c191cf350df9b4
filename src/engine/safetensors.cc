#include "engine/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "engine/json_util.h"
#include "engine/model_file_limits.h"

namespace kvslim::engine {
namespace {

using json_util::Json;
using json_util::Where;

constexpr std::string_view kSingleFile = "model.safetensors";
constexpr std::string_view kIndexFile = "model.safetensors.index.json";

std::string shape_string(std::span<const std::int64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

bool parse_dtype(std::string_view name, WeightType& type) {
  if (name == "F32") type = WeightType::f32;
  else if (name == "F16") type = WeightType::f16;
  else if (name == "BF16") type = WeightType::bf16;
  else return false;
  return true;
}

// A read-only mmap of a whole file, unmapped on destruction.
class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path) : path_(path.string()) {
    // O_NONBLOCK: a FIFO in place of a shard fails the regular-file check below instead of
    // blocking the open until a writer appears.
    const int fd = ::open(path_.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) throw ModelFileError(path_ + ": cannot open (" + std::strerror(errno) + ")");
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      throw ModelFileError(path_ + ": cannot stat (" + std::strerror(err) + ")");
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      throw ModelFileError(path_ + ": not a regular file (a FIFO, device or directory)");
    }
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        throw ModelFileError(path_ + ": mmap failed (" + std::strerror(err) + ")");
      }
      data_ = p;
    }
    ::close(fd);  // the mapping stays valid without the descriptor
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(data_, size_);
  }
  std::span<const std::byte> bytes() const {
    return {static_cast<const std::byte*>(data_), size_};
  }

 private:
  std::string path_;
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

// Checked product of a shape's dimensions times the element size; false on overflow.
bool checked_nbytes(std::span<const std::int64_t> shape, std::size_t element_size, std::uint64_t& out) {
  std::uint64_t n = element_size;
  for (std::int64_t d : shape) {
    const auto u = static_cast<std::uint64_t>(d);
    if (u != 0 && n > UINT64_MAX / u) return false;
    n *= u;
  }
  out = n;
  return true;
}

// Rejects shard names that would leave the model directory.
void check_shard_name(const std::string& shard, const std::string& index_file, const std::string& tensor) {
  const std::filesystem::path p(shard);
  bool ok = !shard.empty() && p.is_relative();
  for (const auto& part : p) ok = ok && part != "..";
  if (!ok) {
    throw ModelFileError(index_file + ": weight_map['" + tensor + "']: shard name '" + shard +
                         "' must be a file name inside the model directory");
  }
}

}  // namespace

std::size_t weight_type_size(WeightType type) {
  switch (type) {
    case WeightType::f32: return 4;
    case WeightType::f16: return 2;
    case WeightType::bf16: return 2;
    case WeightType::q8_0: return 34;
    case WeightType::q4_0: case WeightType::q4_0x16: return 18;
    case WeightType::q4_k: return 144;
    case WeightType::q4_kx16: return 148;
    case WeightType::q5_k: return 176;
    case WeightType::q6_k: case WeightType::q6_kx16: return 210;
  }
  return 0;
}

std::size_t weight_block_elements(WeightType type) {
  switch (type) {
    case WeightType::f32: case WeightType::f16: case WeightType::bf16: return 1;
    case WeightType::q8_0: case WeightType::q4_0: case WeightType::q4_0x16: return 32;
    case WeightType::q4_k: case WeightType::q5_k: case WeightType::q6_k: case WeightType::q4_kx16: case WeightType::q6_kx16: return 256;
  }
  return 1;
}

const char* weight_type_name(WeightType type) {
  switch (type) {
    case WeightType::f32: return "F32";
    case WeightType::f16: return "F16";
    case WeightType::bf16: return "BF16";
    case WeightType::q8_0: return "Q8_0";
    case WeightType::q4_0: return "Q4_0";
    case WeightType::q4_k: return "Q4_K";
    case WeightType::q5_k: return "Q5_K";
    case WeightType::q6_k: return "Q6_K";
    case WeightType::q4_0x16: return "Q4_0x16";
    case WeightType::q4_kx16: return "Q4_Kx16";
    case WeightType::q6_kx16: return "Q6_Kx16";
  }
  return "?";
}

SafetensorsHeader parse_safetensors_header(std::span<const std::byte> file_bytes,
                                           const std::string& file_name) {
  if (file_bytes.size() < 8) {
    throw ModelFileError(file_name + ": truncated file: " + std::to_string(file_bytes.size()) +
                         " bytes, need at least 8 for the header length");
  }
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | std::to_integer<std::uint64_t>(file_bytes[i]);
  const std::uint64_t available = file_bytes.size() - 8;
  if (header_len > available) {
    throw ModelFileError(file_name + ": header length " + std::to_string(header_len) +
                         " runs past the end of the file (" + std::to_string(available) +
                         " bytes after the length field)");
  }
  if (header_len > limits::kSafetensorsHeaderBytes) {
    throw ModelFileError(file_name + ": header length " + std::to_string(header_len) + " is larger than the limit of " +
                         std::to_string(limits::kSafetensorsHeaderBytes) + " bytes");
  }
  const auto* header_begin = reinterpret_cast<const char*>(file_bytes.data() + 8);
  const std::string_view header_text(header_begin, static_cast<std::size_t>(header_len));
  const Json header = json_util::parse(header_text, file_name + " (header)");
  const Where root{file_name, ""};
  if (!header.is_object()) json_util::fail(root, std::string("header must be a JSON object, found ") + header.type_name());

  const std::span<const std::byte> data = file_bytes.subspan(8 + static_cast<std::size_t>(header_len));
  SafetensorsHeader result;
  struct Range {
    std::uint64_t begin, end;
    std::size_t tensor;
  };
  std::vector<Range> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      const Where where = root.field(name);
      if (it->is_null()) continue;
      json_util::as_object(*it, where);
      for (auto m = it->begin(); m != it->end(); ++m) {
        result.metadata[m.key()] = json_util::as_string(*m, where.field(m.key()));
      }
      continue;
    }
    const std::string who = file_name + ": tensor '" + name + "'";
    if (!it->is_object()) throw ModelFileError(who + ": expected an object, found " + it->type_name());
    const Where where{file_name, "tensor '" + name + "'"};

    TensorInfo info;
    info.name = name;
    info.file = file_name;
    const std::string dtype = json_util::as_string(json_util::require(*it, "dtype", where), where.field("dtype"));
    if (!parse_dtype(dtype, info.type)) {
      throw ModelFileError(who + ": unsupported dtype '" + dtype + "' (supported: F32, F16, BF16)");
    }
    const Json& shape = json_util::as_array(json_util::require(*it, "shape", where), where.field("shape"));
    for (std::size_t d = 0; d < shape.size(); ++d) {
      const std::int64_t dim = json_util::as_int(shape[d], where.field("shape").index(d));
      if (dim < 0) throw ModelFileError(who + ": negative dimension " + std::to_string(dim) + " in shape");
      info.shape.push_back(dim);
    }
    const Json& offsets = json_util::as_array(json_util::require(*it, "data_offsets", where),
                                              where.field("data_offsets"));
    if (offsets.size() != 2) {
      throw ModelFileError(who + ": data_offsets must be [begin, end], found " + std::to_string(offsets.size()) + " values");
    }
    const std::int64_t begin = json_util::as_int(offsets[0], where.field("data_offsets").index(0));
    const std::int64_t end = json_util::as_int(offsets[1], where.field("data_offsets").index(1));
    if (begin < 0 || end < begin) {
      throw ModelFileError(who + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                           "] are not an ordered range");
    }
    if (static_cast<std::uint64_t>(end) > data.size()) {
      throw ModelFileError(who + ": data_offsets end " + std::to_string(end) + " is past the end of the data (" +
                           std::to_string(data.size()) + " bytes; file truncated?)");
    }
    std::uint64_t expected = 0;
    if (!checked_nbytes(info.shape, weight_type_size(info.type), expected) ||
        expected != static_cast<std::uint64_t>(end - begin)) {
      throw ModelFileError(who + ": shape " + shape_string(info.shape) + " x " + dtype + " needs " +
                           std::to_string(expected) + " bytes but data_offsets span " + std::to_string(end - begin));
    }
    info.nbytes = static_cast<std::size_t>(end - begin);
    info.data = data.data() + begin;
    ranges.push_back({static_cast<std::uint64_t>(begin), static_cast<std::uint64_t>(end), result.tensors.size()});
    result.tensors.push_back(std::move(info));
  }

  // Ordered, non-overlapping: sorted by start, each non-empty tensor must begin at or after the
  // end of every non-empty tensor before it.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const Range* furthest = nullptr;  // the non-empty range seen so far that ends last
  for (const Range& cur : ranges) {
    if (cur.end == cur.begin) continue;
    if (furthest != nullptr && cur.begin < furthest->end) {
      throw ModelFileError(file_name + ": tensor '" + result.tensors[cur.tensor].name + "' data_offsets [" +
                           std::to_string(cur.begin) + ", " + std::to_string(cur.end) + "] overlap tensor '" +
                           result.tensors[furthest->tensor].name + "' [" + std::to_string(furthest->begin) + ", " +
                           std::to_string(furthest->end) + "]");
    }
    if (furthest == nullptr || cur.end > furthest->end) furthest = &cur;
  }
  return result;
}

// ---------------------------------------------------------------------------------------------
// WeightStore

struct WeightStore::State {
  std::vector<std::unique_ptr<MappedFile>> files;
  std::vector<std::unique_ptr<std::byte[]>> aligned_copies;  // tensors whose offset was misaligned
  std::unordered_map<std::string, TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  std::vector<std::string> file_names;
  std::shared_ptr<const void> owner;  // from_tensors: what keeps their data alive

  // Maps one file and adds its tensors. `wanted` (if non-null) is the set of tensors the index
  // assigns to this file: each must be present, and only those are taken.
  void add_file(const std::filesystem::path& path, const std::set<std::string>* wanted) {
    const std::string file_name = path.string();
    if (!std::filesystem::exists(path)) throw ModelFileError(file_name + ": file not found");
    auto mapped = std::make_unique<MappedFile>(path);
    SafetensorsHeader header = parse_safetensors_header(mapped->bytes(), file_name);
    for (auto& [key, value] : header.metadata) metadata.emplace(key, value);
    std::set<std::string> seen;
    for (TensorInfo& info : header.tensors) {
      if (wanted != nullptr && !wanted->contains(info.name)) continue;  // not assigned to this shard
      seen.insert(info.name);
      const std::size_t align = weight_type_size(info.type);
      if (info.nbytes > 0 && reinterpret_cast<std::uintptr_t>(info.data) % align != 0) {
        // safetensors does not promise alignment; keep the API's "aligned" promise with a copy.
        auto copy = std::make_unique<std::byte[]>(info.nbytes);
        std::memcpy(copy.get(), info.data, info.nbytes);
        info.data = copy.get();
        aligned_copies.push_back(std::move(copy));
      }
      auto [pos, inserted] = tensors.emplace(info.name, info);
      if (!inserted) {
        throw ModelFileError(file_name + ": tensor '" + info.name + "' is also in " + pos->second.file);
      }
    }
    if (wanted != nullptr) {
      for (const std::string& name : *wanted) {
        if (!seen.contains(name)) {
          throw ModelFileError(file_name + ": tensor '" + name + "' is listed in the weight_map for this shard but is not in it");
        }
      }
    }
    files.push_back(std::move(mapped));
    file_names.push_back(file_name);
  }
};

WeightStore::WeightStore() : state_(std::make_unique<State>()) {}
WeightStore::WeightStore(WeightStore&&) noexcept = default;
WeightStore& WeightStore::operator=(WeightStore&&) noexcept = default;
WeightStore::~WeightStore() = default;

WeightStore WeightStore::open(const std::filesystem::path& model_dir) {
  WeightStore store;
  State& state = *store.state_;
  std::error_code ec;
  if (std::filesystem::is_regular_file(model_dir, ec)) {
    state.add_file(model_dir, nullptr);
    return store;
  }
  if (!std::filesystem::is_directory(model_dir, ec)) {
    throw ModelFileError(model_dir.string() + ": model directory not found");
  }
  const std::filesystem::path single = model_dir / kSingleFile;
  const std::filesystem::path index = model_dir / kIndexFile;
  if (std::filesystem::exists(single, ec)) {
    state.add_file(single, nullptr);
    return store;
  }
  if (!std::filesystem::exists(index, ec)) {
    throw ModelFileError(model_dir.string() + ": neither " + std::string(kSingleFile) + " nor " +
                         std::string(kIndexFile) + " found");
  }
  const std::string index_name = index.string();
  const Json doc = json_util::parse(json_util::read_text_file(index, limits::kIndexJsonBytes), index_name);
  const Where root{index_name, ""};
  const Json& weight_map = json_util::as_object(json_util::require(doc, "weight_map", root), root.field("weight_map"));
  std::map<std::string, std::set<std::string>> by_shard;  // shard file -> tensors it must hold
  for (auto it = weight_map.begin(); it != weight_map.end(); ++it) {
    const std::string shard = json_util::as_string(*it, root.field("weight_map").field(it.key()));
    check_shard_name(shard, index_name, it.key());
    by_shard[shard].insert(it.key());
  }
  if (by_shard.empty()) json_util::fail(root.field("weight_map"), "lists no tensors");
  for (const auto& [shard, names] : by_shard) {
    const std::filesystem::path shard_path = model_dir / shard;
    if (!std::filesystem::exists(shard_path, ec)) {
      throw ModelFileError(index_name + ": shard '" + shard + "' (holding e.g. tensor '" + *names.begin() +
                           "') is missing: " + shard_path.string() + " not found");
    }
    state.add_file(shard_path, &names);
  }
  return store;
}

WeightStore WeightStore::from_tensors(std::vector<TensorInfo> tensors, std::shared_ptr<const void> owner) {
  WeightStore store;
  State& state = *store.state_;
  state.owner = std::move(owner);
  std::set<std::string> files;
  for (TensorInfo& info : tensors) {
    files.insert(info.file);
    const std::string name = info.name;
    if (!state.tensors.emplace(name, std::move(info)).second) {
      throw ModelFileError("tensor '" + name + "' appears twice");
    }
  }
  state.file_names.assign(files.begin(), files.end());
  return store;
}

bool WeightStore::has(std::string_view name) const { return find(name) != nullptr; }

const TensorInfo* WeightStore::find(std::string_view name) const {
  if (!state_) return nullptr;  // moved-from
  auto it = state_->tensors.find(std::string(name));
  return it == state_->tensors.end() ? nullptr : &it->second;
}

const TensorInfo& WeightStore::get(std::string_view name, std::span<const std::int64_t> expected_shape) const {
  const TensorInfo* info = find(name);
  if (info == nullptr) {
    std::string files;
    if (state_) {
      for (const std::string& f : state_->file_names) files += (files.empty() ? "" : ", ") + f;
    }
    throw ModelFileError("tensor '" + std::string(name) + "' not found in " +
                         (files.empty() ? std::string("an empty weight store") : files));
  }
  if (!std::equal(info->shape.begin(), info->shape.end(), expected_shape.begin(), expected_shape.end())) {
    throw ModelFileError(info->file + ": tensor '" + info->name + "' has shape " + shape_string(info->shape) +
                         ", expected " + shape_string(expected_shape));
  }
  return *info;
}

std::vector<std::string> WeightStore::names() const {
  std::vector<std::string> out;
  if (!state_) return out;
  out.reserve(state_->tensors.size());
  for (const auto& [name, info] : state_->tensors) out.push_back(name);
  std::sort(out.begin(), out.end());
  return out;
}

std::size_t WeightStore::size() const { return state_ ? state_->tensors.size() : 0; }

const std::map<std::string, std::string>& WeightStore::metadata() const {
  static const std::map<std::string, std::string> kEmpty;
  return state_ ? state_->metadata : kEmpty;
}

}  // namespace kvslim::engine
