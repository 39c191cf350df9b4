// Subcommand registry: each cmd_*.cc registers itself with a static CommandRegistrar, so adding a
// command never touches main.cc.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace kvslim::cli {

// `setup` adds the subcommand's flags (each with its default and help in one place) and returns
// the function that runs it; that function returns the process exit code.
using CommandSetup = std::function<std::function<int()>(CLI::App& subcommand)>;

// A name with a space ("bench squeeze") registers a subcommand of a group ("bench").
struct CommandRegistrar {
  CommandRegistrar(std::string name, std::string help, CommandSetup setup);
};


}  // namespace kvslim::cli
