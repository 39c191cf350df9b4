#include "engine/eval/report.h"

#include "engine/eval/bootstrap.h"
#include "engine/output_file.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

namespace kvslim::engine::eval {
namespace {

// A gnuplot single-quoted string: '' is its only escape, and nothing (backquotes, @macros) is
// expanded inside one; control characters become '?' so the string stays on its line.
std::string gnuplot_quote(const std::string& text) {
  std::string q = "'";
  for (char c : text) {
    if (c == '\'') {
      q += "''";
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      q += '?';
    } else {
      q += c;
    }
  }
  return q + "'";
}

using nlohmann::json;

// Fields where the variant's config differs from the defaults, plus the method.
json config_json(const KVCacheConfig& c) {
  const auto defaults = KVCacheConfig{}.fields();
  const auto mine = c.fields();
  json j = json::object();
  j["method"] = c.method;
  for (std::size_t i = 0; i < mine.size(); ++i) {
    if (mine[i].first == "head_dim" || mine[i].first == "seed") continue;
    if (mine[i].second != defaults[i].second) j[mine[i].first] = mine[i].second;
  }
  return j;
}

const TextPoint* find_text(const std::vector<TextPoint>& text, const std::string& source, std::size_t context) {
  for (const auto& t : text) {
    if (t.source == source && t.context == context) return &t;
  }
  return nullptr;
}

// The (source, context) columns of the text tables, in run order.
std::vector<std::pair<std::string, std::size_t>> text_columns(const EvalResults& R) {
  std::vector<std::pair<std::string, std::size_t>> cols;
  for (const auto& t : R.full_text) cols.emplace_back(t.source, t.context);
  return cols;
}

json interval_json(const Interval& i) { return json::array({i.lo, i.hi}); }

const TaskScore* find_task(const std::vector<TaskScore>& scores, const std::string& task) {
  for (const auto& s : scores) {
    if (s.task == task) return &s;
  }
  return nullptr;
}

json retrieval_json(const TaskScore& s, const EvalResults& R) {
  json cells = json::array();
  for (const auto& c : s.cells) {
    cells.push_back({{"length", c.length}, {"depth", c.depth}, {"correct", c.correct}, {"total", c.total}});
  }
  const TaskScore* full = find_task(R.full_retrieval, s.task);
  const ScoreKey key = parse_score_key(s.task);
  return {{"task", key.task},
          {"setting", key.setting},
          {"turn", key.turn},
          {"accuracy", s.accuracy()},
          {"accuracy_ci95", interval_json(accuracy_interval(s.outcomes))},
          {"full_accuracy", full ? full->accuracy() : 0.0},
          {"correct", s.correct()},
          {"total", s.total()},
          {"reported", R.task_reported(s.task)},
          {"cells", cells}};
}

double bytes_per_token(const FidelityTotals& t, std::size_t context) {
  return t.windows ? t.resident_bytes_sum / static_cast<double>(t.windows) / static_cast<double>(context) : 0.0;
}

std::string level_label(double level) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%.3g", level);
  return buf;
}

// Mean accuracy over the reported retrieval tasks, NaN when none is reported.
double reported_retrieval(const std::vector<TaskScore>& scores, const EvalResults& R) {
  double sum = 0;
  int n = 0;
  for (const auto& s : scores) {
    if (R.task_reported(s.task) && s.total() > 0) {
      sum += s.accuracy();
      ++n;
    }
  }
  return n ? sum / n : std::nan("");
}

}  // namespace

json to_json(const EvalResults& R) {
  const EvalOptions& o = R.options;
  json j;
  j["schema"] = "kvslim-eval/1";
  j["preset"] = o.preset;
  j["model"] = {{"dir", R.model_dir},
                {"architecture", R.model.architecture},
                {"layers", R.model.num_layers},
                {"heads", R.model.num_heads},
                {"kv_heads", R.model.num_kv_heads},
                {"head_dim", R.model.head_dim},
                {"hidden", R.model.hidden_size},
                {"vocab", R.model.vocab_size},
                {"parameters", R.parameters}};
  j["protocol"] = {
      {"levels", o.levels},
      {"threads", o.threads},
      {"seed", o.seed},
      {"prefill", "whole prompt in one forward call (prefill_chunk 0); the cache compresses while absorbing it"},
      {"text",
       {{"source", R.text_source},
        {"tokens_available", R.text_tokens},
        {"indist_source", R.indist_source},
        {"indist_tokens_available", R.indist_tokens},
        {"intervals", "95 % percentile bootstrap, " + std::to_string(kBootstrapResamples) +
                          " resamples of the windows (text) or episodes (retrieval)"},
        {"contexts", o.text_contexts},
        {"continuation", o.continuation},
        {"windows", o.windows}}},
      {"retrieval",
       {{"tasks", o.tasks},
        {"settings", o.settings},
        {"turns", o.turns},
        {"lengths", o.retrieval_lengths},
        {"depths", o.depths},
        {"trials", o.trials},
        {"min_full_accuracy", o.min_full_accuracy}}},
      {"speed", {{"context", o.speed_context}, {"decode_tokens", o.speed_tokens}, {"level", o.speed_level}}}};

  json full_text = json::array();
  for (const auto& t : R.full_text) {
    full_text.push_back({{"source", t.source},
                         {"context", t.context},
                         {"ppl", t.totals.ref_ppl()},
                         {"resident_bytes", t.totals.windows ? t.totals.ref_resident_bytes_sum / t.totals.windows : 0.0},
                         {"bytes_per_token", bytes_per_token(t.totals, t.context)}});
  }
  json full_ret = json::array();
  json full_later = json::array();
  for (const auto& s : R.full_retrieval) {
    (parse_score_key(s.task).setting == "inside" ? full_ret : full_later).push_back(retrieval_json(s, R));
  }
  j["full"] = {{"text", full_text}, {"retrieval", full_ret}, {"retrieval_later", full_later}};

  json points = json::array();
  for (const auto& P : R.points) {
    json p = {{"variant", P.variant.name},
              {"method", P.variant.config.method},
              {"description", P.variant.description},
              {"compares_to", P.variant.compares_to},
              {"prefill_attention", std::string(prefill_attention_name(P.variant.prefill))},
              {"level_target", P.variant.budgeted() ? json(P.level_target) : json(nullptr)},
              {"config", config_json(P.variant.config)}};
    if (P.variant.recent_window_fraction > 0) p["recent_window_fraction"] = P.variant.recent_window_fraction;
    if (!P.error.empty()) p["error"] = P.error;
    json text = json::array();
    for (const auto& t : P.text) {
      text.push_back({{"source", t.source},
                      {"context", t.context},
                      {"budget", t.budget},
                      {"level", t.totals.level()},
                      {"retained_level", t.retained_level},
                      {"resident_bytes", t.totals.windows ? t.totals.resident_bytes_sum / t.totals.windows : 0.0},
                      {"bytes_per_token", bytes_per_token(t.totals, t.context)},
                      {"ppl", t.totals.ppl()},
                      {"ppl_full", t.totals.ref_ppl()},
                      {"delta_ppl", t.totals.ppl() - t.totals.ref_ppl()},
                      {"delta_ppl_ci95", interval_json(text_interval(t.per_window, TextFigure::delta_ppl))},
                      {"kl", t.totals.kl()},
                      {"kl_ci95", interval_json(text_interval(t.per_window, TextFigure::kl))},
                      {"top1", t.totals.top1()},
                      {"top1_ci95", interval_json(text_interval(t.per_window, TextFigure::top1))},
                      {"steps", t.totals.steps},
                      {"windows", t.totals.windows}});
      json layers = json::array();
      for (const auto& figures : t.layer_figures) {
        json f = json::object();
        for (const auto& [name, value] : figures) f[name] = value;
        layers.push_back(f);
      }
      text.back()["layer_figures"] = layers;
    }
    p["text"] = text;
    // "retrieval": the question inside the prompt (the schema's original meaning);
    // "retrieval_later": after the compressed context, one entry per task and turn.
    json ret = json::array(), later = json::array();
    for (const auto& s : P.retrieval) {
      (parse_score_key(s.task).setting == "inside" ? ret : later).push_back(retrieval_json(s, R));
    }
    p["retrieval"] = ret;
    p["retrieval_later"] = later;
    if (P.variant.reconstruction_weight > 0) {
      p["reconstruction_seconds"] = P.reconstruction_seconds;
      p["episode_seconds"] = P.episode_seconds;
    }
    points.push_back(p);
  }
  j["points"] = points;

  json rows = json::array();
  for (const auto& s : R.speed) {
    rows.push_back({{"variant", s.variant},
                    {"level_target", s.level_target > 0 ? json(s.level_target) : json(nullptr)},
                    {"budget", s.budget},
                    {"resident_bytes", s.resident_bytes},
                    {"bytes_per_token", static_cast<double>(s.resident_bytes) / static_cast<double>(o.speed_context)},
                    {"tokens_per_s", s.tokens_per_second},
                    {"ratio", s.ratio}});
  }
  j["speed"] = {{"context", o.speed_context},
                {"decode_tokens", o.speed_tokens},
                {"threads", o.threads},
                {"full_tokens_per_s_runs", R.full_speed_runs},
                {"rows", rows}};
  j["peak_rss_bytes"] = R.peak_rss_bytes;
  j["elapsed_s"] = R.elapsed_seconds;
  j["hardware_threads"] = R.hardware_threads;
  return j;
}

void write_json(const std::filesystem::path& path, const EvalResults& results) {
  // Paths are bytes, not always UTF-8: invalid sequences become U+FFFD rather than an exception
  // after the whole evaluation (issue 26). Written atomically (engine/output_file.h).
  write_file_atomically(path, to_json(results).dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n",
                        "--json " + path.string());
}

void print_table(std::FILE* out, const EvalResults& R) {
  const EvalOptions& o = R.options;
  std::fprintf(out, "\nkvslim eval: %s (%s, %d layers, %d/%d heads x %d, %.1fM params), preset %s\n", R.model_dir.c_str(),
               R.model.architecture.c_str(), R.model.num_layers, R.model.num_heads, R.model.num_kv_heads, R.model.head_dim,
               static_cast<double>(R.parameters) / 1e6, o.preset.c_str());
  std::fprintf(out, "text: %zu window(s) per context from %s (ood)%s%s, %zu teacher-forced tokens each; level = resident KV bytes / full cache's\n",
               o.windows, R.text_source.c_str(), R.indist_source.empty() ? "" : " and ", R.indist_source.empty() ? "" : (R.indist_source + " (ind)").c_str(),
               o.continuation);
  std::fprintf(out, "[lo hi]: 95 %% bootstrap interval over windows (text) and episodes (retrieval)\n");
  const auto columns = text_columns(R);

  // Header.
  std::string head = "variant                level   real  B/tok |";
  for (const auto& [src, c] : columns) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "  %s %-5zu   dPPL      KL [lo     hi    ]  top1 [lo    hi   ] |",
                  src == "heldout" ? "ood" : "ind", c);
    head += buf;
  }
  std::vector<std::string> shown_tasks;
  for (const auto& t : o.score_keys()) {
    if (R.task_reported(t)) shown_tasks.push_back(t);
  }
  // A column per score key: TASK (question inside the prompt), TASK@later (after the compressed
  // context), TASK@turnN (the N-th question about one compressed document).
  std::size_t key_width = 7;
  for (const auto& t : shown_tasks) key_width = std::max(key_width, t.size());
  for (const auto& t : shown_tasks) {
    char buf[48];
    std::snprintf(buf, sizeof buf, " %*s [lo   hi  ]", static_cast<int>(key_width), t.c_str());
    head += buf;
  }
  std::fprintf(out, "%s\n%s\n", head.c_str(), std::string(head.size(), '-').c_str());

  // The full cache: its perplexity and retrieval accuracy.
  {
    const std::size_t longest = o.text_contexts.back();
    const TextPoint* lt = find_text(R.full_text, "heldout", longest);
    std::fprintf(out, "%-22s %5s  %5.3f %6.0f |", "full", "1", 1.0, lt ? bytes_per_token(lt->totals, longest) : 0.0);
    for (const auto& [src, c] : columns) {
      const TextPoint* t = find_text(R.full_text, src, c);
      std::fprintf(out, "  ppl %8.3f %51s |", t ? t->totals.ref_ppl() : 0.0, "");
    }
    for (const auto& task : shown_tasks) {
      const TaskScore* s = find_task(R.full_retrieval, task);
      const Interval ci = accuracy_interval(s->outcomes);
      std::fprintf(out, " %*.2f [%4.2f %4.2f]", static_cast<int>(key_width), s->accuracy(), ci.lo, ci.hi);
    }
    std::fprintf(out, "\n");
  }
  bool any_loose = false;
  for (const auto& P : R.points) {
    const std::string level = P.variant.budgeted() ? level_label(P.level_target) : "-";
    if (!P.error.empty()) {
      std::fprintf(out, "%-22s %5s  failed: %s\n", P.variant.name.c_str(), level.c_str(), P.error.c_str());
      continue;
    }
    const TextPoint* lt = find_text(P.text, "heldout", o.text_contexts.back());
    std::fprintf(out, "%-22s %5s  %5.3f %6.0f |", P.variant.name.c_str(), level.c_str(), lt ? lt->totals.level() : 0.0,
                 lt ? bytes_per_token(lt->totals, lt->context) : 0.0);
    for (const auto& [src, c] : columns) {
      const TextPoint* t = find_text(P.text, src, c);
      if (t == nullptr) {
        std::fprintf(out, "%65s |", "");
        continue;
      }
      const bool loose = t->totals.level() > t->retained_level * 1.05;
      any_loose = any_loose || loose;
      const Interval kl = text_interval(t->per_window, TextFigure::kl), top1 = text_interval(t->per_window, TextFigure::top1);
      std::fprintf(out, " %c%5.3f %+8.3f %7.4f [%6.4f %6.4f] %5.3f [%5.3f %5.3f] |", loose ? '*' : ' ', t->totals.level(),
                   t->totals.ppl() - t->totals.ref_ppl(), t->totals.kl(), kl.lo, kl.hi, t->totals.top1(), top1.lo, top1.hi);
    }
    for (const auto& task : shown_tasks) {
      const TaskScore* s = find_task(P.retrieval, task);
      const Interval ci = s ? accuracy_interval(s->outcomes) : Interval{};
      std::fprintf(out, " %*.2f [%4.2f %4.2f]", static_cast<int>(key_width), s ? s->accuracy() : 0.0, ci.lo, ci.hi);
    }
    std::fprintf(out, "\n");
  }
  std::fprintf(out, "(per context: real level, perplexity change, mean KL(full || method) in nats, top-1 agreement)\n");
  if (any_loose) {
    std::fprintf(out, "* resident bytes more than 5%% above what the kept tokens need: the cache keeps allocation it no "
                      "longer uses (budgets are matched on kept tokens)\n");
  }
  for (const auto& P : R.points) {
    if (P.variant.reconstruction_weight > 0 && P.error.empty() && P.episode_seconds > 0) {
      std::fprintf(out, "%s @%s: reconstruction scores took %.1f s against %.1f s of the episodes' own prefills and answers "
                        "(%.2fx: the second pass's cost)\n",
                   P.variant.name.c_str(), level_label(P.level_target).c_str(), P.reconstruction_seconds, P.episode_seconds,
                   P.reconstruction_seconds / P.episode_seconds);
    }
  }
  if (o.has_setting("later") && !shown_tasks.empty()) {
    std::fprintf(out, "TASK@later: the document prefilled and compressed in one call, the question in the next; TASK@turnN: the "
                      "N-th question about that document, each answer appended (same bytes as TASK)\n");
  }
  for (const auto& t : o.score_keys()) {
    if (!R.task_reported(t)) {
      const TaskScore* s = find_task(R.full_retrieval, t);
      std::fprintf(out, "retrieval task %s not reported: the full cache scores %.2f (< %.2f)\n", t.c_str(),
                   s ? s->accuracy() : 0.0, o.min_full_accuracy);
    }
  }

  // Faithful signals against their proxies, point by point.
  bool any = false;
  for (const auto& P : R.points) {
    if (P.variant.compares_to.empty() || !P.error.empty() || P.text.empty()) continue;
    for (const auto& Q : R.points) {
      if (Q.variant.name != P.variant.compares_to || Q.level_target != P.level_target || !Q.error.empty() || Q.text.empty()) continue;
      if (!any) {
        std::fprintf(out, "\nfaithful variant vs its proxy (longest context; KL lower is better, top-1 and retrieval higher)\n");
        any = true;
      }
      const TextPoint* pa = find_text(P.text, "heldout", o.text_contexts.back());
      const TextPoint* pb = find_text(Q.text, "heldout", o.text_contexts.back());
      if (pa == nullptr || pb == nullptr) continue;
      const FidelityTotals& a = pa->totals;
      const FidelityTotals& b = pb->totals;
      std::fprintf(out, "  %-22s vs %-18s @%-5s KL %.4f vs %.4f, top-1 %.3f vs %.3f", P.variant.name.c_str(),
                   Q.variant.name.c_str(), P.variant.budgeted() ? level_label(P.level_target).c_str() : "-", a.kl(), b.kl(),
                   a.top1(), b.top1());
      const double ra = reported_retrieval(P.retrieval, R), rb = reported_retrieval(Q.retrieval, R);
      if (!std::isnan(ra)) std::fprintf(out, ", retrieval %.2f vs %.2f", ra, rb);
      std::fprintf(out, "  -> %s\n", a.kl() < b.kl() ? "faithful better" : a.kl() > b.kl() ? "proxy better" : "tie");
    }
  }

  if (R.speed.empty()) std::fprintf(out, "\ndecode speed: not measured (--no-speed)\n");
  if (!R.speed.empty()) std::fprintf(out, "\ndecode speed at context %zu (%zu steps, %d thread(s)); full cache %.1f tok/s (runs %.1f, %.1f)\n",
               o.speed_context, o.speed_tokens, o.threads, R.speed.empty() ? 0.0 : R.speed.front().tokens_per_second,
               R.full_speed_runs.size() > 0 ? R.full_speed_runs[0] : 0.0, R.full_speed_runs.size() > 1 ? R.full_speed_runs[1] : 0.0);
  if (!R.speed.empty()) std::fprintf(out, "  %-22s %5s %8s %12s %9s %7s\n", "variant", "level", "B/tok", "KV bytes", "tok/s", "x full");
  for (const auto& s : R.speed) {
    std::fprintf(out, "  %-22s %5s %8.0f %12zu %9.1f %7.2f\n", s.variant.c_str(),
                 s.level_target > 0 ? level_label(s.level_target).c_str() : "-",
                 static_cast<double>(s.resident_bytes) / static_cast<double>(o.speed_context), s.resident_bytes,
                 s.tokens_per_second, s.ratio);
  }
  std::fprintf(out, "\npeak RSS %.1f MiB, %.0f s on %d hardware thread(s)\n", static_cast<double>(R.peak_rss_bytes) / (1 << 20),
               R.elapsed_seconds, R.hardware_threads);
}

void print_summary(std::FILE* out, const EvalResults& R) {
  const EvalOptions& o = R.options;
  const std::size_t longest = o.text_contexts.back();
  std::string model = R.model_dir;
  if (model.size() > 40) model = "..." + model.substr(model.size() - 37);
  std::fprintf(out, "\nkvslim eval: %s, preset %s; quality at context %zu vs the full cache\n", model.c_str(), o.preset.c_str(),
               longest);
  // Up to six retrieval figures, the first turn of each task in each setting, by short labels
  // ("pk", "kv@lt", "mk"...), 7 columns each: at most 100 columns with the speed column. The
  // later turns are in the full table.
  std::vector<std::string> tasks;
  for (const auto& t : o.score_keys()) {
    if (R.task_reported(t) && parse_score_key(t).turn == 1 && tasks.size() < 6) tasks.push_back(t);
  }
  auto label = [](const std::string& key) {
    const ScoreKey k = parse_score_key(key);
    std::string l = k.task == "passkey" ? "pk" : k.task == "kvlist" ? "kv" : k.task == "multikey" ? "mk" : k.task.substr(0, 2);
    return k.setting == "inside" ? l : l + "@lt";
  };
  std::string head = "variant                level  B/tok       KL   top1";
  for (const auto& t : tasks) {
    char buf[16];
    std::snprintf(buf, sizeof buf, " %6.6s", label(t).c_str());
    head += buf;
  }
  head += " x full";
  std::fprintf(out, "%s\n%s\n", head.c_str(), std::string(head.size(), '-').c_str());
  auto speed_of = [&](const std::string& name, double level) -> const SpeedPoint* {
    for (const auto& sp : R.speed) {
      if (sp.variant == name && (level == 0 || std::abs(sp.level_target - level) < 1e-9)) return &sp;
    }
    return nullptr;
  };
  {
    const TextPoint* lt = find_text(R.full_text, "heldout", longest);
    std::fprintf(out, "%-22s %5s %6.0f %8s %6s", "full", "1", lt ? bytes_per_token(lt->totals, longest) : 0.0, "0", "1");
    for (const auto& t : tasks) {
      const TaskScore* s = find_task(R.full_retrieval, t);
      std::fprintf(out, " %6.2f", s ? s->accuracy() : 0.0);
    }
    std::fprintf(out, " %6s\n", R.speed.empty() ? "-" : "1.00");
  }
  for (const auto& P : R.points) {
    std::string name = P.variant.name.substr(0, 22);
    const std::string level = P.variant.budgeted() ? level_label(P.level_target) : "-";
    if (!P.error.empty()) {
      std::string why = P.error.substr(0, 60);
      std::fprintf(out, "%-22s %5s failed: %s\n", name.c_str(), level.c_str(), why.c_str());
      continue;
    }
    const TextPoint* t = find_text(P.text, "heldout", longest);
    std::fprintf(out, "%-22s %5s %6.0f %8.4f %6.3f", name.c_str(), level.c_str(), t ? bytes_per_token(t->totals, longest) : 0.0,
                 t ? t->totals.kl() : 0.0, t ? t->totals.top1() : 0.0);
    for (const auto& task : tasks) {
      const TaskScore* s = find_task(P.retrieval, task);
      std::fprintf(out, " %6.2f", s ? s->accuracy() : 0.0);
    }
    const SpeedPoint* sp = speed_of(P.variant.name, P.variant.budgeted() ? P.level_target : 0.0);
    if (sp != nullptr) {
      std::fprintf(out, " %6.2f\n", sp->ratio);
    } else {
      std::fprintf(out, " %6s\n", "-");
    }
  }
  std::fprintf(out, "(KL: mean KL(full || method), nats; top1: agreement with the full cache; x full: decode speed;\n"
                    " pk/kv/mk: passkey/kvlist/multikey, question inside the prompt; @lt: after the compressed context)\n");
}

bool write_plot(const std::filesystem::path& path, const EvalResults& R, std::string& why) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {  // a fixed command: no user text
    why = "gnuplot is not installed (apt-get install gnuplot-nox); no plot written";
    return false;
  }
  const std::size_t longest = R.options.text_contexts.back();
  // One data block per variant, points sorted by bytes per token: bytes, top-1, KL, retrieval.
  std::map<std::string, std::vector<std::array<double, 4>>> lines;
  std::vector<std::string> order;
  for (const auto& P : R.points) {
    if (!P.error.empty()) continue;
    const TextPoint* t = find_text(P.text, "heldout", longest);
    if (t == nullptr) continue;
    if (!lines.count(P.variant.name)) order.push_back(P.variant.name);
    lines[P.variant.name].push_back({bytes_per_token(t->totals, longest), t->totals.top1(), std::max(t->totals.kl(), 1e-6),
                                     reported_retrieval(P.retrieval, R)});
  }
  const TextPoint* ft = find_text(R.full_text, "heldout", longest);
  const double full_bpt = ft ? bytes_per_token(ft->totals, longest) : 0.0;

  std::ostringstream s;
  bool any_retrieval = false;
  for (const auto& t : R.options.tasks) any_retrieval = any_retrieval || R.task_reported(t);
  // Nothing taken from the user reaches gnuplot as code (issue 26): the output path and the model
  // path arrive as the script's arguments ARG1 and ARG2 (gnuplot -c), string values never parsed;
  // the variant names are quoted by quote() below. gnuplot writes a temporary file beside the
  // target, renamed over it once gnuplot succeeded.
  s << "set terminal pngcairo noenhanced size " << (any_retrieval ? 1800 : 1300) << ",640 font 'sans,10'\n";
  s << "set output ARG1\n";
  s << "set datafile missing 'nan'\n";
  s << "$data << EOD\n";
  for (const auto& name : order) {
    auto pts = lines[name];
    std::sort(pts.begin(), pts.end());
    s << "# " << name << "\n";
    for (const auto& p : pts) s << p[0] << " " << p[1] << " " << p[2] << " " << (std::isnan(p[3]) ? std::string("nan") : std::to_string(p[3])) << "\n";
    s << "\n\n";
  }
  s << "EOD\n";
  s << "set multiplot layout 1," << (any_retrieval ? 3 : 2) << " title 'kvslim eval, '.ARG2.': quality vs resident KV bytes per token (context "
    << longest << ", full cache = " << static_cast<long>(full_bpt) << " B/token)'\n";
  s << "set grid\nset key bottom right font ',8'\nset xlabel 'resident KV bytes per token'\nset logscale x 2\n";
  s << "set xrange [*:" << full_bpt * 1.15 << "]\n";
  s << "set arrow 1 from " << full_bpt << ", graph 0 to " << full_bpt << ", graph 1 nohead dt 2\n";
  auto plot = [&](int column, const std::string& ylabel, bool logy) {
    s << "set ylabel '" << ylabel << "'\n" << (logy ? "set logscale y\nset key top right font ',8'\n" : "unset logscale y\nset key bottom right font ',8'\n");
    s << "plot ";
    for (std::size_t i = 0; i < order.size(); ++i) {
      s << (i ? ", " : "") << "$data index " << i << " using 1:" << column << " with linespoints pt " << (i % 13) + 1
        << " dt " << (i / 8) + 1 << " title " << gnuplot_quote(order[i]);
    }
    s << "\n";
  };
  plot(2, "top-1 agreement with the full cache", false);
  plot(3, "mean KL(full || method), nats", true);
  if (any_retrieval) {
    s << "set yrange [-0.05:1.05]\n";
    plot(4, "retrieval exact match (reported tasks)", false);
  }
  s << "unset multiplot\n";

  char tmpl[] = "/tmp/kvslim-eval-plot-XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) {
    why = "cannot create a temporary file for the gnuplot script";
    return false;
  }
  const std::string script = s.str();
  const bool wrote = ::write(fd, script.data(), script.size()) == static_cast<ssize_t>(script.size());
  ::close(fd);
  std::filesystem::path png;
  try {
    png = temp_path_beside(path);
  } catch (const std::exception& e) {
    std::filesystem::remove(tmpl);
    why = e.what();
    return false;
  }
  const std::string err = std::string(tmpl) + ".err";
  std::string model_title = R.model_dir;
  for (char& c : model_title) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';  // one line of title
  }
  // posix_spawn, no shell: every argument reaches gnuplot as it is.
  int rc = -1;
  if (wrote) {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    const std::string png_s = png.string();
    std::vector<char*> argv = {const_cast<char*>("gnuplot"), const_cast<char*>("-c"), tmpl, const_cast<char*>(png_s.c_str()),
                               model_title.data(), nullptr};
    pid_t pid = 0;
    if (posix_spawnp(&pid, "gnuplot", &actions, nullptr, argv.data(), environ) == 0) {
      int status = 0;
      while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    posix_spawn_file_actions_destroy(&actions);
  }
  std::ifstream errs(err);
  std::string first_error;
  std::getline(errs, first_error);
  std::error_code ignored;
  std::filesystem::remove(tmpl, ignored);
  std::filesystem::remove(err, ignored);
  std::uintmax_t png_size = std::filesystem::file_size(png, ignored);
  if (ignored) png_size = 0;
  if (rc != 0 || png_size == 0) {
    std::filesystem::remove(png, ignored);
    why = "gnuplot failed" + (first_error.empty() ? std::string() : ": " + first_error);
    return false;
  }
  if (::rename(png.c_str(), path.c_str()) != 0) {
    why = std::string("cannot rename the finished plot into place (") + std::strerror(errno) + ")";
    std::filesystem::remove(png, ignored);
    return false;
  }
  return true;
}

}  // namespace kvslim::engine::eval
