// Checks shared by the subcommands' flags, so a careless value gets a one-line error naming the
// flag before any work starts (issue 13: NaN through CLI::Range, -1 wrapping in unsigned flags,
// an unwritable --json found only after an hour-long evaluation).
#pragma once
#include <CLI/CLI.hpp>
#include <string>

namespace kvslim::cli {

// A number in [lo, hi]; unlike CLI::Range it refuses NaN.
CLI::Validator finite_range(double lo, double hi);

// Adds a check to every unsigned option under `app` (CLI11 type name "UINT"): CLI11 reads them
// with strtoull, which takes "-1" as 2^64 - 1. main() applies it to every command.
void refuse_negative_unsigned(CLI::App& app);

// Throws std::invalid_argument naming `flag` unless `path` can be created or overwritten: its
// directory exists and is writable, and the path is not a directory. Creates nothing.
void check_output_path(const std::string& path, const std::string& flag);

}  // namespace kvslim::cli
