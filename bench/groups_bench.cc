// Time to a job whose every group is built and warmed: Bulkhead's init() plus
// ProcessGroups::create (nccl backend). Writes the layout's groups as JSON so
// bench/torch_groups.py builds the very same groups with PyTorch in the same
// run (bench/run_groups_bench.sh runs both and prints the ratio).
//
//   mpirun -np 2 bulkhead-groups-bench --tp 2 --ep 2 --groups-out groups.json
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "launch/init.h"
#include "parallel/process_groups.h"
#include "runtime/errors.h"

using namespace bulkhead;
using namespace bulkhead::parallel;

int main(int argc, char** argv) {
  auto start = std::chrono::steady_clock::now();
  return guardedMain([&] {
    LayoutOptions layoutOptions;
    std::string groupsOut;
    for (int i = 1; i + 1 < argc; i += 2) {
      std::string flag = argv[i];
      int value = flag == "--groups-out" ? 0 : std::stoi(argv[i + 1]);
      if (flag == "--tp") layoutOptions.tp = value;
      else if (flag == "--ep") layoutOptions.ep = value;
      else if (flag == "--pp") layoutOptions.pp = value;
      else if (flag == "--cp") layoutOptions.cp = value;
      else if (flag == "--groups-out") groupsOut = argv[i + 1];
      else throw ConfigError(fmt::format("unknown flag {}", flag));
    }
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
        std::string json = "[";
        for (GroupKind kind : allGroupKinds())
          for (const auto& members : layout.groups(kind))
            json += fmt::format("{}{{\"kind\": \"{}\", \"ranks\": [{}]}}", json.size() > 1 ? ", " : "",
                                toString(kind), fmt::join(members, ", "));
        json += "]\n";
        std::FILE* file = std::fopen(groupsOut.c_str(), "w");
        if (!file) throw IoError(fmt::format("cannot write {}", groupsOut));
        std::fputs(json.c_str(), file);
        std::fclose(file);
      }
    }
    return 0;
  });
}
