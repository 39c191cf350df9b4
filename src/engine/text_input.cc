#include "engine/text_input.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace kvslim::engine {

std::string read_text_input(const std::string& path, const std::string& flag, std::uint64_t max_bytes) {
  const std::string name = flag + " " + path;
  const bool is_stdin = path == "-";
  const int fd = is_stdin ? STDIN_FILENO : ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(name + ": cannot open (" + std::strerror(errno) + ")");
  struct Closer {
    int fd;
    bool own;
    ~Closer() {
      if (own) ::close(fd);
    }
  } closer{fd, !is_stdin};
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) throw std::runtime_error(name + ": is a directory, expected a text file");
  auto too_large = [&] {
    return std::runtime_error(name + ": more than " + std::to_string(max_bytes) + " bytes (the limit for " + flag +
                              "; an endless stream such as /dev/zero is stopped there)");
  };
  if (S_ISREG(st.st_mode) && static_cast<std::uint64_t>(st.st_size) > max_bytes) throw too_large();
  std::string text;
  if (S_ISREG(st.st_mode)) text.reserve(static_cast<std::size_t>(st.st_size));
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EISDIR) throw std::runtime_error(name + ": is a directory, expected a text file");
      throw std::runtime_error(name + ": read error (" + std::strerror(errno) + ")");
    }
    if (n == 0) break;
    if (text.size() + static_cast<std::size_t>(n) > max_bytes) throw too_large();
    text.append(buf, static_cast<std::size_t>(n));
  }
  return text;
}

}  // namespace kvslim::engine
