// `kvslim eval`: what each KV method costs, at equal memory, on a real model. Text fidelity and
// retrieval against the full cache at several memory levels, decode speed at the longest context;
// a terminal table, --json and a gnuplot --plot. Protocol and results: docs/results.md.
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli/command.h"
#include "cli/option_checks.h"
#include <nlohmann/json.hpp>

#include "engine/eval/evaluator.h"
#include "engine/eval/method_grid.h"
#include "engine/eval/report.h"
#include "engine/gguf_model.h"
#include "engine/model.h"
#include "engine/output_file.h"
#include "engine/text_input.h"
#include "engine/tokenizer.h"

namespace kvslim::cli {
namespace {

using namespace kvslim::engine;
using namespace kvslim::engine::eval;

struct Options {
  std::string model, preset = "quick", methods, text, json, plot, table, dump_episodes;
  bool wide = false;
  std::vector<double> levels, depths;
  std::vector<std::size_t> contexts, lengths;
  std::vector<std::string> tasks, settings;
  std::size_t turns = 0;
  std::size_t windows = 0, continuation = 0, trials = 0;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::uint64_t seed = 7;
  bool no_progress = false, list = false, no_speed = false;
};

// The held-out text: bounded and checked (engine/text_input.h); `flag` names where it came from.
std::string read_text(const std::filesystem::path& path, const std::string& flag) {
  std::error_code ec;
  if (flag != "--text" && !std::filesystem::exists(path, ec)) {
    throw std::runtime_error("held-out text " + path.string() +
                             ": not found (pass --text FILE, or put heldout_sample.txt in the model directory)");
  }
  const std::string text = read_text_input(path.string(), flag);
  if (text.empty()) throw std::runtime_error(flag + " " + path.string() + ": the file is empty");
  return text;
}

// The run's retrieval episodes as JSON lines (token ids and texts), for the same episodes through
// another engine (bench/cuda/hf_retrieval.py runs them through transformers with kvslim.hf).
int dump_episodes(const std::string& path, const EvalOptions& e, const EpisodeMaker& maker) {
  std::string out;
  for (const GridEpisode& g : make_episodes(e, maker)) {
    const Episode& ep = g.episode;
    nlohmann::json j;
    j["task"] = ep.task;
    j["length"] = e.retrieval_lengths[g.length_index];
    j["depth"] = e.depths[g.depth_index];
    j["prompt"] = ep.prompt;  // [bos] + the document and the question
    j["question_start"] = ep.question_start;
    j["answer"] = ep.answer;
    j["answer_text"] = ep.answer_text;
    j["turns"] = e.turns_for(ep.task);
    nlohmann::json follow = nlohmann::json::array();
    for (const FollowUp& f : ep.follow_ups) follow.push_back({{"question", f.question}, {"answer", f.answer}, {"answer_text", f.answer_text}});
    j["follow_ups"] = follow;
    out += j.dump() + "\n";
  }
  write_file_atomically(path, out, "--dump-episodes " + path);
  std::printf("%s: the run's retrieval episodes (tasks, lengths, depths, trials and seed as given)\n", path.c_str());
  return 0;
}

int list_variants() {
  for (const auto& v : variant_catalogue()) {
    std::printf("%-22s %-5s %s%s\n", v.name.c_str(), v.quick ? "quick" : "full", v.description.c_str(),
                v.compares_to.empty() ? "" : (" [vs " + v.compares_to + "]").c_str());
  }
  return 0;
}

int run(const Options& o, CLI::App& app) {
  if (o.list) return list_variants();
  if (o.model.empty()) throw std::invalid_argument("--model DIR is required");
  // Output paths before the evaluation, not after it; none may be an input.
  {
    std::vector<FlagPath> inputs = model_inputs(o.model);
    if (!o.text.empty()) inputs.push_back({o.text, "--text"});
    check_outputs({{o.json, "--json"}, {o.json.empty() ? "" : o.json + ".partial", "--json (FILE.partial)"}, {o.plot, "--plot"},
                   {o.table, "--table"}},
                  inputs);
  }
  const std::filesystem::path dir(o.model);
  const Model model = Model::load(dir);
  EvalOptions e = EvalOptions::for_preset(o.preset, static_cast<std::size_t>(model.config().max_position_embeddings));
  e.methods = o.methods;
  if (!o.levels.empty()) e.levels = o.levels;
  if (!o.contexts.empty()) e.text_contexts = o.contexts;
  if (!o.lengths.empty()) e.retrieval_lengths = o.lengths;
  if (!o.depths.empty()) e.depths = o.depths;
  if (app.count("--tasks") > 0) {
    e.tasks.clear();
    for (const auto& t : o.tasks) {
      if (!t.empty()) e.tasks.push_back(t);
    }
  }
  if (app.count("--settings") > 0) e.settings = o.settings;
  if (o.turns > 0) e.turns = o.turns;
  if (o.windows > 0) e.windows = o.windows;
  if (o.continuation > 0) e.continuation = o.continuation;
  if (o.trials > 0) e.trials = o.trials;
  e.threads = o.threads;
  e.seed = o.seed;
  e.progress = !o.no_progress;
  e.speed = !o.no_speed;
  if (!o.json.empty()) e.partial_json = o.json + ".partial";  // removed once the whole run is written
  e.validate();
  e.check_model_context(static_cast<std::size_t>(model.config().max_position_embeddings));
  // A bad --methods list is refused before any file is read or any note is printed.
  (void)select_variants(e.methods, e.preset == "quick");

  const Tokenizer tokenizer = load_model_tokenizer(dir);
  // A .gguf's held-out text sits beside it; a directory's inside it.
  const std::filesystem::path text_dir = is_gguf_path(dir) ? dir.parent_path() : dir;
  const std::filesystem::path text_path = o.text.empty() ? text_dir / "heldout_sample.txt" : std::filesystem::path(o.text);
  const std::string text = read_text(text_path, o.text.empty() ? "held-out text" : "--text");

  EvalInputs in;
  in.model_dir = o.model;
  in.text_source = text_path.string();
  in.text_tokens = tokenizer.encode(text, /*add_special_tokens=*/false);
  // In-distribution held-out text (a split of the training corpus), when the model ships one.
  const std::filesystem::path indist_path = dir / "heldout_indist_sample.txt";
  if (std::filesystem::exists(indist_path)) {
    in.indist_source = indist_path.string();
    in.indist_tokens = tokenizer.encode(read_text(indist_path, "held-out text"), /*add_special_tokens=*/false);
  } else {
    // Part of the report (stdout): stderr carries progress and the one-line error only.
    std::printf("note: %s not found; text fidelity on the out-of-domain held-out text only\n",
                indist_path.string().c_str());
  }
  // Reconstruction-scored variants (h2o_kvzip*): the prompt before each chunk's copy of the context
  // (KVzip's wording; models/tiny never saw an instruction, the copy's attention is what counts).
  in.repeat_prompt = tokenizer.encode("\n\nRepeat the previous context exactly.\n", /*add_special_tokens=*/false);
  in.bos = tokenizer.bos_id();
  if (!in.bos) in.bos = model.config().bos_token_id;
  std::vector<std::string> lines;
  {
    std::istringstream s(text);
    for (std::string line; std::getline(s, line);) lines.push_back(line);
  }
  std::unique_ptr<EpisodeMaker> maker;
  if (!e.tasks.empty()) {
    maker = std::make_unique<EpisodeMaker>([&](std::string_view t) { return tokenizer.encode(t, false); }, in.bos, lines);
    in.episodes = maker.get();
  }
  if (!o.dump_episodes.empty()) {
    if (maker == nullptr) throw std::invalid_argument("--dump-episodes: no retrieval tasks in this run (--tasks)");
    return dump_episodes(o.dump_episodes, e, *maker);
  }

  const EvalResults results = run_eval(model, in, e);
  if (o.wide) {
    print_table(stdout, results);
  } else {
    // The full table is 200+ columns: a summary on screen, the table in a file named there.
    char* buf = nullptr;
    std::size_t len = 0;
    std::FILE* mem = ::open_memstream(&buf, &len);
    if (mem == nullptr) throw std::runtime_error("cannot format the table (out of memory)");
    print_table(mem, results);
    std::fclose(mem);
    const std::string table(buf, len);
    std::free(buf);
    print_summary(stdout, results);
    std::string table_path = o.table;
    if (table_path.empty()) {
      std::string tmpl = (std::filesystem::temp_directory_path() / "kvslim-eval-XXXXXX.txt").string();
      const int fd = ::mkstemps(tmpl.data(), 4);
      const bool ok = fd >= 0 && ::write(fd, table.data(), table.size()) == static_cast<ssize_t>(table.size());
      if (fd >= 0) ::close(fd);
      table_path = ok ? tmpl : std::string();
    } else {
      write_file_atomically(table_path, table, "--table " + table_path);
    }
    if (!table_path.empty()) {
      std::printf("full table (200+ columns): %s\n", table_path.c_str());
    } else {
      std::printf("full table: cannot write it to the temp directory; --wide prints it here\n");
    }
  }
  if (!o.json.empty()) {
    write_json(o.json, results);
    std::error_code ignored;
    std::filesystem::remove(o.json + ".partial", ignored);
    std::printf("wrote %s\n", o.json.c_str());
  }
  if (!o.plot.empty()) {
    std::string why;
    if (!write_plot(o.plot, results, why)) {
      std::fprintf(stderr, "kvslim: error: --plot %s: %s\n", o.plot.c_str(), why.c_str());
      return 1;  // asked for a plot and got none: not a success
    }
    std::printf("wrote %s\n", o.plot.c_str());
  }
  for (const auto& p : results.points) {
    if (!p.error.empty()) return 2;  // the table says which point failed and why
  }
  return 0;
}

const CommandRegistrar registrar(
    "eval", "quality per byte and decode speed of every KV method at equal memory, on a real model",
    [](CLI::App& app) {
      auto o = std::make_shared<Options>();
      app.add_option("--model", o->model, "model directory (config.json, *.safetensors, tokenizer.json) or .gguf file");
      app.add_option("--preset", o->preset, "quick (make run, a few minutes on 2 cores) or full (docs/results.md)")
          ->capture_default_str()
          ->check(CLI::IsMember({"quick", "full"}));
      app.add_option("--methods", o->methods,
                     "comma-separated variants or method ids (default: the preset's; --list-methods shows them)");
      app.add_option("--levels", o->levels, "memory levels as fractions of the full cache's resident bytes (default 0.5,0.25,0.125)")
          ->delimiter(',')->check(finite_range(1e-6, 1.0));
      app.add_option("--json", o->json, "write every figure to this JSON file (finished points also go to FILE.partial as they complete)");
      app.add_option("--plot", o->plot, "write a PNG of quality vs resident KV bytes per token (gnuplot)");
      app.add_option("--table", o->table, "write the full table (200+ columns) to this file (default: a new file in the temp directory, named on screen)");
      app.add_flag("--wide", o->wide, "print the full table on screen instead of the summary");
      app.add_option("--threads", o->threads, "parallel evaluation points, and engine threads for the speed phase")
          ->capture_default_str()
          ->check(CLI::Range(1, 256));
      app.add_option("--text", o->text, "held-out text (default: MODEL/heldout_sample.txt)");
      app.add_option("--contexts", o->contexts, "text-fidelity context lengths (preset: 1/4 and 3/4 of the model's context)")->delimiter(',')->check(CLI::Range(16, 1 << 24));
      app.add_option("--windows", o->windows, "text windows per context (preset's when 0)")->check(CLI::Range(0, 1 << 20));
      app.add_option("--continuation", o->continuation, "teacher-forced tokens per window (preset's when 0; else >= 2)")->check(CLI::Range(0, 1 << 24));
      app.add_option("--tasks", o->tasks, "retrieval tasks: passkey,kvlist,multikey (empty string: none)")->delimiter(',');
      app.add_option("--settings", o->settings,
                     "where the question comes: inside (the end of the compressed prompt), later (after the context, "
                     "compressed in its own call, as a chat turn); default both")
          ->delimiter(',');
      app.add_option("--turns", o->turns,
                     "questions asked in sequence about one compressed document in the later setting, each answer "
                     "appended (kvlist, multikey; 1-4; preset's when 0)")
          ->check(CLI::Range(0, 4));
      app.add_option("--lengths", o->lengths, "retrieval prompt lengths in tokens")->delimiter(',')->check(CLI::Range(16, 1 << 24));
      app.add_option("--depths", o->depths, "needle depths in [0, 1]")->delimiter(',')->check(finite_range(0.0, 1.0));
      app.add_option("--trials", o->trials, "episodes per (task, length, depth) (preset's when 0)")->check(CLI::Range(0, 1 << 20));
      app.add_option("--seed", o->seed, "episode seed")->capture_default_str();
      app.add_option("--dump-episodes", o->dump_episodes,
                     "write the run's retrieval episodes (token ids, question split, answers) to this JSON-lines file and exit");
      app.add_flag("--no-progress", o->no_progress, "no progress bar on stderr");
      app.add_flag("--no-speed", o->no_speed, "skip the decode-speed phase (quality figures only)");
      app.add_flag("--list-methods", o->list, "list the method variants and exit");
      CLI::App* self = &app;
      return [o, self] { return run(*o, *self); };
    });

}  // namespace
}  // namespace kvslim::cli
