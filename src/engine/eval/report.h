// What `kvslim eval` shows: a terminal table (quality at each memory level, proxy vs faithful
// deltas, speed), a JSON document with every figure (keys documented in docs/results.md), and a
// gnuplot PNG of quality against resident KV bytes per token, one line per method variant.
#pragma once
#include <cstdio>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/eval/evaluator.h"

namespace kvslim::engine::eval {

// The JSON document (schema "kvslim-eval/1").
nlohmann::json to_json(const EvalResults& results);
// Writes to_json(results) to `path`; throws std::runtime_error naming the file when it cannot.
void write_json(const std::filesystem::path& path, const EvalResults& results);

void print_table(std::FILE* out, const EvalResults& results);
// A summary that fits 100 columns (what `make run` shows in a terminal): per point, bytes per
// token, KL and top-1 at the longest out-of-domain context, up to two retrieval tasks, speed.
void print_summary(std::FILE* out, const EvalResults& results);

// Writes `path` (PNG) with gnuplot: top-1 agreement at the longest text context and retrieval
// accuracy, each against resident KV bytes per token. Returns false (and says why in `why`) when
// gnuplot is not installed or fails; the table and JSON do not depend on it.
bool write_plot(const std::filesystem::path& path, const EvalResults& results, std::string& why);

}  // namespace kvslim::engine::eval
