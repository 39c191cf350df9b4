// The heap a benchmark's timed runs see. "warm": glibc keeps freed memory in the process (as a
// long-running server's heap does, and as jemalloc / tcmalloc do by default; llama-bench reuses its
// buffers the same way), so runs after the first reuse pages already touched; "cold": glibc's
// defaults, which return blocks over 128 KiB to the kernel at free, so every run pays the first
// touch of its buffers again -- 13-15 us per 4 KiB page on the virtual machines kvslim is measured
// on, enough to move a 512-token prefill by a third.
#pragma once
#include <string>

namespace CLI {
class App;
}

namespace kvslim::cli {

// Applies `mode` ("warm" or "cold") to this process's allocator; call before the first timed run.
void configure_heap(const std::string& mode);
// A --heap option (warm | cold, default warm) bound to `mode`.
void add_heap_option(CLI::App& app, std::string& mode);
// One line for a benchmark's header.
const char* heap_description(const std::string& mode);

}  // namespace kvslim::cli
