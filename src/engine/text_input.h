// The user's text inputs (--prompt-file, eval --text, bench kld --text): read whole, but bounded
// (issue 26). A regular file, a pipe or FIFO that ends, or standard input for "-" all work; a
// directory is refused as one ("is a directory"), and reading stops with an error naming the flag
// once more than the limit has arrived (/dev/zero, an endless pipe), before memory runs out.
#pragma once
#include <cstdint>
#include <string>

namespace kvslim::engine {

// 256 MiB: a prompt or a held-out text is at most a few MB; tokenizing 256 MiB already takes minutes.
inline constexpr std::uint64_t kTextInputBytes = 256ull << 20;

// Throws std::runtime_error "FLAG PATH: ..." (cannot open, is a directory, larger than the limit,
// read error). An empty input is returned as "" (the caller says what it needed).
std::string read_text_input(const std::string& path, const std::string& flag, std::uint64_t max_bytes = kTextInputBytes);

}  // namespace kvslim::engine
