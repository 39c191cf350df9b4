#include "cli/option_checks.h"

#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <stdexcept>

#include "engine/output_file.h"

namespace kvslim::cli {

CLI::Validator finite_range(double lo, double hi) {
  const std::string range = "[" + CLI::detail::to_string(lo) + ", " + CLI::detail::to_string(hi) + "]";
  return CLI::Validator(
      [lo, hi, range](std::string& text) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(text, v) || !std::isfinite(v)) return "'" + text + "' is not a finite number";
        if (v < lo || v > hi) return "'" + text + "' is outside " + range;
        return {};
      },
      "NUMBER in " + range);
}

void refuse_negative_unsigned(CLI::App& app) {
  const CLI::Validator non_negative(
      [](std::string& text) -> std::string {
        if (text.find('-') != std::string::npos) return "'" + text + "': expected a non-negative integer";
        // strtoull saturates: 2^64 and above read as 2^64 - 1 without a word (issue 26).
        std::uint64_t v = 0;
        const char* b = text.data();
        while (b < text.data() + text.size() && (*b == ' ' || *b == '+')) ++b;
        if (std::from_chars(b, text.data() + text.size(), v).ec == std::errc::result_out_of_range) {
          return "'" + text + "' is larger than the largest value, 18446744073709551615";
        }
        return {};
      },
      "", "non-negative");
  for (CLI::Option* opt : app.get_options()) {
    if (opt->get_type_name() == "UINT") opt->check(non_negative);
  }
  for (CLI::App* sub : app.get_subcommands({})) refuse_negative_unsigned(*sub);
}

void check_output_path(const std::string& path, const std::string& flag) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  std::error_code ec;
  if (fs::is_directory(p, ec)) throw std::invalid_argument(flag + " " + path + ": is a directory, expected a file");
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (!fs::is_directory(dir, ec)) {
    throw std::invalid_argument(flag + " " + path + ": directory " + dir.string() + " does not exist");
  }
  if (fs::exists(p, ec) ? ::access(p.c_str(), W_OK) != 0 : ::access(dir.c_str(), W_OK | X_OK) != 0) {
    throw std::invalid_argument(flag + " " + path + ": cannot be written (permission denied)");
  }
}

void write_json_output(const std::string& path, const std::string& text, const std::string& flag) {
  engine::write_file_atomically(path, text + "\n", flag + " " + path);
}

void check_outputs(const std::vector<FlagPath>& outputs, const std::vector<FlagPath>& inputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const FlagPath& out = outputs[i];
    if (out.path.empty()) continue;
    for (const FlagPath& in : inputs) {
      if (!in.path.empty() && engine::same_file(out.path, in.path)) {
        throw std::invalid_argument(out.flag + " " + out.path + ": is an input (" + in.flag + " " + in.path +
                                    "); refusing to overwrite it, choose another output");
      }
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (!outputs[j].path.empty() && engine::same_file(out.path, outputs[j].path)) {
        throw std::invalid_argument(out.flag + " " + out.path + ": the same file as " + outputs[j].flag + " " + outputs[j].path);
      }
    }
    check_output_path(out.path, out.flag);
  }
}

std::vector<FlagPath> model_inputs(const std::string& model, const std::string& flag) {
  std::vector<FlagPath> out;
  for (const auto& p : engine::model_input_files(model)) out.push_back({p.string(), flag});
  return out;
}

void check_output_dir(const std::string& dir, const std::string& flag, bool force) {
  namespace fs = std::filesystem;
  const fs::path p(dir);
  std::error_code ec;
  const fs::file_status st = fs::status(p, ec);
  if (fs::exists(st)) {
    if (!fs::is_directory(st)) throw std::invalid_argument(flag + " " + dir + ": exists and is not a directory");
    if (!fs::is_empty(p, ec) && !force) {
      throw std::invalid_argument(flag + " " + dir + ": the directory is not empty (it may hold a model); pass --force to replace its model files");
    }
    if (::access(p.c_str(), W_OK | X_OK) != 0) throw std::invalid_argument(flag + " " + dir + ": cannot be written (permission denied)");
    return;
  }
  // Missing parents are created (mkdir -p): the nearest existing ancestor must be a writable directory.
  fs::path parent = fs::absolute(p, ec).parent_path();
  while (!parent.empty() && !fs::exists(parent, ec) && parent != parent.root_path()) parent = parent.parent_path();
  if (!fs::is_directory(parent, ec)) throw std::invalid_argument(flag + " " + dir + ": " + parent.string() + " is not a directory");
  if (::access(parent.c_str(), W_OK | X_OK) != 0) throw std::invalid_argument(flag + " " + dir + ": cannot be created (permission denied)");
}

}  // namespace kvslim::cli
