// Checkpoints that travel, in one process: the safetensors reader and writer
// (round trip, every refusal, 10,000 mutated files), the key map, and
// export -> import -> diff of a checkpoint with split and transposed tensors.

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "checkpoint/checkpointer.h"
#include "checkpoint/convert.h"
#include "checkpoint/key_map.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_reader.h"
#include "runtime/errors.h"
#include "runtime/store/file_store.h"
#include "tests/support/catch_compat.h"
#include "tests/support/temp_dir.h"
#include "tests/support/text.h"

using namespace bulkhead;
using namespace bulkhead::checkpoint;

namespace {

std::string readBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void writeBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A file of a header written by hand and `data` bytes of data.
std::string crafted(const std::string& json, size_t data) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  return bytes + json + std::string(data, '\x5a');
}

at::Tensor randomTensor(std::mt19937_64& rng, at::IntArrayRef shape, at::ScalarType dtype) {
  at::Tensor values = at::empty(shape, at::kDouble);
  std::uniform_real_distribution<double> uniform(-3, 3);
  auto* data = values.data_ptr<double>();
  for (int64_t i = 0; i < values.numel(); ++i) data[i] = uniform(rng);
  if (dtype == at::kBool) return values.gt(0);
  if (at::isIntegralType(dtype, false)) return (values * 20).round().to(dtype);
  return values.to(dtype);
}

// Writes `tensors` through SafetensorsWriter; returns the file's bytes.
std::string writeFile(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<SafetensorsTensor> header;
  for (const auto& [name, tensor] : tensors) header.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  SafetensorsWriter writer(path, header, {{"format", "pt"}});
  for (const auto& [name, tensor] : tensors) {
    at::Tensor contiguous = tensor.contiguous();
    // In two parts, as export writes pieces.
    const int64_t half = static_cast<int64_t>(contiguous.nbytes()) / 2;
    writer.append(contiguous.data_ptr(), half);
    writer.append(static_cast<char*>(contiguous.data_ptr()) + half, static_cast<int64_t>(contiguous.nbytes()) - half);
  }
  writer.finish();
  return readBytes(path);
}

std::string refusal(const std::string& path) {
  try {
    SafetensorsFile file(path);
    for (const auto& tensor : file.header().tensors) file.read(tensor);
  } catch (const CheckpointError& error) {
    return error.what();
  }
  return "";
}

using bulkhead::testing::contains;

}  // namespace

TEST_CASE("safetensors: written tensors of every dtype read back bit for bit, 8-byte aligned, with metadata") {
  testing::TempDir dir;
  std::mt19937_64 rng(11);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  const std::vector<at::ScalarType> dtypes{at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong,
                                           at::kInt,    at::kShort, at::kChar, at::kByte,     at::kBool};
  for (size_t i = 0; i < dtypes.size(); ++i)
    tensors.emplace_back(
        fmt::format("t{}.{}", i, c10::toString(dtypes[i])),
        randomTensor(rng, {static_cast<int64_t>(i % 3 + 1), 7, static_cast<int64_t>(i + 2)}, dtypes[i]));
  tensors.emplace_back("scalar", randomTensor(rng, {}, at::kFloat));
  tensors.emplace_back("empty", at::empty({0, 4}, at::kFloat));
  const std::string path = dir.path() + "/a.safetensors";
  const std::string bytes = writeFile(path, tensors);
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<unsigned char>(bytes[i]);
  CHECK(length % 8 == 0);
  CHECK(!std::ifstream(path + ".partial").good());

  SafetensorsFile file(path);
  REQUIRE(file.header().tensors.size() == tensors.size());
  CHECK(file.header().metadata.at("format") == "pt");
  for (const auto& [name, tensor] : tensors) {
    const SafetensorsTensor* entry = file.find(name);
    REQUIRE(entry != nullptr);
    CHECK(entry->dtype == tensor.scalar_type());
    CHECK(entry->shape == tensor.sizes().vec());
    CHECK(at::equal(file.read(*entry), tensor));
  }
  CHECK(safetensorsDtypeName(at::kBFloat16) == "BF16");
  CHECK_THROWS_AS(safetensorsDtypeName(at::kComplexFloat), ConfigError);
}

TEST_CASE("safetensors: a file of 64 MB or more, written through aligned buffers, reads back bit for bit") {
  testing::TempDir dir;
  std::mt19937_64 rng(17);
  // Odd sizes, so the tensors straddle the 32 MB staging buffers and the last block is partial.
  std::vector<std::pair<std::string, at::Tensor>> tensors{
      {"a", at::randint(0, 256, {40 * 1024 * 1024 + 3}, at::kByte)},
      {"b", randomTensor(rng, {7, 3}, at::kBFloat16)},
      {"c", at::randint(0, 256, {30 * 1024 * 1024 + 4093}, at::kByte)}};
  const std::string path = dir.path() + "/big.safetensors";
  {
    std::vector<SafetensorsTensor> header;
    for (const auto& [name, tensor] : tensors) header.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
    SafetensorsWriter writer(path, header);
    for (const auto& [name, tensor] : tensors) {
      const auto* bytes = static_cast<const char*>(tensor.data_ptr());
      const int64_t total = static_cast<int64_t>(tensor.nbytes());
      for (int64_t at = 0; at < total;) {
        const int64_t part = std::min<int64_t>(total - at, 1 + static_cast<int64_t>(rng() % (9 << 20)));
        writer.append(bytes + at, part);
        at += part;
      }
    }
    writer.finish();
  }
  SafetensorsFile file(path);
  CHECK(file.header().dataStart % 8 == 0);
  for (const auto& [name, tensor] : tensors) CHECK(at::equal(file.read(*file.find(name)), tensor));
}

TEST_CASE(
    "safetensors: a writer refuses more bytes than its tensors hold and an incomplete finish, and leaves no file") {
  testing::TempDir dir;
  const std::string path = dir.path() + "/w.safetensors";
  {
    SafetensorsWriter writer(path, {{"x", at::kFloat, {2}}});
    float values[3] = {1, 2, 3};
    CHECK_THROWS_AS(writer.append(values, 12), ConfigError);
  }
  {
    SafetensorsWriter writer(path, {{"x", at::kFloat, {2}}});
    float values[1] = {1};
    writer.append(values, 4);
    CHECK_THROWS_AS(writer.finish(), ConfigError);
  }
  CHECK(!std::ifstream(path).good());
  CHECK(!std::ifstream(path + ".partial").good());
}

TEST_CASE("safetensors: damaged and hostile files are refused with the problem named") {
  testing::TempDir dir;
  const std::string path = dir.path() + "/bad.safetensors";
  auto refused = [&](const std::string& bytes, const std::string& expected) {
    writeBytes(path, bytes);
    const std::string message = refusal(path);
    INFO(message);
    CHECK(contains(message, expected));
    CHECK(contains(message, path));
  };
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  REQUIRE(refusal((writeBytes(path, crafted(ok, 16)), path)).empty());

  refused(std::string("\x10\x00\x00", 3), "fewer than the 8");
  refused(crafted(ok, 16).substr(0, 20), "runs past the end of the file");
  std::string huge = crafted(ok, 16);
  huge[7] = '\x7f';
  refused(huge, "runs past the end of the file");
  refused(crafted(ok, 8), "outside the 8 bytes of data");  // a truncated file
  refused(crafted(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
                  R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                  16),
          "overlap");
  refused(crafted(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[16,32]}})", 16), "outside");
  refused(crafted(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[8,4]}})", 16), "outside");
  refused(crafted(R"({"a":{"dtype":"F32","shape":[3,2],"data_offsets":[0,16]}})", 32), "24 by its dtype and shape");
  refused(crafted(R"({"a":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]}})", 4), "dtype 'F8_E4M3'");
  refused(crafted(R"({"a":{"dtype":"F32","shape":[-2,2],"data_offsets":[0,16]}})", 16), "non-negative integer");
  refused(crafted(R"({"a":{"dtype":"F32","shape":[1099511627777],"data_offsets":[0,16]}})", 16), "below 2^40");
  refused(crafted(R"({"a":{"dtype":"F64","shape":[1073741824,1073741824],"data_offsets":[0,16]}})", 16), "2^60");
  refused(crafted(R"({"a":{"dtype":"F32","shape":[4]}})", 16), "data_offsets");
  refused(crafted(R"({"a":{"shape":[4],"data_offsets":[0,16]}})", 16), "no dtype");
  refused(crafted(R"({"a":[1,2,3]})", 16), "not a JSON object");
  refused(crafted(R"([1,2])", 16), "not a JSON object");
  refused(crafted(R"({"a":{"dtype":"F32",)", 16), "not valid JSON");
  refused(crafted(R"({"__metadata__":{"k":5}})", 0), "__metadata__");
  refused(crafted(R"({"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4), "without a name");
}

TEST_CASE("safetensors: 10,000 mutated files are each read whole and in blocks or refused, never out of bounds") {
  testing::TempDir dir;
  std::mt19937_64 rng(2024);
  const std::string valid =
      writeFile(dir.path() + "/seed.safetensors",
                {{"model.layers.0.mlp.experts.0.gate_proj.weight", randomTensor(rng, {4, 6}, at::kBFloat16)},
                 {"model.layers.0.mlp.gate.weight", randomTensor(rng, {3, 6}, at::kFloat)},
                 {"model.norm.weight", randomTensor(rng, {6}, at::kDouble)},
                 {"optim.step", randomTensor(rng, {1}, at::kLong)},
                 {"mask", randomTensor(rng, {5}, at::kBool)}});
  uint64_t headerEnd = 0;
  for (int i = 7; i >= 0; --i) headerEnd = (headerEnd << 8) | static_cast<unsigned char>(valid[i]);
  headerEnd += 8;
  const std::vector<std::string> tokens{
      "0",     "-1",    "18446744073709551615", "1e30", "\"F32\"", "\"BF16\"", "[]", "{}",     "null",
      "[0,4]", "[4,0]", "9999999999",           ",",    "]",       "}",        "\"", "\\u0000"};
  const std::string path = dir.path() + "/fuzz.safetensors";
  int refused = 0, read = 0;
  for (int round = 0; round < 10000; ++round) {
    std::string bytes = valid;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % bytes.size();
      // Where the header lies in this copy, as far as it is still there.
      const size_t header =
          std::max<size_t>(1, std::min<size_t>(headerEnd, bytes.size()) - std::min<size_t>(8, bytes.size() - 1));
      switch (rng() % 6) {
        case 0:
          bytes[at] = static_cast<char>(rng());
          break;  // any byte
        case 1:
          bytes[std::min<size_t>(8 + rng() % header, bytes.size() - 1)] = static_cast<char>(rng());
          break;
        case 2:
          bytes.resize(at);
          break;   // truncated
        case 3: {  // a JSON token swapped in
          const size_t in = std::min<size_t>(8 + rng() % header, bytes.size());
          bytes.replace(in, rng() % 6, tokens[rng() % tokens.size()]);
          break;
        }
        case 4: {  // another header length
          const uint64_t length = rng() % 3 == 0 ? rng() : rng() % (bytes.size() + 64);
          for (int i = 0; i < 8 && i < static_cast<int>(bytes.size()); ++i)
            bytes[i] = static_cast<char>(length >> (8 * i));
          break;
        }
        default:
          bytes.insert(at, bytes.substr(rng() % bytes.size(), rng() % 32));
          break;  // a run repeated
      }
      if (bytes.empty()) break;
    }
    writeBytes(path, bytes);
    try {
      SafetensorsFile file(path);
      for (const auto& tensor : file.header().tensors) {
        at::Tensor value = file.read(tensor);
        REQUIRE(static_cast<int64_t>(value.nbytes()) == tensor.bytes());
        REQUIRE(file.header().dataStart + tensor.end <= static_cast<int64_t>(bytes.size()));
        // A random block reads as that block of the whole tensor, byte for byte.
        std::vector<int64_t> offsets, sizes;
        at::Tensor want = value;
        for (size_t d = 0; d < tensor.shape.size(); ++d) {
          const int64_t extent = tensor.shape[d], begin = extent > 0 ? static_cast<int64_t>(rng() % extent) : 0;
          offsets.push_back(begin);
          sizes.push_back(extent > 0 ? 1 + static_cast<int64_t>(rng() % (extent - begin)) : 0);
          want = want.narrow(static_cast<int64_t>(d), begin, sizes.back());
        }
        const at::Tensor block = file.readBlock(tensor, offsets, sizes), whole = want.contiguous();
        REQUIRE(block.nbytes() == whole.nbytes());
        REQUIRE(std::memcmp(block.data_ptr(), whole.data_ptr(), block.nbytes()) == 0);
      }
      ++read;
    } catch (const CheckpointError&) {
      ++refused;
    }
  }
  INFO(fmt::format("{} read, {} refused", read, refused));
  WARN(fmt::format("mutated safetensors files: {} read whole, {} refused", read, refused));
  CHECK(read + refused == 10000);
  CHECK(refused > 5000);
  CHECK(read > 50);
}

TEST_CASE("key map: splits and transposes map out and back; bad maps are refused with the rule named") {
  const KeyMap map = KeyMap::parse(R"({"format": "bulkhead-keymap 1", "tensors": [
      {"bulkhead": "layers.{layer}.experts.w13", "hf": "m.layers.{layer}.experts.{expert}.{proj}.weight",
       "split": ["expert", {"proj": ["gate_proj", "up_proj"]}]},
      {"bulkhead": "layers.{layer}.proj", "hf": "m.layers.{layer}.proj.weight", "transpose": true},
      {"bulkhead": "embed", "hf": "m.embed_tokens.weight"}]})",
                                   "test map");
  auto out = map.outward("layers.12.experts.w13", {3, 2, 5, 4});
  REQUIRE(out);
  CHECK(out->splitDims == 2);
  REQUIRE(out->pieces.size() == 6);
  CHECK(out->pieces[0].name == "m.layers.12.experts.0.gate_proj.weight");
  CHECK(out->pieces[3].name == "m.layers.12.experts.1.up_proj.weight");
  CHECK(out->pieces[3].index == std::vector<int64_t>{1, 1});
  for (const auto& piece : out->pieces) {
    auto in = map.inward(piece.name);
    REQUIRE(in);
    CHECK(in->key == "layers.12.experts.w13");
    CHECK(in->index == piece.index);
    CHECK(in->splitSizes == std::vector<int64_t>{-1, 2});
  }
  auto transposed = map.outward("layers.0.proj", {3, 4});
  REQUIRE(transposed);
  CHECK(transposed->transpose);
  CHECK(map.inward("m.layers.0.proj.weight")->transpose);
  CHECK(!map.outward("layers.x.proj", {3, 4}));
  CHECK(!map.outward("head", {3}));
  CHECK(!map.inward("m.layers.01.proj.weight"));  // one spelling per number
  CHECK(!map.inward("m.layers.0.experts.0.down_proj.weight"));
  CHECK_THROWS_AS(map.outward("layers.0.experts.w13", {3, 3, 5, 4}), ConfigError);  // names 2, has 3
  CHECK_THROWS_AS(map.outward("layers.0.proj", {3}), ConfigError);

  auto refusedMap = [](const std::string& tensors, const std::string& expected) {
    try {
      KeyMap::parse(R"({"format": "bulkhead-keymap 1", "tensors": [)" + tensors + "]}", "m.json");
    } catch (const ConfigError& error) {
      INFO(error.what());
      CHECK(contains(error.what(), expected));
      CHECK(contains(error.what(), "m.json, rule 1"));
      return;
    }
    FAIL("accepted: " << tensors);
  };
  refusedMap(R"({"bulkhead": "a.{l}", "hf": "b"})", "missing from the \"hf\" pattern");
  refusedMap(R"({"bulkhead": "a", "hf": "b.{e}"})", "neither in \"bulkhead\" nor a split");
  refusedMap(R"({"bulkhead": "a.{e}", "hf": "b.{e}", "split": ["e"]})", "belongs in \"hf\" only");
  refusedMap(R"({"bulkhead": "a", "hf": "b.{e}{f}", "split": ["e", "f"]})", "two placeholders");
  refusedMap(R"({"bulkhead": "a", "hf": "b.{e", "split": ["e"]})", "without");
  refusedMap(R"({"bulkhead": "a", "hf": "b", "split": ["e"]})", "does not appear");
  refusedMap(R"({"bulkhead": "a", "hf": "b.{p}", "split": [{"p": ["x", "x"]}]})", "distinct");
  refusedMap(R"({"bulkhead": "a", "hf": "b", "transpose": 1})", "transpose");
  CHECK_THROWS_AS(KeyMap::parse(R"({"format": "other", "tensors": []})", "m"), ConfigError);
  CHECK_THROWS_AS(KeyMap::parse("not json", "m"), ConfigError);
  CHECK_NOTHROW(KeyMap::load(BULKHEAD_HF_MAP));
}

namespace {

// A one-rank checkpoint of random tensors, some split into slices.
std::map<std::string, at::Tensor> saveCheckpoint(const std::string& dir, const std::string& ckpt, int64_t step) {
  std::mt19937_64 rng(static_cast<uint64_t>(step) + 5);
  std::map<std::string, at::Tensor> tensors{{"layers.0.experts.w13", randomTensor(rng, {4, 2, 6, 5}, at::kBFloat16)},
                                            {"layers.1.experts.w13", randomTensor(rng, {4, 2, 6, 5}, at::kBFloat16)},
                                            {"layers.0.proj", randomTensor(rng, {5, 7}, at::kFloat)},
                                            {"embed", randomTensor(rng, {9, 5}, at::kDouble)},
                                            {"optim.step", randomTensor(rng, {1}, at::kLong)},
                                            {"optim.embed.exp_avg", randomTensor(rng, {9, 5}, at::kDouble)}};
  StateDict state;
  for (const auto& [key, tensor] : tensors) {
    if (key == "layers.0.experts.w13") {  // in two slices along the experts, as ep 2 saves it
      state.add(key, tensor.narrow(0, 0, 2), {.globalShape = {4, 2, 6, 5}, .offsets = {0, 0, 0, 0}});
      state.add(key, tensor.narrow(0, 2, 2), {.globalShape = {4, 2, 6, 5}, .offsets = {2, 0, 0, 0}});
    } else {
      state.addWhole(key, tensor);
    }
  }
  auto store = std::make_shared<FileStore>(dir + "/store-" + std::to_string(step));
  auto checkpointer = Checkpointer::create({.dir = ckpt, .timeoutSeconds = 30, .chunkBytes = 4096}, store, 0, 1);
  checkpointer->save(step, state);
  REQUIRE(checkpointer->wait(Deadline::afterSeconds(30)).ok);
  return tensors;
}

const char* kMap = R"({"format": "bulkhead-keymap 1", "tensors": [
    {"bulkhead": "layers.{layer}.experts.w13", "hf": "m.layers.{layer}.experts.{expert}.{proj}.weight",
     "split": ["expert", {"proj": ["gate_proj", "up_proj"]}]},
    {"bulkhead": "layers.{layer}.proj", "hf": "m.layers.{layer}.proj.weight", "transpose": true},
    {"bulkhead": "embed", "hf": "m.embed_tokens.weight"}]})";

}  // namespace

TEST_CASE("export -> import -> diff: split and transposed tensors, several shards, optimizer state kept apart") {
  testing::TempDir dir;
  const std::string map = dir.path() + "/map.json";
  writeBytes(map, kMap);
  const auto saved = saveCheckpoint(dir.path(), dir.path() + "/a", 7);

  ExportOptions exporting{
      .dir = dir.path() + "/a", .out = dir.path() + "/hf", .map = map, .withOptimizer = true, .shardBytes = 300};
  const ExportReport exported = exportSafetensors(exporting);
  CHECK(exported.step == 7);
  CHECK(exported.tensors == 2 * 8 + 1 + 1 + 2);
  // The files hold the pieces: expert 3's up projection of layer 0 is w13[3][1]; the proj is transposed.
  auto firstModel = std::find_if(exported.files.begin(), exported.files.end(),
                                 [](const std::string& name) { return name.rfind("model-", 0) == 0; });
  REQUIRE(firstModel != exported.files.end());
  CHECK(std::count_if(exported.files.begin(), exported.files.end(),
                      [](const std::string& name) { return name.rfind("model-", 0) == 0; }) > 1);
  SafetensorsFile first(dir.path() + "/hf/" + *firstModel);
  CHECK(first.header().metadata.at("bulkhead_step") == "7");
  bool sawUp = false, sawOptimizer = false;
  for (const auto& name : exported.files) {
    if (name.find(".safetensors.index.json") != std::string::npos) continue;
    SafetensorsFile file(dir.path() + "/hf/" + name);
    if (auto* up = file.find("m.layers.0.experts.3.up_proj.weight")) {
      CHECK(up->dtype == at::kBFloat16);
      CHECK(at::equal(file.read(*up), saved.at("layers.0.experts.w13")[3][1]));
      sawUp = true;
    }
    if (auto* proj = file.find("m.layers.0.proj.weight"))
      CHECK(at::equal(file.read(*proj), saved.at("layers.0.proj").t()));
    if (name.rfind("optimizer-", 0) == 0)
      sawOptimizer = sawOptimizer || file.find("optim.embed.exp_avg") != nullptr;
    else
      CHECK(file.find("optim.embed.exp_avg") == nullptr);
  }
  CHECK(sawUp);
  CHECK(sawOptimizer);
  CHECK_THROWS_AS(exportSafetensors(exporting), ConfigError);  // the folder holds an export already

  const ImportReport imported =
      importSafetensors({.source = dir.path() + "/hf", .dir = dir.path() + "/b", .map = map, .step = 7});
  CHECK(imported.tensors == static_cast<int64_t>(saved.size()));
  WholeTensorReader reader(imported.path, 2);
  for (const auto& [key, tensor] : saved) CHECK(at::equal(reader.read(key), tensor));

  DiffReport same = diffCheckpoints({.a = dir.path() + "/a", .b = dir.path() + "/b"});
  CHECK(same.same());
  CHECK(same.count(KeyDiff::Kind::Equal) == static_cast<int>(saved.size()));

  // Another step whose tensors differ: every one is reported, and a tolerance can accept them.
  saveCheckpoint(dir.path(), dir.path() + "/b", 8);
  DiffReport other = diffCheckpoints({.a = dir.path() + "/a", .b = dir.path() + "/b", .stepB = "8"});
  CHECK(!other.same());
  CHECK(other.count(KeyDiff::Kind::Differs) == static_cast<int>(saved.size()));
  DiffReport loose = diffCheckpoints({.a = dir.path() + "/a", .b = dir.path() + "/b", .stepB = "8", .atol = 1e6});
  CHECK(loose.same());
  CHECK(loose.count(KeyDiff::Kind::Close) == static_cast<int>(saved.size()));
  // Without the optimizer state, B has keys A lacks.
  exporting.withOptimizer = false;
  exporting.out = dir.path() + "/hf2";
  exportSafetensors(exporting);
  importSafetensors({.source = dir.path() + "/hf2", .dir = dir.path() + "/c", .map = map, .step = 7});
  DiffReport partial = diffCheckpoints({.a = dir.path() + "/a", .b = dir.path() + "/c"});
  CHECK(partial.count(KeyDiff::Kind::OnlyInA) == 2);
  CHECK(partial.count(KeyDiff::Kind::Equal) == static_cast<int>(saved.size()) - 2);
}

TEST_CASE("import refuses a tensor the map does not cover, a missing piece and mismatched pieces, naming them") {
  testing::TempDir dir;
  const std::string map = dir.path() + "/map.json";
  writeBytes(map, kMap);
  std::mt19937_64 rng(3);
  auto importOf = [&](const std::vector<std::pair<std::string, at::Tensor>>& tensors) -> std::string {
    static int n = 0;
    const std::string folder = dir.path() + "/src" + std::to_string(++n);
    ::mkdir(folder.c_str(), 0755);
    writeFile(folder + "/model.safetensors", tensors);
    try {
      importSafetensors({.source = folder, .dir = dir.path() + "/out" + std::to_string(n), .map = map});
    } catch (const CheckpointError& error) {
      return error.what();
    }
    return "";
  };
  auto piece = [&](int expert, const char* proj, int rows = 6) {
    return std::make_pair(fmt::format("m.layers.0.experts.{}.{}.weight", expert, proj),
                          randomTensor(rng, {rows, 5}, at::kFloat));
  };
  CHECK(importOf({piece(0, "gate_proj"), piece(0, "up_proj"), piece(1, "gate_proj"), piece(1, "up_proj")}).empty());
  std::string message = importOf({{"lm_head.weight", randomTensor(rng, {3, 3}, at::kFloat)}});
  CHECK(contains(message, "'lm_head.weight'"));
  CHECK(contains(message, "not covered by the key map"));
  message = importOf({piece(0, "gate_proj"), piece(0, "up_proj"), piece(1, "gate_proj")});
  CHECK(contains(message, "layers.0.experts.w13"));
  CHECK(contains(message, "[1, 1] is missing"));
  message = importOf({piece(0, "gate_proj"), piece(0, "up_proj", 7)});
  CHECK(contains(message, "does not match"));
  // An index that points outside its folder.
  const std::string folder = dir.path() + "/escape";
  ::mkdir(folder.c_str(), 0755);
  writeFile(folder + "/model.safetensors", {piece(0, "gate_proj")});
  writeBytes(folder + "/model.safetensors.index.json",
             R"({"weight_map": {"m.layers.0.experts.0.gate_proj.weight": "../elsewhere.safetensors"}})");
  CHECK_THROWS_AS(importSafetensors({.source = folder, .dir = dir.path() + "/x", .map = map}), CheckpointError);
}
