// The `kvslim` command: parses flags and hands over to the registered subcommands.
#include <cstdio>
#include <exception>
#include <map>
#include <memory>

#include "cli/command.h"
#include "cli/option_checks.h"

namespace kvslim::cli {
namespace {

struct Entry {
  std::string name, help;
  CommandSetup setup;
};

std::vector<Entry>& registry() {
  static std::vector<Entry> entries;
  return entries;
}

}  // namespace

CommandRegistrar::CommandRegistrar(std::string name, std::string help, CommandSetup setup) {
  registry().push_back({std::move(name), std::move(help), std::move(setup)});
}

}  // namespace kvslim::cli

int main(int argc, char** argv) {
  using namespace kvslim::cli;
  CLI::App app{"kvslim: KV-cache compression for LLM inference -- methods, engine, benchmarks"};
  app.require_subcommand(1);
  std::vector<std::pair<CLI::App*, std::function<int()>>> runners;
  std::map<std::string, CLI::App*> groups;  // "bench" for "bench squeeze", "bench zipcache", ...
  for (auto& entry : registry()) {
    CLI::App* parent = &app;
    std::string name = entry.name;
    if (const auto space = name.find(' '); space != std::string::npos) {
      const std::string group = name.substr(0, space);
      auto& g = groups[group];
      if (g == nullptr) {
        g = app.add_subcommand(group, group == "bench" ? "benchmarks: the original's harnesses and kvslim's kernels" : group);
        g->require_subcommand(1);
      }
      parent = g;
      name = name.substr(space + 1);
    }
    CLI::App* sub = parent->add_subcommand(name, entry.help);
    runners.emplace_back(sub, entry.setup(*sub));
  }
  refuse_negative_unsigned(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    // One line, like every other error, naming the flag (CLI11's own format takes two).
    std::fprintf(stderr, "kvslim: error: %s (see --help)\n", e.what());
    return e.get_exit_code();
  }
  try {
    for (auto& [sub, run] : runners) {
      if (sub->parsed()) return run();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvslim: error: %s\n", e.what());
    return 1;
  }
  return 1;
}
