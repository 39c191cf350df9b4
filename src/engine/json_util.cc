#include "engine/json_util.h"
#include "engine/model_file_limits.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace kvslim::engine::json_util {

std::string read_text_file(const std::filesystem::path& path, std::uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever. The type
  // and size are checked on the open descriptor, so a file swapped after a stat cannot slip by.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw ModelFileError(path.string() + ": cannot open file (" + std::strerror(errno) + ")");
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw ModelFileError(path.string() + ": cannot stat (" + std::strerror(errno) + ")");
  if (!S_ISREG(st.st_mode)) {
    const char* kind = S_ISDIR(st.st_mode) ? "a directory" : S_ISFIFO(st.st_mode) ? "a FIFO"
                       : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device" : "not a regular file";
    throw ModelFileError(path.string() + ": is " + kind + ", expected a regular file");
  }
  auto too_large = [&](std::uint64_t size) {
    return ModelFileError(path.string() + ": " + std::to_string(size) + " bytes is larger than the limit of " +
                          std::to_string(max_bytes) + " bytes for this file");
  };
  if (static_cast<std::uint64_t>(st.st_size) > max_bytes) throw too_large(static_cast<std::uint64_t>(st.st_size));
  // Read at most max_bytes + 1 whatever the size said (a file that grows while read, /proc files).
  std::string text;
  text.resize(static_cast<std::size_t>(st.st_size));
  std::size_t have = 0;
  for (;;) {
    if (have == text.size()) {
      if (text.size() > max_bytes) throw too_large(text.size());
      text.resize(std::min<std::uint64_t>(max_bytes + 1, std::max<std::size_t>(text.size() * 2, 4096)));
    }
    const ssize_t n = ::read(fd, text.data() + have, text.size() - have);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw ModelFileError(path.string() + ": read error (" + std::strerror(errno) + ")");
    }
    if (n == 0) break;
    have += static_cast<std::size_t>(n);
  }
  text.resize(have);
  return text;
}

Json parse(std::string_view text, std::string_view source) {
  // Nesting is bounded before the parser sees the text (engine/model_file_limits.h): one linear
  // pass over brackets outside strings.
  int depth = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limits::kJsonDepth) {
        throw ModelFileError(std::string(source) + ": JSON nested deeper than " + std::to_string(limits::kJsonDepth) +
                             " levels (at byte " + std::to_string(i) + "); no model file needs that many");
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {  // parse_error, and out_of_range for numbers like 1e999
    throw ModelFileError(std::string(source) + ": invalid JSON (" + e.what() + ")");
  }
}

void check_sequence_depth(int depth, const Where& where) {
  if (depth > limits::kTokenizerSequenceDepth) {
    fail(where, "Sequence nested deeper than " + std::to_string(limits::kTokenizerSequenceDepth) + " levels");
  }
}

Where Where::field(std::string_view key) const {
  return Where{source, path.empty() ? std::string(key) : path + "." + std::string(key)};
}

Where Where::index(std::size_t i) const {
  return Where{source, path + "[" + std::to_string(i) + "]"};
}

std::string Where::describe() const {
  if (path.empty()) return std::string(source) + ": top level";
  return std::string(source) + ": field '" + path + "'";
}

void fail(const Where& where, std::string_view what) {
  throw ModelFileError(where.describe() + ": " + std::string(what));
}

const char* type_name(const Json& value) { return value.type_name(); }

const Json* find(const Json& obj, std::string_view key, const Where& where) {
  if (!obj.is_object()) fail(where, std::string("expected an object, found ") + type_name(obj));
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

const Json& require(const Json& obj, std::string_view key, const Where& where) {
  const Json* value = find(obj, key, where);
  if (value == nullptr) fail(where.field(key), "required field is missing");
  return *value;
}

std::string as_string(const Json& value, const Where& where) {
  if (!value.is_string()) fail(where, std::string("expected a string, found ") + type_name(value));
  return value.get<std::string>();
}

bool as_bool(const Json& value, const Where& where) {
  if (!value.is_boolean()) fail(where, std::string("expected true/false, found ") + type_name(value));
  return value.get<bool>();
}

std::int64_t as_int(const Json& value, const Where& where) {
  if (value.is_number_unsigned()) {
    const auto u = value.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(INT64_MAX)) fail(where, "integer out of range");
    return static_cast<std::int64_t>(u);
  }
  if (value.is_number_integer()) return value.get<std::int64_t>();
  fail(where, std::string("expected an integer, found ") + type_name(value));
}

double as_number(const Json& value, const Where& where) {
  if (!value.is_number()) fail(where, std::string("expected a number, found ") + type_name(value));
  return value.get<double>();
}

const Json& as_object(const Json& value, const Where& where) {
  if (!value.is_object()) fail(where, std::string("expected an object, found ") + type_name(value));
  return value;
}

const Json& as_array(const Json& value, const Where& where) {
  if (!value.is_array()) fail(where, std::string("expected an array, found ") + type_name(value));
  return value;
}

std::string get_string(const Json& obj, std::string_view key, const Where& where, std::string fallback) {
  const Json* value = find(obj, key, where);
  return value ? as_string(*value, where.field(key)) : std::move(fallback);
}

bool get_bool(const Json& obj, std::string_view key, const Where& where, bool fallback) {
  const Json* value = find(obj, key, where);
  return value ? as_bool(*value, where.field(key)) : fallback;
}

}  // namespace kvslim::engine::json_util
