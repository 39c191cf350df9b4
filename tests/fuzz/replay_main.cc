// Runs a libFuzzer target's LLVMFuzzerTestOneInput over every file of its seed corpus, in the
// ordinary (gcc, ASan+UBSan in CI) test build: the corpus, regressions included, is checked on
// every test run, not only in the clang fuzz loop. Usage: <target>_replay CORPUS_DIR
// An input that takes the process past kRssLimitMb (resident, at its peak) fails the run, as
// libFuzzer's -rss_limit_mb does in CI's fuzz loop (.ci/run): an out-of-memory input is a
// regression like a crash.
#include <sys/resource.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {
constexpr long kRssLimitMb = 4096;  // .ci/run's -rss_limit_mb

long peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024;  // (kB on Linux)
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(argv[1])) {
    if (e.is_regular_file()) files.push_back(e.path());
  }
  if (files.empty()) {
    std::fprintf(stderr, "%s: no corpus files\n", argv[1]);
    return 2;
  }
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::printf("%s\n", f.filename().c_str());
    std::fflush(stdout);
    LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
    if (const long mb = peak_rss_mb(); mb > kRssLimitMb) {
      std::fprintf(stderr, "%s: out of memory: the process's peak resident size reached %ld MB (limit %ld MB)\n",
                   f.filename().c_str(), mb, kRssLimitMb);
      return 1;
    }
  }
  std::printf("%zu inputs replayed\n", files.size());
  return 0;
}
