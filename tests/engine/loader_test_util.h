// Helpers for the model-loader tests: a temporary directory and a safetensors writer.
#pragma once
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/model_file_error.h"

namespace kvslim::engine::testing {

// Runs `fn`, expects a ModelFileError whose message contains every fragment.
template <class Fn>
void expect_error(Fn&& fn, std::initializer_list<std::string> fragments) {
  try {
    fn();
    ADD_FAILURE() << "expected ModelFileError";
  } catch (const ModelFileError& e) {
    const std::string msg = e.what();
    for (const std::string& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
  }
}

// A fresh directory under the system temp dir, removed with its contents on destruction.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() /
            ("kvslim_loader_test_" + std::to_string(rd()) + "_" + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

// The repository root the tests read shipped files from (ctest sets KVSLIM_SOURCE_DIR).
inline std::filesystem::path source_dir() {
  const char* env = std::getenv("KVSLIM_SOURCE_DIR");
  return env != nullptr ? std::filesystem::path(env) : std::filesystem::path(".");
}

inline void write_file(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// One tensor for make_safetensors: dtype as written in the header, shape and raw bytes.
struct RawTensor {
  std::string name, dtype;
  std::vector<std::int64_t> shape;
  std::string bytes;
};

template <class T>
std::string bytes_of(const std::vector<T>& values) {
  std::string s(values.size() * sizeof(T), '\0');
  std::memcpy(s.data(), values.data(), s.size());
  return s;
}

// Header JSON text for tensors laid out back to back (plus optional metadata).
inline std::string header_json(const std::vector<RawTensor>& tensors, const nlohmann::json& metadata = nullptr) {
  nlohmann::json header = nlohmann::json::object();
  std::size_t offset = 0;
  for (const RawTensor& t : tensors) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  if (!metadata.is_null()) header["__metadata__"] = metadata;
  return header.dump();
}

// A whole file: u64 LE length, header (space-padded to `pad_to` bytes), data.
inline std::string make_safetensors_from_header(std::string header, const std::string& data, std::size_t pad_to = 8) {
  while ((8 + header.size()) % pad_to != 0) header += ' ';
  std::string file(8, '\0');
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return file + header + data;
}

inline std::string make_safetensors(const std::vector<RawTensor>& tensors, const nlohmann::json& metadata = nullptr) {
  std::string data;
  for (const RawTensor& t : tensors) data += t.bytes;
  return make_safetensors_from_header(header_json(tensors, metadata), data);
}

}  // namespace kvslim::engine::testing
