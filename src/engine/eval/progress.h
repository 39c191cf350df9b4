// A progress bar with the time left, for evaluation runs longer than a few seconds. Work is
// counted in caller-defined units (e.g. tokens through the model) so uneven steps estimate well.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

namespace kvslim::engine::eval {

class ProgressBar {
 public:
  // Draws on `out` (stderr by default). On a terminal the bar redraws in place; otherwise a
  // line is printed at most every `line_interval_s` seconds. `enabled = false` prints nothing.
  ProgressBar(std::string label, double total_units, bool enabled = true, std::FILE* out = stderr,
              double line_interval_s = 15.0);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // Thread-safe: adds finished work and redraws when due.
  void advance(double units, const std::string& note = {});
  // Changes the total (work found unnecessary once part of it ran); thread-safe.
  void set_total(double total_units);
  // Draws the final state with the elapsed time and a newline (idempotent).
  void finish();
  double done() const;
  double elapsed_seconds() const;

  // "1m05s", "42s", "1h02m" (seconds, rounded).
  static std::string format_duration(double seconds);
  // Time left from the rate so far; negative when unknown (nothing done yet).
  static double eta_seconds(double done, double total, double elapsed);

 private:
  void draw(bool final_line);

  std::string label_;
  double total_, done_ = 0;
  bool enabled_, tty_, finished_ = false;
  std::FILE* out_;
  double line_interval_s_;
  std::string note_;
  std::chrono::steady_clock::time_point start_, last_draw_;
  mutable std::mutex mutex_;
};

}  // namespace kvslim::engine::eval
