// bulkhead-data: look at and write indexed datasets (Megatron-LM's .idx/.bin) without a job.
//
//   bulkhead-data inspect PREFIX [--json]     counts, dtype, document lengths; validates every field
//   bulkhead-data samples --data-path [W] PREFIX... --split S --seq N --seed K --steps T --batch B
//                         [--first I] [--count C] --out FILE.npy
//                                             int64 [C, N + 1]: row r is global training sample I + r,
//                                             as Megatron-LM's GPTDataset and blends draw it and as
//                                             train_moe reads it (inputs [:-1], targets [1:])
//   bulkhead-data convert IN... --out PREFIX [--format jsonl|text] [--key K] [--vocab N] [--eod ID]
//                                             JSONL of token-id arrays (each line an array, or an object
//                                             whose K holds one), or raw text as bytes for byte-level
//                                             models (a document per file, or per line with --per-line);
//                                             several inputs are merged into one dataset, in order
//
// Exit codes: 0 fine; otherwise the error's (2 a bad command line or a bad dataset, 6 I/O).

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include "data/blend.h"
#include "data/indexed_dataset.h"
#include "data/npy.h"
#include "launch/cli.h"
#include "launch/init.h"
#include "runtime/errors.h"

using namespace bulkhead;
using namespace bulkhead::data;

namespace {

using Json = nlohmann::ordered_json;

int inspect(const std::string& prefix, bool asJson) {
  IndexedDataset dataset = IndexedDataset::open(prefix);
  std::vector<int64_t> documentTokens;
  auto bounds = dataset.documentIndices();
  for (size_t d = 0; d + 1 < bounds.size(); ++d) {
    int64_t tokens = 0;
    for (int64_t s = bounds[d]; s < bounds[d + 1]; ++s) tokens += dataset.length(s);
    documentTokens.push_back(tokens);
  }
  std::vector<int64_t> sorted = documentTokens;
  std::sort(sorted.begin(), sorted.end());
  auto quantile = [&](double q) { return sorted[static_cast<size_t>(q * static_cast<double>(sorted.size() - 1))]; };
  double mean = static_cast<double>(dataset.tokens()) / static_cast<double>(std::max<int64_t>(1, dataset.documents()));
  if (asJson) {
    Json out{{"prefix", prefix},
             {"dtype", dtypeName(dataset.dtype())},
             {"sequences", dataset.sequences()},
             {"documents", dataset.documents()},
             {"tokens", dataset.tokens()},
             {"idx_bytes", dataset.indexBytes()},
             {"bin_bytes", dataset.binBytes()},
             {"document_tokens",
              {{"min", sorted.front()}, {"median", quantile(0.5)}, {"mean", mean}, {"max", sorted.back()}}}};
    fmt::print("{}\n", out.dump(2));
    return 0;
  }
  fmt::print("{}: valid indexed dataset\n", prefix);
  fmt::print("  dtype      {}\n", dtypeName(dataset.dtype()));
  fmt::print("  sequences  {}\n  documents  {}\n  tokens     {}\n", dataset.sequences(), dataset.documents(),
             dataset.tokens());
  fmt::print("  files      {}.idx {} B, {}.bin {} B\n", prefix, dataset.indexBytes(), prefix, dataset.binBytes());
  fmt::print("  document tokens: min {}, median {}, mean {:.1f}, p99 {}, max {}\n", sorted.front(), quantile(0.5), mean,
             quantile(0.99), sorted.back());
  return 0;
}

struct SampleOptions {
  std::vector<std::string> dataPath;
  std::string split = "969,30,1";
  std::string which = "train";
  int sequence = 0;
  uint32_t seed = 1234;
  int64_t steps = 0, batch = 0, first = 0, count = -1;
  int64_t evalInterval = 1000, evalIters = 100;
  std::string cacheDir, out;
};

int samples(const SampleOptions& o) {
  const Split which = o.which == "train" ? Split::Train : o.which == "valid" ? Split::Valid : Split::Test;
  const int64_t needed = splitSamples(which, o.steps, o.batch, o.evalInterval, o.evalIters);
  auto source = buildSplit(DataBlend::parse(o.dataPath), o.split, which, needed,
                           {.sequence = o.sequence, .seed = o.seed, .cacheDir = o.cacheDir});
  const int64_t count = o.count >= 0 ? o.count : needed - o.first;
  if (o.first < 0 || count < 0 || o.first + count > needed)
    throw ConfigError(fmt::format("--first {} --count {}: the run reads samples 0 to {} of the {} split", o.first,
                                  count, needed, o.which),
                      {.expected = fmt::format("--first + --count at most {} (--steps x --batch)", needed)});
  std::vector<int64_t> rows(static_cast<size_t>(count * (o.sequence + 1)));
  for (int64_t r = 0; r < count; ++r) source->sample(o.first + r, rows.data() + r * (o.sequence + 1));
  writeNpy<int64_t>(o.out, rows, {count, o.sequence + 1});
  fmt::print("wrote {}: samples {} to {} of the {} split ({} built, {} tokens each)\n", o.out, o.first, o.first + count,
             o.which, source->size(), o.sequence + 1);
  return 0;
}

struct ConvertOptions {
  std::vector<std::string> inputs;
  std::string out;
  std::string format = "jsonl";
  std::string key = "input_ids";
  int64_t vocab = 0;  // 0: from the largest id (jsonl), 256 (text)
  int64_t eod = -1;   // appended to every document when >= 0
  bool perLine = false;
};

// One JSONL line's tokens: an array of ids, or an object whose `key` holds one.
std::vector<int64_t> lineTokens(const std::string& line, const std::string& key, const std::string& where) {
  Json value = Json::parse(line, nullptr, false);
  if (value.is_discarded())
    throw ConfigError(
        fmt::format("{}: not JSON: give one array of token ids (or an object with '{}') a line", where, key));
  if (value.is_object()) value = value.contains(key) ? value[key] : Json();
  if (!value.is_array())
    throw ConfigError(
        fmt::format("{}: neither an array of token ids nor an object whose '{}' holds one (pick the "
                    "field with --key)",
                    where, key));
  std::vector<int64_t> tokens;
  tokens.reserve(value.size());
  for (const auto& id : value) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0)
      throw ConfigError(fmt::format("{}: token {} is {}, not a token id (an integer of at least 0)", where,
                                    tokens.size(), id.dump()));
    tokens.push_back(id.get<int64_t>());
  }
  return tokens;
}

// Calls `visit` with every document of the inputs, in order, reading them as it goes.
template <typename Visit>
int64_t forEachDocument(const ConvertOptions& options, Visit&& visit) {
  int64_t documents = 0;
  for (const auto& path : options.inputs) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw IoError(fmt::format("cannot read {}", path), {.expected = "a readable input file"});
    if (options.format == "text" && !options.perLine) {
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::vector<int64_t> bytes;
      for (char c : text) bytes.push_back(static_cast<unsigned char>(c));
      visit(std::move(bytes));
      ++documents;
      continue;
    }
    std::string line;
    for (int64_t number = 1; std::getline(in, line); ++number) {
      if (line.empty()) continue;
      std::vector<int64_t> tokens;
      if (options.format == "text")
        for (char c : line + "\n") tokens.push_back(static_cast<unsigned char>(c));
      else
        tokens = lineTokens(line, options.key, fmt::format("{}:{}", path, number));
      visit(std::move(tokens));
      ++documents;
    }
  }
  if (documents == 0)
    throw ConfigError("the inputs hold no document: give files with at least one non-empty line (or text)");
  return documents;
}

int convert(const ConvertOptions& options) {
  int64_t vocab = options.vocab > 0 ? options.vocab : options.format == "text" ? 256 : 0;
  if (vocab == 0) {  // a first pass finds the largest id
    int64_t largest = std::max<int64_t>(options.eod, 0);
    forEachDocument(options, [&](std::vector<int64_t> tokens) {
      for (int64_t id : tokens) largest = std::max(largest, id);
    });
    vocab = largest + 1;
  }
  if (options.eod >= vocab)
    throw ConfigError(fmt::format("--eod {} is not below --vocab {}", options.eod, vocab),
                      {.expected = "every id below the vocabulary size"});
  IndexedDatasetWriter writer(options.out, dtypeForVocabulary(vocab));
  int64_t tokens = 0;
  int64_t documents = forEachDocument(options, [&](std::vector<int64_t> document) {
    for (int64_t id : document)
      if (id >= vocab)
        throw ConfigError(fmt::format("token id {} is not below --vocab {}", id, vocab),
                          {.expected = "every id below the vocabulary size"});
    if (options.eod >= 0) document.push_back(options.eod);
    tokens += static_cast<int64_t>(document.size());
    writer.addDocument(document);
  });
  writer.finish();
  fmt::print("wrote {}.idx and {}.bin: {} documents, {} tokens, {} (vocabulary {})\n", options.out, options.out,
             documents, tokens, dtypeName(dtypeForVocabulary(vocab)), vocab);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app("Inspects and writes indexed datasets (Megatron-LM's .idx/.bin), without a job.", "bulkhead-data");
  app.require_subcommand(1);
  std::string prefix;
  bool asJson = false;
  auto* inspectCommand = app.add_subcommand("inspect", "counts, dtype and document lengths; validates every field");
  inspectCommand->add_option("PREFIX", prefix, "the dataset's prefix (PREFIX.idx, PREFIX.bin)")->required();
  inspectCommand->add_flag("--json", asJson, "print the figures as JSON");
  ConvertOptions converting;
  auto* convertCommand = app.add_subcommand("convert", "JSONL of token ids, or text as bytes, to an indexed dataset");
  convertCommand->add_option("IN", converting.inputs, "input files, merged in order")
      ->required()
      ->check(CLI::ExistingFile);
  convertCommand->add_option("--out", converting.out, "the dataset's prefix to write")->required();
  convertCommand->add_option("--format", converting.format, "jsonl (token ids) or text (bytes)")
      ->check(CLI::IsMember({"jsonl", "text"}));
  convertCommand->add_option("--key", converting.key, "the JSONL objects' field holding the ids");
  convertCommand->add_option("--vocab", converting.vocab, "the vocabulary size (picks uint16 or int32)")
      ->check(cli::positive());
  convertCommand->add_option("--eod", converting.eod, "an id appended to every document")->check(cli::nonNegative());
  convertCommand->add_flag("--per-line", converting.perLine, "text: a document per line, not per file");
  SampleOptions sampling;
  auto* samplesCommand =
      app.add_subcommand("samples", "the training samples a run reads, as Megatron-LM draws them, to a .npy file");
  samplesCommand->add_option("--data-path", sampling.dataPath, "dataset prefixes, or weight prefix pairs")->required();
  samplesCommand->add_option("--split", sampling.split, "train, valid and test weights");
  samplesCommand->add_option("--split-name", sampling.which, "the split to read")
      ->check(CLI::IsMember({"train", "valid", "test"}));
  samplesCommand->add_option("--seq", sampling.sequence, "sequence length")->required()->check(cli::positive());
  samplesCommand->add_option("--seed", sampling.seed, "Megatron's --seed");
  samplesCommand->add_option("--steps", sampling.steps, "the run's steps")->required()->check(cli::positive());
  samplesCommand->add_option("--batch", sampling.batch, "global batch")->required()->check(cli::positive());
  samplesCommand->add_option("--eval-interval", sampling.evalInterval, "steps between validations (valid split)")
      ->check(cli::positive());
  samplesCommand->add_option("--eval-iters", sampling.evalIters, "batches a validation reads (valid, test)")
      ->check(cli::nonNegative());
  samplesCommand->add_option("--first", sampling.first, "the first sample written")->check(cli::nonNegative());
  samplesCommand->add_option("--count", sampling.count, "samples written (default: all from --first)")
      ->check(cli::nonNegative());
  samplesCommand->add_option("--data-cache-path", sampling.cacheDir, "where the sample indices are cached");
  samplesCommand->add_option("--out", sampling.out, "the .npy file to write")->required();
  if (auto code = cli::parse(app, argc, argv)) return *code;

  return guardedMain([&] {
    if (inspectCommand->parsed()) return inspect(prefix, asJson);
    if (samplesCommand->parsed()) return samples(sampling);
    return convert(converting);
  });
}
