// Runs the kvslim binary as a user does, for the CLI tests: exit code, stdout and stderr.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace kvslim::cli_testing {

struct Result {
  int exit_code = -1;  // -1: killed by a signal (a crash)
  std::string out, err;
};

// `args` goes through the shell (quote as needed); `stdin_text`, when given, is piped in; `env`
// prefixes the command with variable assignments ("PATH=/nonexistent").
inline Result run_cli(const std::string& args, const std::string* stdin_text = nullptr, const std::string& env = "") {
  namespace fs = std::filesystem;
  const std::string tag = std::to_string(getpid());
  const fs::path err_file = fs::temp_directory_path() / ("kvslim_cli_err_" + tag);
  const fs::path in_file = fs::temp_directory_path() / ("kvslim_cli_in_" + tag);
  std::string cmd = env + " " + std::string(KVSLIM_CLI_PATH) + " " + args + " 2>" + err_file.string();
  if (stdin_text != nullptr) {
    std::ofstream(in_file, std::ios::binary) << *stdin_text;
    cmd += " <" + in_file.string();
  }
  Result r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  std::size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) r.out.append(buf, n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err_file);
  std::stringstream ss;
  ss << in.rdbuf();
  r.err = ss.str();
  fs::remove(err_file);
  fs::remove(in_file);
  return r;
}

}  // namespace kvslim::cli_testing
