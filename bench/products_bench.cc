// The MoE layer's expert products alone on one GPU, each timed: Bulkhead's
// Hopper kernels (moe/grouped_products.h) beside at::_grouped_mm on the same
// operands and a dense at::mm of the same FLOPs, in TFLOP/s. The products of
// a SwiGLU expert layer (gate and up stacked in one weight): forward, dgrad
// (the rows' gradient) and wgrad (the weights', over each expert's rows), for
// both projections. Rows are T * topk slots, each routed to a uniformly drawn
// expert (dropless). Prints a Markdown table (bench/run_products_bench.sh).
//
//   bulkhead-products-bench [--tokens 4096] [--experts 64] [--topk 8] [--hidden 2048] [--ffn 768]
//                           [--iters 20]
#include <ATen/ATen.h>
#include <ATen/ops/_grouped_mm.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <chrono>
#include <functional>
#include <string>

#include "bench/bench_check.h"
#include "launch/cli.h"
#include "moe/grouped_products.h"
#include "runtime/errors.h"

using namespace bulkhead;

namespace {

struct Options {
  int64_t tokens = 4096, experts = 64, topK = 8, hidden = 2048, ffn = 768;
  int iterations = 20;
};

// Milliseconds per call: `iterations` calls queued back to back after 3 warm-up calls.
double timeMs(const std::function<void()>& call, int iterations) {
  for (int i = 0; i < 3; ++i) call();
  BENCH_CHECK(cudaDeviceSynchronize());
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) call();
  BENCH_CHECK(cudaDeviceSynchronize());
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / iterations;
}

struct Totals {
  double bulkheadMs = 0, atenMs = 0, flop = 0;
};

// One projection's three products: rows [R, k] into `out` columns.
std::string projection(const char* name, int64_t k, int64_t out, const at::Tensor& ends, const Options& o,
                       Totals& totals) {
  const int64_t rows = o.tokens * o.topK;
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  const at::Tensor x = at::randn({rows, k}, bf16), w = at::randn({o.experts, out, k}, bf16) * 0.02,
                   dy = at::randn({rows, out}, bf16), a = at::randn({rows, k}, bf16), b = at::randn({k, out}, bf16);
  const double flop = 2.0 * static_cast<double>(rows) * static_cast<double>(k) * static_cast<double>(out);
  const double dense = timeMs([&] { (void)at::mm(a, b); }, o.iterations);
  struct Product {
    const char* kind;
    std::function<void()> bulkhead, aten;
  };
  using moe::HopperProduct;
  const Product products[] = {
      {"forward", [&] { (void)moe::hopperProduct(HopperProduct::Forward, x, w, ends); },
       [&] { (void)at::_grouped_mm(x, w.transpose(-2, -1), ends); }},
      {"dgrad", [&] { (void)moe::hopperProduct(HopperProduct::Dgrad, dy, w, ends); },
       [&] { (void)at::_grouped_mm(dy, w, ends); }},
      {"wgrad", [&] { (void)moe::hopperProduct(HopperProduct::Wgrad, dy, x, ends); },
       [&] { (void)at::_grouped_mm(dy.t(), x, ends); }},
  };
  std::string table;
  for (const Product& p : products) {
    const double ours = timeMs(p.bulkhead, o.iterations), theirs = timeMs(p.aten, o.iterations);
    totals.bulkheadMs += ours, totals.atenMs += theirs, totals.flop += flop;
    table += fmt::format("| {} {} | {:.3f} | {:.0f} | {:.0f} | {:.0f} | {:.2f} |\n", name, p.kind, ours,
                         flop / ours / 1e9, flop / theirs / 1e9, flop / dense / 1e9, theirs / ours);
  }
  return table;
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app("The MoE layer's expert products alone, Bulkhead's kernels beside at::_grouped_mm and dense mm",
               "bulkhead-products-bench");
  Options o;
  const CLI::Validator positive = cli::positive();
  app.add_option("--tokens", o.tokens, "tokens")->check(positive);
  app.add_option("--experts", o.experts, "experts")->check(positive);
  app.add_option("--topk", o.topK, "experts per token")->check(positive);
  app.add_option("--hidden", o.hidden, "model width")->check(positive);
  app.add_option("--ffn", o.ffn, "expert hidden size")->check(positive);
  app.add_option("--iters", o.iterations, "timed calls per product")->check(positive);
  if (auto code = cli::parse(app, argc, argv)) return *code;
  try {
    at::manual_seed(7);
    const int64_t rows = o.tokens * o.topK;
    const at::Tensor ids = at::randint(o.experts, {rows}, at::TensorOptions().dtype(at::kLong).device(at::kCUDA));
    const at::Tensor ends = at::bincount(ids, {}, o.experts).cumsum(0).to(at::kInt);
    const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
    if (!moe::hopperProductsApply(at::empty({rows, o.hidden}, bf16), at::empty({o.experts, 2 * o.ffn, o.hidden}, bf16),
                                  ends)) {
      fmt::print(stderr,
                 "bulkhead-products-bench: Bulkhead's grouped products do not apply here (a Hopper GPU "
                 "and a build with sm_90a kernels are needed)\n");
      return 1;
    }
    Totals totals;
    std::string table = projection("gate+up", o.hidden, 2 * o.ffn, ends, o, totals);
    table += projection("down", o.ffn, o.hidden, ends, o, totals);
    fmt::print("T = {}, E = {}, top-{}, hidden {}, ffn {}: {:.0f} rows an expert on average\n\n", o.tokens, o.experts,
               o.topK, o.hidden, o.ffn, static_cast<double>(rows) / o.experts);
    fmt::print(
        "| product | Bulkhead ms | Bulkhead TFLOP/s | `_grouped_mm` TFLOP/s | dense `mm` TFLOP/s (same FLOPs) "
        "| Bulkhead / `_grouped_mm` |\n|---|---:|---:|---:|---:|---:|\n{}",
        table);
    fmt::print("| all six | {:.3f} | {:.0f} | {:.0f} | | {:.2f} |\n", totals.bulkheadMs,
               totals.flop / totals.bulkheadMs / 1e9, totals.flop / totals.atenMs / 1e9,
               totals.atenMs / totals.bulkheadMs);
    fmt::print("PRODUCTS_TFLOPS {:.0f}\nATEN_PRODUCTS_TFLOPS {:.0f}\n", totals.flop / totals.bulkheadMs / 1e9,
               totals.flop / totals.atenMs / 1e9);
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "bulkhead-products-bench: {}\n", e.what());
    return 1;
  }
}
