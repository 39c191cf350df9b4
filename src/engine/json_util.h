// Checked access to nlohmann::json values for the model-file loaders: every failure becomes a
// ModelFileError naming the file and the field path ("model.vocab", "rope_parameters.factor").
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "engine/model_file_error.h"

namespace kvslim::engine::json_util {

using Json = nlohmann::json;

// Reads a whole regular file of at most `max_bytes` (engine/model_file_limits.h); throws
// ModelFileError naming it when it cannot be read, is not a regular file (a FIFO, a device such as
// /dev/zero, a directory; links are followed) or is larger. Never blocks on a FIFO.
std::string read_text_file(const std::filesystem::path& path, std::uint64_t max_bytes);

// Parses JSON text; `source` names the file in the error message.
Json parse(std::string_view text, std::string_view source);

// Where a value sits: the file and the dotted field path, for error messages.
struct Where {
  std::string_view source;  // file name
  std::string path;         // field path inside the file; empty for the root
  Where field(std::string_view key) const;
  Where index(std::size_t i) const;
  std::string describe() const;  // "<file>: field 'a.b'"
};

[[noreturn]] void fail(const Where& where, std::string_view what);

// Fails naming `where` when a Sequence step sits deeper than limits::kTokenizerSequenceDepth.
void check_sequence_depth(int depth, const Where& where);

const char* type_name(const Json& value);

// The member `key` of object `obj` (which must be an object), or nullptr when absent.
// A member that is JSON null counts as absent.
const Json* find(const Json& obj, std::string_view key, const Where& where);
const Json& require(const Json& obj, std::string_view key, const Where& where);

// Typed conversions; they fail with the field's name and the expected type.
std::string as_string(const Json& value, const Where& where);
bool as_bool(const Json& value, const Where& where);
std::int64_t as_int(const Json& value, const Where& where);  // integral JSON numbers only
double as_number(const Json& value, const Where& where);      // any JSON number
const Json& as_object(const Json& value, const Where& where);
const Json& as_array(const Json& value, const Where& where);

// Optional members with defaults.
std::string get_string(const Json& obj, std::string_view key, const Where& where, std::string fallback);
bool get_bool(const Json& obj, std::string_view key, const Where& where, bool fallback);

}  // namespace kvslim::engine::json_util
