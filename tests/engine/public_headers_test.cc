// The engine and the CLI use the library through its public headers only (include/kvslim): every
// "kvslim/X.h" they include must be one of them (issue 23: the engine included the private
// kvslim/kernels.h).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

namespace {

TEST(PublicHeaders, EngineAndCliIncludeOnlyPublicLibraryHeaders) {
  const char* root = std::getenv("KVSLIM_SOURCE_DIR");
  if (root == nullptr) GTEST_SKIP() << "KVSLIM_SOURCE_DIR unset";
  namespace fs = std::filesystem;
  const fs::path src = fs::path(root) / "src";
  const std::regex include(R"re(#include\s+"kvslim/([^"]+)")re");
  std::size_t checked = 0;
  for (const char* dir : {"engine", "cli"}) {
    for (const auto& entry : fs::recursive_directory_iterator(src / dir)) {
      if (!entry.is_regular_file()) continue;
      std::ifstream in(entry.path());
      std::string line;
      while (std::getline(in, line)) {
        std::smatch m;
        if (!std::regex_search(line, m, include)) continue;
        ++checked;
        EXPECT_TRUE(fs::exists(fs::path(root) / "include" / "kvslim" / m[1].str()))
            << entry.path() << " includes the library's private kvslim/" << m[1].str();
      }
    }
  }
  EXPECT_GT(checked, 0u);
}

}  // namespace
