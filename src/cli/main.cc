// The `kvslim` command: parses flags and hands over to the registered subcommands.
#include <cstdio>
#include <exception>
#include <memory>

#include "cli/command.h"

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
  for (auto& entry : registry()) {
    CLI::App* sub = app.add_subcommand(entry.name, entry.help);
    runners.emplace_back(sub, entry.setup(*sub));
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
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
