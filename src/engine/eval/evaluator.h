// `kvslim eval`'s driver: the full-cache reference, then every (variant, memory level) point on
// held-out text and retrieval episodes (points run in parallel, one single-threaded engine each),
// then decode speed at the longest context, method against full in the same run.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/eval/method_grid.h"
#include "engine/eval/retrieval.h"
#include "engine/eval/text_fidelity.h"
#include "engine/model.h"

namespace kvslim::engine::eval {

struct EvalOptions {
  std::string preset = "quick";
  std::vector<double> levels;                  // memory levels, fractions of the full cache's bytes
  std::string methods;                         // --methods ("" = the preset's variants)
  std::vector<std::size_t> text_contexts;      // prefill lengths for text fidelity
  std::size_t continuation = 128;              // teacher-forced tokens per window
  std::size_t windows = 2;                     // windows per context
  std::vector<std::string> tasks;              // retrieval tasks: "passkey", "kvlist", "multikey"
  // Where the question comes: "inside" (the end of the compressed prompt: the prompt's last
  // queries are the question's) and/or "later" (the document prefilled and compressed in one call,
  // the question in the next, as a chat turn would be).
  std::vector<std::string> settings = {"inside"};
  // Questions asked in sequence about one compressed document in the later setting (kvlist and
  // multikey; passkey has one fact, so one turn): turn 1 is the later setting's question, each
  // turn's answer is appended before the next question. 1..4.
  std::size_t turns = 1;
  std::vector<std::size_t> retrieval_lengths;  // prompt + answer tokens
  std::vector<double> depths;                  // needle depths in [0, 1]
  std::size_t trials = 1;                      // episodes per (task, length, depth)
  double min_full_accuracy = 0.5;              // a task is reported only when full reaches this
  std::size_t speed_context = 1536;            // prefill before the timed decode
  std::size_t speed_tokens = 64;               // timed decode steps
  double speed_level = 0.25;                   // eviction methods' level in the speed table
  int threads = 2;                             // parallel points; engine threads in the speed phase
  std::uint64_t seed = 7;
  bool progress = true;
  bool speed = true;                           // run the decode-speed phase
  // When set, every finished point is added to a JSON snapshot written here (same schema as
  // --json, finished points only), so a run cut short still leaves what it measured.
  std::string partial_json;

  // "quick" (make run: a few minutes on 2 cores) or "full" (docs/results.md), for a model trained
  // at `model_context` tokens (its max_position_embeddings, capped at 2048): text contexts at 1/4
  // and 3/4 of it, retrieval lengths up to it. Throws std::invalid_argument for another name.
  static EvalOptions for_preset(const std::string& name, std::size_t model_context = 2048);
  // Throws std::invalid_argument naming the first bad field.
  void validate() const;
  // Throws std::invalid_argument naming the flag when a text window, a retrieval prompt with its
  // answer or the speed run would pass the model's context: checked before any model work, so the
  // parallel phases never meet it (issue 26).
  void check_model_context(std::size_t max_positions) const;

  bool has_setting(const std::string& setting) const;
  // Questions a later-setting episode of `task` asks (passkey: 1).
  std::size_t turns_for(const std::string& task) const;
  // The retrieval figures, in table order: for each task "TASK" (question inside the prompt),
  // "TASK@later" (after the compressed context) and "TASK@turnN" (the N-th question of the
  // multi-turn run, N >= 2), as the settings and turns ask.
  std::vector<std::string> score_keys() const;
};

// A score key split into its parts: task, setting ("inside" / "later") and turn (1 for inside).
struct ScoreKey {
  std::string task, setting;
  std::size_t turn = 1;
};
ScoreKey parse_score_key(const std::string& key);
std::string score_key(const std::string& task, const std::string& setting, std::size_t turn);

struct TextPoint {
  std::string source = "heldout";  // which held-out text: "heldout" (out of domain) or "indist"
  std::size_t context = 0;
  int budget = 0;  // tokens per head (0: not an eviction method)
  FidelityTotals totals;
  std::vector<FidelityTotals> per_window;  // the same figures window by window (for the intervals)
  // Bytes of the kept tokens (kept tokens x the variant's bytes per kept token) over the full
  // cache's, after the prefill: the level the budget gives. totals.level() is the allocation's
  // level; the two differ only when a cache keeps memory it no longer uses.
  double retained_level = 0;
  // Each layer's own figures (KVCache::stats().figures: layer_budget, squeeze's concentration...)
  // after the first window, [layer] -> name -> value: what a layer-adaptive method chose.
  std::vector<std::vector<std::pair<std::string, double>>> layer_figures;
};

struct RetrievalCell {
  std::size_t length = 0;  // requested
  double depth = 0;        // requested
  std::size_t correct = 0, total = 0;
};

struct TaskScore {
  std::string task;  // a score key (EvalOptions::score_keys): "kvlist", "kvlist@later", "kvlist@turn3"
  std::vector<RetrievalCell> cells;
  std::vector<char> outcomes;  // every episode's verdict, in run order (for the intervals)
  std::size_t correct() const;
  std::size_t total() const;
  double accuracy() const;
};

struct SpeedPoint {
  std::string variant;  // "full" for the reference
  double level_target = 1;
  int budget = 0;
  std::size_t resident_bytes = 0;   // after the prefill of speed_context tokens
  double tokens_per_second = 0;     // decode steps over speed_tokens
  double ratio = 1;                 // tokens_per_second / the full cache's (mean of its two runs)
};

struct PointResult {
  MethodVariant variant;
  double level_target = 1;  // requested level (quantized methods: their own, reported in `text`)
  std::vector<TextPoint> text;
  std::vector<TaskScore> retrieval;
  std::string error;        // non-empty when the point failed (the rest of the run goes on)
  // Variants with reconstruction scores: seconds spent computing them, and seconds of the
  // episodes' own runs (prefill and answer) through the compressing caches, summed over the
  // retrieval episodes: what the second pass costs against the prefill it serves.
  double reconstruction_seconds = 0, episode_seconds = 0;
};

struct EvalResults {
  EvalOptions options;
  std::string model_dir, text_source;
  std::string indist_source;                  // empty: no in-distribution held-out text
  ModelConfig model;
  std::uint64_t parameters = 0;
  std::size_t text_tokens = 0;                // held-out tokens available
  std::size_t indist_tokens = 0;              // in-distribution held-out tokens available
  std::vector<TextPoint> full_text;           // reference: ppl and resident bytes per context
  std::vector<TaskScore> full_retrieval;
  std::vector<PointResult> points;
  std::vector<SpeedPoint> speed;              // full first, then each variant
  std::vector<double> full_speed_runs;        // tokens/s of the full cache's two timed runs
  std::size_t peak_rss_bytes = 0;
  double elapsed_seconds = 0;
  int hardware_threads = 0;

  // Tasks whose full-cache accuracy reaches options.min_full_accuracy.
  bool task_reported(const std::string& task) const;
};

struct EvalInputs {
  std::vector<int> text_tokens;   // held-out text, no special tokens
  // In-distribution held-out text (a split of the training corpus the model never saw), scored
  // like the out-of-domain text under the source "indist"; empty: none.
  std::vector<int> indist_tokens;
  std::string indist_source;
  std::optional<int> bos;
  const EpisodeMaker* episodes = nullptr;  // null: no retrieval
  // Tokens before each reconstruction chunk's copy of the context (variants with
  // reconstruction_weight > 0); may be empty.
  std::vector<int> repeat_prompt;
  std::string model_dir, text_source;
};

EvalResults run_eval(const Model& model, const EvalInputs& inputs, const EvalOptions& options);

// One retrieval episode of a run with its place in the grid (indices into options.tasks,
// retrieval_lengths, depths).
struct GridEpisode {
  std::size_t task_index, length_index, depth_index;
  Episode episode;
};
// The retrieval episodes run_eval scores, in its order (task, length, depth, trial) and from its
// seed: the same episodes for another engine (`kvslim eval --dump-episodes`, the GPU check of
// kvslim.hf).
std::vector<GridEpisode> make_episodes(const EvalOptions& options, const EpisodeMaker& maker);

}  // namespace kvslim::engine::eval
