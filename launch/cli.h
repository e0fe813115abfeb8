#pragma once
// Command lines of Bulkhead's tools, examples and benches, parsed with CLI11.
//
//   bulkhead::cli::App app("Checks every process group of a layout.", "bulkhead-doctor");
//   app.add_option("--tp", options.tp, "tensor-parallel size")->check(bulkhead::cli::positive());
//   if (auto code = bulkhead::cli::parse(app, argc, argv)) return *code;
//
// The same behaviour everywhere: `--help` (or `-h`) prints the usage on stdout
// and `--version` prints "<name> <Bulkhead version>", and parse() returns 0 for
// both; an unknown flag, a missing value or a value that does not convert or
// pass its check prints "<name>: <what is wrong, naming the flag>" and a hint
// on stderr, and parse() returns 2 (ConfigError's exit code). Parse before
// init(): printing the usage starts no job.

#include <CLI/CLI.hpp>

#include <cstdint>
#include <optional>
#include <string>

#include "launch/init.h"
#include "parallel/layout.h"

namespace bulkhead::cli {

// Bulkhead's version ("0.1.0").
const char* version();

// A CLI11 App with Bulkhead's conventions: defaults shown in the usage,
// `--version`, and a footer that points at the documentation.
class App : public CLI::App {
 public:
  App(std::string description, std::string name);
};

// Parses argv into `app`. std::nullopt: go on; otherwise the program's exit
// code (0 after --help or --version, 2 for a bad command line), already
// reported as described above.
std::optional<int> parse(CLI::App& app, int argc, char** argv);

// Checks of a numeric option's value, which say what they expected:
// option->check(cli::positive()).
CLI::Validator positive();     // a number above 0
CLI::Validator nonNegative();  // a number of at least 0

// "--backend auto|mpi|gloo|nccl" into `backend`.
CLI::Option* addBackend(CLI::App& app, Backend& backend);
CLI::Option* addBackend(CLI::App& app, std::optional<Backend>& backend);

// The layout's sizes: --tp --cp --pp --ep --etp (each at least 1), --order and
// --instances (distributed-optimizer instances). Layout::create checks that
// they fit the world.
void addLayout(CLI::App& app, parallel::LayoutOptions& layout);

// A byte size into `bytes`: a number with an optional K, M or G (powers of
// 1024), "64K", "4M", "1.5G". parseBytes throws CLI::ValidationError naming
// `flag` for anything else, or a size below `minimum`.
int64_t parseBytes(const std::string& flag, const std::string& text, int64_t minimum = 1);
CLI::Option* addBytes(CLI::App& app, const std::string& flag, int64_t& bytes, const std::string& help,
                      int64_t minimum = 1);

}  // namespace bulkhead::cli
