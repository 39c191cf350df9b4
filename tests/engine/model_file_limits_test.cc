// Model files as a careless or hostile user hands them over (issue 13, item 6): links to
// /dev/zero, FIFOs, oversized files, a config claiming millions of layers. Each must end in a
// ModelFileError naming the file (and the limit or field), quickly, without reading or
// allocating what the file claims.
#include <sys/stat.h>
#include <unistd.h>
#include <fcntl.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "engine/model.h"
#include "engine/model_file_limits.h"
#include "engine/random_model.h"
#include "engine/tokenizer.h"
#include "loader_test_util.h"

namespace kvslim::engine {
namespace {

namespace fs = std::filesystem;
using testing::expect_error;
using testing::TempDir;
using Clock = std::chrono::steady_clock;

void replace_in_file(const fs::path& path, const std::string& from, const std::string& to) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto at = text.find(from);
  ASSERT_NE(at, std::string::npos) << from;
  text.replace(at, from.size(), to);
  std::ofstream(path) << text;
}

// Replaces `file` in the model directory with a FIFO. A watchdog opens the FIFO's write end
// after 5 s, so a loader that blocks on it gets unblocked (and the test fails on its message and
// its time) instead of hanging the suite.
class FifoInPlaceOf {
 public:
  explicit FifoInPlaceOf(const fs::path& file) : path_(file) {
    fs::remove(path_);
    if (::mkfifo(path_.c_str(), 0600) != 0) ADD_FAILURE() << "mkfifo " << path_;
    watchdog_ = std::thread([this] {
      const auto until = Clock::now() + std::chrono::seconds(5);
      while (!done_ && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      if (done_) return;
      const int fd = ::open(path_.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) ::close(fd);
    });
  }
  ~FifoInPlaceOf() {
    done_ = true;
    watchdog_.join();
  }

 private:
  fs::path path_;
  std::atomic<bool> done_{false};
  std::thread watchdog_;
};

class ModelFileLimits : public ::testing::Test {
 protected:
  void SetUp() override {
    write_random_model(dir_.path(), RandomModelSpec{.vocab_size = 258, .byte_tokenizer = true});
  }
  TempDir dir_;
};

TEST_F(ModelFileLimits, ConfigAndTokenizerLinkedToDevZero) {
  fs::remove(dir_ / "config.json");
  fs::create_symlink("/dev/zero", dir_ / "config.json");
  expect_error([&] { Model::load(dir_.path()); }, {"config.json", "is a device", "expected a regular file"});
  fs::remove(dir_ / "tokenizer.json");
  fs::create_symlink("/dev/zero", dir_ / "tokenizer.json");
  expect_error([&] { Tokenizer::load(dir_ / "tokenizer.json"); }, {"tokenizer.json", "is a device"});
}

TEST_F(ModelFileLimits, DirectoryInPlaceOfConfig) {
  fs::remove(dir_ / "config.json");
  fs::create_directory(dir_ / "config.json");
  expect_error([&] { Model::load(dir_.path()); }, {"config.json", "is a directory"});
}

TEST_F(ModelFileLimits, FifoInPlaceOfAnyFileFailsAtOnce) {
  for (const std::string file : {"config.json", "tokenizer.json", "model.safetensors"}) {
    SCOPED_TRACE(file);
    TempDir dir;
    write_random_model(dir.path(), RandomModelSpec{.vocab_size = 258, .byte_tokenizer = true});
    FifoInPlaceOf fifo(dir / file);
    const auto t0 = Clock::now();
    if (file == "tokenizer.json") {
      expect_error([&] { Tokenizer::load(dir / file); }, {file});
    } else {
      expect_error([&] { Model::load(dir.path()); }, {file});
    }
    EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2)) << "the loader waited for a writer";
  }
}

TEST_F(ModelFileLimits, OversizedJsonFilesAreRefusedBeforeReading) {
  // Sparse files: the size is what the loader sees, the disk holds nothing.
  fs::resize_file(dir_ / "config.json", limits::kConfigJsonBytes + 1);
  expect_error([&] { Model::load(dir_.path()); },
               {"config.json", std::to_string(limits::kConfigJsonBytes + 1) + " bytes", "limit"});
  fs::resize_file(dir_ / "tokenizer.json", limits::kTokenizerJsonBytes + 1);
  expect_error([&] { Tokenizer::load(dir_ / "tokenizer.json"); }, {"tokenizer.json", "limit"});
}

TEST_F(ModelFileLimits, SafetensorsHeaderLengthOverTheLimit) {
  // A header length the file really holds (sparse), but over the format's 100 MB limit.
  const std::uint64_t header_len = limits::kSafetensorsHeaderBytes + 8;
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>((header_len >> (8 * i)) & 0xFF);
  const fs::path file = dir_ / "model.safetensors";
  testing::write_file(file, prefix + "{");
  fs::resize_file(file, 8 + header_len);
  expect_error([&] { Model::load(dir_.path()); }, {"model.safetensors", "header length", "limit"});
}

TEST_F(ModelFileLimits, LayerCountIsCheckedAgainstTheTensorsBeforeAllocating) {
  // The model has 2 layers; 5,000,000 layers allocated 1.7 GB of layer records before failing,
  // INT_MAX threw a bare std::bad_alloc.
  for (const std::string layers : {"5000000", "2147483647", "3"}) {
    SCOPED_TRACE(layers);
    write_random_model(dir_.path(), RandomModelSpec{.num_layers = 2}, /*force=*/true);
    replace_in_file(dir_ / "config.json", "\"num_hidden_layers\": 2", "\"num_hidden_layers\": " + layers);
    const int last = std::stoi(layers) - 1;
    expect_error([&] { Model::load(dir_.path()); },
                 {"num_hidden_layers is " + layers, "model.layers." + std::to_string(last) + ".input_layernorm.weight"});
  }
}

}  // namespace
}  // namespace kvslim::engine
