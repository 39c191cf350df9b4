#include "engine/eval/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>

namespace kvslim::engine::eval {

ProgressBar::ProgressBar(std::string label, double total_units, bool enabled, std::FILE* out, double line_interval_s)
    : label_(std::move(label)),
      total_(std::max(total_units, 1e-9)),
      enabled_(enabled),
      tty_(out != nullptr && isatty(fileno(out)) != 0),
      out_(out),
      line_interval_s_(line_interval_s),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

ProgressBar::~ProgressBar() { finish(); }

double ProgressBar::done() const {
  std::lock_guard lock(mutex_);
  return done_;
}

double ProgressBar::elapsed_seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

std::string ProgressBar::format_duration(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", s / 3600, (s % 3600) / 60);
  } else if (s >= 60) {
    std::snprintf(buf, sizeof buf, "%ldm%02lds", s / 60, s % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%lds", s);
  }
  return buf;
}

double ProgressBar::eta_seconds(double done, double total, double elapsed) {
  if (done <= 0 || elapsed <= 0) return -1;
  return elapsed / done * std::max(0.0, total - done);
}

void ProgressBar::advance(double units, const std::string& note) {
  std::lock_guard lock(mutex_);
  done_ = std::min(total_, done_ + units);
  if (!note.empty()) note_ = note;
  const auto now = std::chrono::steady_clock::now();
  const double since = std::chrono::duration<double>(now - last_draw_).count();
  if (tty_ ? since >= 0.2 : since >= line_interval_s_) {
    last_draw_ = now;
    draw(false);
  }
}

void ProgressBar::set_total(double total_units) {
  std::lock_guard lock(mutex_);
  total_ = std::max(total_units, 1e-9);
  done_ = std::min(done_, total_);
}

void ProgressBar::finish() {
  std::lock_guard lock(mutex_);
  if (finished_) return;
  finished_ = true;
  draw(true);
}

void ProgressBar::draw(bool final_line) {
  if (!enabled_ || out_ == nullptr) return;
  constexpr int kWidth = 30;
  const double frac = std::clamp(done_ / total_, 0.0, 1.0);
  const int filled = static_cast<int>(frac * kWidth);
  const double elapsed = elapsed_seconds();
  std::string bar(static_cast<std::size_t>(filled), '#');
  bar.resize(kWidth, '.');
  std::string tail;
  if (final_line) {
    tail = "done in " + format_duration(elapsed);
  } else {
    const double eta = eta_seconds(done_, total_, elapsed);
    tail = format_duration(elapsed) + " elapsed, " + (eta < 0 ? std::string("?") : format_duration(eta)) + " left";
  }
  std::string note = final_line ? std::string() : note_;
  if (note.size() > 28) note = note.substr(0, 28);
  std::fprintf(out_, "%s%s [%s] %3d%% %s%s%s%s", tty_ ? "\r\033[K" : "", label_.c_str(), bar.c_str(),
               static_cast<int>(frac * 100), tail.c_str(), note.empty() ? "" : "  ", note.c_str(),
               tty_ && !final_line ? "" : "\n");
  std::fflush(out_);
}

}  // namespace kvslim::engine::eval
