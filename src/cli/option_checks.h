// Checks shared by the subcommands' flags, so a careless value gets a one-line error naming the
// flag before any work starts (issue 13: NaN through CLI::Range, -1 wrapping in unsigned flags,
// an unwritable --json found only after an hour-long evaluation).
#pragma once
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace kvslim::cli {

// A number in [lo, hi]; unlike CLI::Range it refuses NaN.
CLI::Validator finite_range(double lo, double hi);

// Adds a check to every unsigned option under `app` (CLI11 type name "UINT"): CLI11 reads them
// with strtoull, which takes "-1" as 2^64 - 1. main() applies it to every command.
void refuse_negative_unsigned(CLI::App& app);

// Throws std::invalid_argument naming `flag` unless `path` can be created or overwritten: its
// directory exists and is writable, and the path is not a directory. Creates nothing.
void check_output_path(const std::string& path, const std::string& flag);

// Writes `text` + "\n" to `path` atomically (engine/output_file.h); errors name `flag`.
void write_json_output(const std::string& path, const std::string& text, const std::string& flag);

// A path with the flag (or argument) it came from, for the checks below.
struct FlagPath {
  std::string path, flag;
};

// Before any work (issue 26): every output passes check_output_path, no output is the same file as
// an input (hard links and symlinks included) and no two outputs are the same file. Throws
// std::invalid_argument naming both flags.
void check_outputs(const std::vector<FlagPath>& outputs, const std::vector<FlagPath>& inputs);

// The files a model reads (engine::model_input_files), each named with `flag`.
std::vector<FlagPath> model_inputs(const std::string& model, const std::string& flag = "--model");

// A directory that a command fills with files: it may not exist yet (its parent must), or be an
// empty directory; a non-empty one is refused unless `force`. Throws naming `flag`.
void check_output_dir(const std::string& dir, const std::string& flag, bool force);

}  // namespace kvslim::cli
