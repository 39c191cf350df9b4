// Outputs that are written whole or not at all, and never over an input (issue 26).
//
// AtomicFile writes to a temporary file beside the target (same directory, so the final rename
// stays on one file system), and commit() flushes, fsyncs and renames it over the target. Until
// commit() the target is untouched; a failure (a full disk, an exception, a crash before commit)
// leaves the previous file as it was, and the destructor removes the temporary.
#pragma once
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace kvslim::engine {

class AtomicFile {
 public:
  // `what` names the output in errors ("--json out.json", "model.safetensors").
  AtomicFile(std::filesystem::path target, std::string what);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Throw std::runtime_error naming the output on a write error (ENOSPC included).
  void write(const void* data, std::size_t bytes);
  void write(std::string_view text) { write(text.data(), text.size()); }
  // Flushes, fsyncs and renames the temporary over the target; throws (and removes the
  // temporary) when any step fails.
  void commit();
  const std::filesystem::path& temp_path() const { return temp_; }
  const std::filesystem::path& target() const { return target_; }

 private:
  std::filesystem::path target_, temp_;
  std::string what_;
  std::FILE* file_ = nullptr;
  bool committed_ = false;
};

// `text` into `target` through an AtomicFile.
void write_file_atomically(const std::filesystem::path& target, std::string_view text, const std::string& what);

// A temporary path beside `target` that does not exist yet (for tools such as gnuplot that
// write their own file; rename it over the target once it is complete).
std::filesystem::path temp_path_beside(const std::filesystem::path& target);

// True when `a` and `b` name the same file: the same device and inode when both exist (hard
// links and symlinks included), the same normalised absolute path otherwise.
bool same_file(const std::filesystem::path& a, const std::filesystem::path& b);

// The files a model reads: for a directory, its config/tokenizer/generation JSON, its
// *.safetensors shards, the shard index and held-out texts; for a .gguf, the file and the texts
// beside it. Used to refuse an output that would overwrite the model it is made from.
std::vector<std::filesystem::path> model_input_files(const std::filesystem::path& model);

}  // namespace kvslim::engine
