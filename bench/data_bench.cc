// The sample index of a dataset at scale: a real .idx of --documents documents holding --tokens tokens in
// all (lengths drawn around the mean), beside a sparse .bin of the right size, then the train split's
// GPTDataset for --steps x --batch samples of --seq, built, then read back from its cache, and the first
// samples read. Prints one table row per phase (seconds).
//
//   bulkhead-data-bench --dir /tmp/d --documents 2000000 --tokens 1000000000 --seq 4096 --batch 512 --steps 500
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "data/blend.h"
#include "launch/cli.h"
#include "launch/init.h"
#include "runtime/errors.h"
#include "runtime/fd.h"

using namespace bulkhead;

namespace {

double since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

template <typename T>
void append(std::string& out, const T& value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// PREFIX.idx with `documents` uint16 documents of `tokens` in all, PREFIX.bin sparse at their size.
void writeDataset(const std::string& prefix, int64_t documents, int64_t tokens) {
  std::mt19937_64 rng(1);
  std::vector<int32_t> lengths(static_cast<size_t>(documents));
  const int64_t mean = tokens / documents;
  int64_t total = 0;
  for (auto& length : lengths) total += length = static_cast<int32_t>(1 + rng() % (2 * mean - 1));
  lengths.back() += static_cast<int32_t>(tokens - total);  // exactly `tokens`
  std::string index("MMIDIDX\0\0", 9);
  append<uint64_t>(index, 1);
  index.push_back(8);  // uint16
  append<uint64_t>(index, lengths.size());
  append<uint64_t>(index, lengths.size() + 1);
  for (int32_t length : lengths) append(index, length);
  int64_t pointer = 0;
  for (int32_t length : lengths) {
    append(index, pointer);
    pointer += 2 * int64_t{length};
  }
  for (size_t d = 0; d <= lengths.size(); ++d) append<int64_t>(index, static_cast<int64_t>(d));
  Fd idx(::open((prefix + ".idx").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644));
  if (!idx.valid() || idx.writeAll(index.data(), index.size()) != 0) throw IoError(prefix + ".idx: cannot be written");
  Fd bin(::open((prefix + ".bin").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644));
  if (!bin.valid() || ::ftruncate(bin.get(), pointer) != 0) throw IoError(prefix + ".bin: cannot be sized");
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app("Builds and caches the sample index of a large indexed dataset, timed.", "bulkhead-data-bench");
  std::string dir;
  int64_t documents = 2'000'000, tokens = 1'000'000'000, batch = 512, steps = 500;
  int sequence = 4096;
  app.add_option("--dir", dir, "a folder for the dataset and the cache")->required();
  app.add_option("--documents", documents, "documents")->check(cli::positive());
  app.add_option("--tokens", tokens, "tokens in all")->check(cli::positive());
  app.add_option("--seq", sequence, "sequence length")->check(cli::positive());
  app.add_option("--batch", batch, "global batch")->check(cli::positive());
  app.add_option("--steps", steps, "steps")->check(cli::positive());
  if (auto code = cli::parse(app, argc, argv)) return *code;
  return guardedMain([&] {
    const std::string prefix = dir + "/bench";
    auto start = std::chrono::steady_clock::now();
    writeDataset(prefix, documents, tokens);
    fmt::print("| write the .idx ({} documents, {} tokens) and a sparse .bin | {:.2f} |\n", documents, tokens,
               since(start));
    const data::GptDatasetOptions options{.sequence = sequence, .seed = 1234, .cacheDir = dir + "/cache"};
    const auto blend = data::DataBlend::parse({prefix});
    for (const char* phase : {"build the train split's index (969,30,1)", "load it from the cache"}) {
      start = std::chrono::steady_clock::now();
      auto source = data::buildSplit(blend, "969,30,1", data::Split::Train, steps * batch, options);
      const double seconds = since(start);
      const auto& gpt = dynamic_cast<const data::GptDataset&>(*source);
      fmt::print("| {}: {} samples, {} epochs{} | {:.2f} |\n", phase, gpt.size(), gpt.epochs(),
                 gpt.fromCache() ? ", from the cache" : "", seconds);
      std::vector<int64_t> row(static_cast<size_t>(sequence + 1));
      start = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < batch; ++i) source->sample(i, row.data());
      fmt::print("| read the first global batch ({} samples) | {:.3f} |\n", batch, since(start));
    }
    return 0;
  });
}
