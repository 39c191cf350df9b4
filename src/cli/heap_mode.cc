#include "cli/heap_mode.h"

#include <malloc.h>

#include <climits>

#include <CLI/CLI.hpp>

namespace kvslim::cli {

void configure_heap(const std::string& mode) {
  if (mode != "warm") return;
  mallopt(M_MMAP_THRESHOLD, 64 << 20);   // blocks up to 64 MiB come from the heap, not mmap
  mallopt(M_TRIM_THRESHOLD, INT32_MAX);  // never shrink the heap
  mallopt(M_TOP_PAD, 256 << 20);         // grow it in large steps
}

void add_heap_option(CLI::App& app, std::string& mode) {
  app.add_option("--heap", mode,
                 "warm: freed memory stays in the process (a long-running server); cold: glibc's defaults, "
                 "every run touches fresh pages")
      ->capture_default_str()
      ->check(CLI::IsMember({"warm", "cold"}));
}

const char* heap_description(const std::string& mode) {
  return mode == "warm" ? "warm (freed memory stays in the process)"
                        : "cold (glibc defaults: large blocks go back to the kernel at free)";
}

}  // namespace kvslim::cli
