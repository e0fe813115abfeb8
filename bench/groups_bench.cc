// Time to a job whose every group is built and warmed: Bulkhead's init() plus
// ProcessGroups::create (nccl backend). Writes the layout's groups as JSON so
// bench/torch_groups.py builds the very same groups with PyTorch in the same
// run (bench/run_groups_bench.sh runs both and prints the ratio).
//
//   mpirun -np 2 bulkhead-groups-bench --tp 2 --ep 2 --groups-out groups.json
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "launch/cli.h"
#include "launch/init.h"
#include "parallel/process_groups.h"
#include "runtime/errors.h"

using namespace bulkhead;
using namespace bulkhead::parallel;

int main(int argc, char** argv) {
  auto start = std::chrono::steady_clock::now();
  cli::App app("Time from process start to every group of a layout built and warmed (bench/run_groups_bench.sh).",
               "bulkhead-groups-bench");
  LayoutOptions layoutOptions;
  std::string groupsOut;
  cli::addLayout(app, layoutOptions);
  app.add_option("--groups-out", groupsOut, "write the layout's groups as JSON here (for bench/torch_groups.py)");
  if (auto code = cli::parse(app, argc, argv)) return *code;
  return guardedMain([&] {
    auto runtime = init();
    double initMs = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    Layout layout = Layout::create(runtime->world().size(), layoutOptions);
    ProcessGroups groups = ProcessGroups::create(runtime->worldPtr(), layout);
    double totalMs = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (runtime->world().rank() == 0) {
      std::printf("bulkhead: backend %s, world init %.1f ms, all groups built and warmed %.1f ms after start\n",
                  runtime->world().backend(), initMs, totalMs);
      std::printf("BULKHEAD_TOTAL_MS %.1f\n", totalMs);
      if (!groupsOut.empty()) {
        nlohmann::json json = nlohmann::json::array();
        for (GroupKind kind : allGroupKinds())
          for (const auto& members : layout.groups(kind))
            json.push_back({{"kind", toString(kind)}, {"ranks", members}});
        std::ofstream file(groupsOut);
        file << json.dump() << '\n';
        if (!file) throw IoError(fmt::format("cannot write {}", groupsOut));
      }
    }
    return 0;
  });
}
