// The halfgrad command-line program. Subcommands arrive with the work that needs them (training,
// benchmark sweeps); `info` tells what this build is.
#include <CLI/CLI.hpp>

#include <iostream>

#include "core/version.h"

int main(int argc, char** argv) {
  CLI::App app{"halfgrad: a C++ deep-learning framework with dynamic-graph autograd and mixed precision"};
  app.require_subcommand(1);
  app.set_version_flag("--version", halfgrad::version());

  CLI::App* info = app.add_subcommand("info", "Print the version and the backends compiled into this build");
  info->callback([] { std::cout << halfgrad::build_summary() << "\n"; });

  CLI11_PARSE(app, argc, argv);
  return 0;
}
