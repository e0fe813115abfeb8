#include "launch/cli.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>

#ifndef BULKHEAD_VERSION
#error "BULKHEAD_VERSION is set by launch/CMakeLists.txt"
#endif

namespace bulkhead::cli {

const char* version() { return BULKHEAD_VERSION; }

App::App(std::string description, std::string name) : CLI::App(std::move(description), std::move(name)) {
  option_defaults()->always_capture_default();
  set_version_flag("--version", fmt::format("{} {}", get_name(), cli::version()), "print the version and exit");
  footer("Exit codes and what to do: see \"Troubleshooting\" in Bulkhead's README.");
}

namespace {

// The option `name` ("--tp", "-h") of `app` or of an app above it, or null.
const CLI::Option* known(const CLI::App* app, const std::string& name) {
  for (; app != nullptr; app = app->get_parent())
    if (const CLI::Option* option = app->get_option_no_throw(name)) return option;
  return nullptr;
}

// CLI11 checks required options and subcommands before it reports arguments
// it does not know; a mistyped flag is the likelier cause, so it is named
// first: an unknown "--flag" (or "--flag=value"), or an unknown subcommand
// where one is required.
void checkNames(const CLI::App& app, int argc, char** argv) {
  const CLI::App* current = &app;
  bool positionalSeen = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") return;
    if (arg.size() > 2 && arg.rfind("--", 0) == 0) {
      const size_t equals = arg.find('=');
      const CLI::Option* option = known(current, arg.substr(0, equals));
      if (option == nullptr) throw CLI::ExtrasError({arg});
      if (equals == std::string::npos && option->get_expected_min() > 0) ++i;  // its value, whatever it looks like
      continue;
    }
    if (arg.size() > 1 && arg[0] == '-') continue;  // short flags and negative numbers: CLI11 judges them
    auto subcommands = current->get_subcommands([](const CLI::App*) { return true; });
    auto match =
        std::find_if(subcommands.begin(), subcommands.end(), [&](const CLI::App* sub) { return sub->check_name(arg); });
    if (match != subcommands.end()) {
      current = *match;
      positionalSeen = false;
    } else if (!subcommands.empty() && current->get_require_subcommand_min() > 0 && !positionalSeen) {
      std::vector<std::string> names;
      for (const CLI::App* sub : subcommands) names.push_back(sub->get_name());
      throw CLI::ValidationError(
          fmt::format("unknown subcommand '{}': expected one of {}", arg, fmt::join(names, ", ")));
    } else {
      positionalSeen = true;
    }
  }
}

}  // namespace

std::optional<int> parse(CLI::App& app, int argc, char** argv) {
  try {
    checkNames(app, argc, argv);
    app.parse(argc, argv);
    return std::nullopt;
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help() << std::flush;
    return 0;
  } catch (const CLI::CallForAllHelp&) {
    std::cout << app.help("", CLI::AppFormatMode::All) << std::flush;
    return 0;
  } catch (const CLI::CallForVersion& e) {
    std::cout << e.what() << std::endl;
    return 0;
  } catch (const CLI::ParseError& e) {
    std::cerr << app.get_name() << ": " << e.what() << "\n"
              << "Run '" << app.get_name() << " --help' for the flags." << std::endl;
    return 2;
  }
}

namespace {

CLI::Validator atLeast(double minimum, bool inclusive, const std::string& name, const std::string& what) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        char* end = nullptr;
        const double value = std::strtod(text.c_str(), &end);
        const bool number = end != text.c_str() && *end == '\0' && std::isfinite(value);
        if (number && (inclusive ? value >= minimum : value > minimum)) return {};
        return fmt::format("'{}' is not {}", text, what);
      },
      name);
}

}  // namespace

CLI::Validator positive() { return atLeast(0, false, "POSITIVE", "a number above 0"); }
CLI::Validator nonNegative() { return atLeast(0, true, "NONNEGATIVE", "a number of at least 0"); }

namespace {

constexpr const char* kBackendHelp =
    "communication backend: auto (nccl when every rank has a GPU of its own; else mpi under an MPI launcher, "
    "gloo under any other), mpi, gloo or nccl";

}  // namespace

CLI::Option* addBackend(CLI::App& app, Backend& backend) {
  return app
      .add_option_function<std::string>(
          "--backend", [&backend](const std::string& name) { backend = parseBackend(name); }, kBackendHelp)
      ->check(CLI::IsMember({"auto", "mpi", "gloo", "nccl"}))
      ->default_str(toString(backend));
}

CLI::Option* addBackend(CLI::App& app, std::optional<Backend>& backend) {
  return app
      .add_option_function<std::string>(
          "--backend", [&backend](const std::string& name) { backend = parseBackend(name); },
          std::string(kBackendHelp) + " (default: BULKHEAD_BACKEND)")
      ->check(CLI::IsMember({"auto", "mpi", "gloo", "nccl"}));
}

void addLayout(CLI::App& app, parallel::LayoutOptions& layout) {
  const CLI::Validator size = positive();
  app.add_option("--tp", layout.tp, "tensor-parallel size")->check(size);
  app.add_option("--cp", layout.cp, "context-parallel size")->check(size);
  app.add_option("--pp", layout.pp, "pipeline-parallel size")->check(size);
  app.add_option("--ep", layout.ep, "expert-parallel size")->check(size);
  app.add_option("--etp", layout.etp, "expert tensor-parallel size")->check(size);
  app.add_option("--order", layout.order, "rank order, leftmost fastest; names tp, cp, ep, dp and pp once each");
  app.add_option("--instances", layout.optimizerInstances, "distributed-optimizer instances (split expert dp)")
      ->check(size);
}

int64_t parseBytes(const std::string& flag, const std::string& text, int64_t minimum) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  const std::string unit(end);
  const double scale = unit.empty() ? 1 : unit == "K" ? 0x1p10 : unit == "M" ? 0x1p20 : unit == "G" ? 0x1p30 : -1;
  if (end == text.c_str() || scale < 0 || !std::isfinite(value) || value * scale < static_cast<double>(minimum) ||
      value * scale > 0x1p50)
    throw CLI::ValidationError(
        flag, fmt::format("'{}' is not a size of at least {} bytes like 64K, 4M or 1G", text, minimum));
  return static_cast<int64_t>(value * scale);
}

CLI::Option* addBytes(CLI::App& app, const std::string& flag, int64_t& bytes, const std::string& help,
                      int64_t minimum) {
  return app
      .add_option_function<std::string>(
          flag, [&bytes, flag, minimum](const std::string& text) { bytes = parseBytes(flag, text, minimum); }, help)
      ->type_name("SIZE")
      ->default_str(std::to_string(bytes));
}

}  // namespace bulkhead::cli
