#include "cli/option_checks.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <stdexcept>

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

}  // namespace kvslim::cli
