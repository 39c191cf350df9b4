#include "engine/output_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <stdexcept>

namespace kvslim::engine {
namespace fs = std::filesystem;

namespace {

std::string errno_text() { return std::strerror(errno); }

// mkstemp's template beside `target`: ".NAME.kvslim-tmp-XXXXXX" (hidden, and named after the
// target so a leftover after a power cut says what it was).
std::string temp_template(const fs::path& target) {
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  return (dir / ("." + target.filename().string() + ".kvslim-tmp-XXXXXX")).string();
}

}  // namespace

AtomicFile::AtomicFile(fs::path target, std::string what) : target_(std::move(target)), what_(std::move(what)) {
  std::string tmpl = temp_template(target_);
  const int fd = ::mkstemp(tmpl.data());
  if (fd < 0) throw std::runtime_error(what_ + ": cannot create a temporary file beside it (" + errno_text() + ")");
  temp_ = tmpl;
  // mkstemp makes 0600; an output should get the usual mode (0666 less the umask).
  const mode_t mask = ::umask(0);
  ::umask(mask);
  ::fchmod(fd, 0666 & ~mask);
  file_ = ::fdopen(fd, "wb");
  if (file_ == nullptr) {
    ::close(fd);
    ::unlink(temp_.c_str());
    throw std::runtime_error(what_ + ": cannot open the temporary file (" + errno_text() + ")");
  }
}

AtomicFile::~AtomicFile() {
  if (file_ != nullptr) std::fclose(file_);
  if (!committed_) ::unlink(temp_.c_str());
}

void AtomicFile::write(const void* data, std::size_t bytes) {
  if (file_ == nullptr) throw std::logic_error(what_ + ": write after commit");
  if (bytes > 0 && std::fwrite(data, 1, bytes, file_) != bytes) {
    throw std::runtime_error(what_ + ": write failed (" + errno_text() + "); the previous file is left as it was");
  }
}

void AtomicFile::commit() {
  if (file_ == nullptr) throw std::logic_error(what_ + ": committed twice");
  std::FILE* f = file_;
  file_ = nullptr;
  const bool flushed = std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  const int saved = errno;
  const bool closed = std::fclose(f) == 0;
  if (!flushed || !closed) {
    errno = flushed ? errno : saved;
    throw std::runtime_error(what_ + ": write failed (" + errno_text() + "); the previous file is left as it was");
  }
  if (::rename(temp_.c_str(), target_.c_str()) != 0) {
    throw std::runtime_error(what_ + ": cannot rename the finished file into place (" + errno_text() + ")");
  }
  committed_ = true;
}

void write_file_atomically(const fs::path& target, std::string_view text, const std::string& what) {
  AtomicFile f(target, what);
  f.write(text);
  f.commit();
}

fs::path temp_path_beside(const fs::path& target) {
  std::random_device rd;
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  for (int attempt = 0; attempt < 100; ++attempt) {
    const fs::path p = dir / ("." + target.filename().string() + ".kvslim-tmp-" + std::to_string(rd() % 1000000000u));
    std::error_code ec;
    if (!fs::exists(fs::symlink_status(p, ec))) return p;
  }
  throw std::runtime_error(target.string() + ": cannot find a free temporary name beside it");
}

bool same_file(const fs::path& a, const fs::path& b) {
  struct stat sa {}, sb {};
  const bool ea = ::stat(a.c_str(), &sa) == 0, eb = ::stat(b.c_str(), &sb) == 0;
  if (ea && eb) return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  if (ea != eb) return false;
  std::error_code ec1, ec2;
  const fs::path ca = fs::weakly_canonical(fs::absolute(a), ec1), cb = fs::weakly_canonical(fs::absolute(b), ec2);
  return !ec1 && !ec2 && ca == cb;
}

std::vector<fs::path> model_input_files(const fs::path& model) {
  std::vector<fs::path> files;
  std::error_code ec;
  if (fs::is_directory(model, ec)) {
    for (const auto& entry : fs::directory_iterator(model, ec)) {
      const std::string name = entry.path().filename().string();
      auto ends_with = [&](std::string_view s) { return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0; };
      // Not *.gguf: a directory's model is its safetensors; a GGUF converted into it may be replaced.
      if (ends_with(".safetensors") || ends_with(".safetensors.index.json") || name == "config.json" ||
          name == "generation_config.json" || name == "tokenizer.json" || name == "tokenizer_config.json" ||
          name.rfind("heldout", 0) == 0) {
        files.push_back(entry.path());
      }
    }
  } else {
    files.push_back(model);
    const fs::path dir = model.has_parent_path() ? model.parent_path() : fs::path(".");
    for (const char* text : {"heldout_sample.txt", "heldout_indist_sample.txt"}) {
      if (fs::exists(dir / text, ec)) files.push_back(dir / text);
    }
  }
  return files;
}

}  // namespace kvslim::engine
