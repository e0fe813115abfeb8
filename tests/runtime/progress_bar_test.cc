// The progress bar off a terminal (a file here, as under mpirun, Slurm or CI):
// never a carriage return; plain lines at the plain interval and at the end,
// or nothing when that interval is zero.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "runtime/progress_bar.h"
#include "tests/support/catch_compat.h"

using namespace bulkhead;

namespace {

std::string contents(std::FILE* file) {
  std::fflush(file);
  std::rewind(file);
  std::string text;
  for (int c; (c = std::fgetc(file)) != EOF;) text.push_back(static_cast<char>(c));
  return text;
}

}  // namespace

TEST_CASE("off a terminal the bar prints plain lines at its plain interval and at the end, never redraws") {
  std::FILE* file = std::tmpfile();
  REQUIRE(file != nullptr);
  CHECK_FALSE(ProgressBar::watched(file));
  ProgressBar bar({.stream = file, .label = "verifying", .width = 10, .plainInterval = std::chrono::milliseconds(50)});
  CHECK_FALSE(bar.active());
  bar.draw(1, 4, "25%");  // the first interval has not passed: nothing yet
  CHECK(contents(file).empty());
  std::this_thread::sleep_for(std::chrono::milliseconds(80));
  std::fseek(file, 0, SEEK_END);
  bar.draw(2, 4, "50%");
  bar.draw(3, 4, "75%");  // within the interval of the last line
  bar.draw(4, 4, "100%", /*finish=*/true);
  bar.clear();
  const std::string text = contents(file);
  CHECK(text == "verifying [#####.....] 50%\nverifying [##########] 100%\n");
  CHECK(text.find('\r') == std::string::npos);
  std::fclose(file);
}

TEST_CASE("off a terminal a bar with no plain interval prints nothing: the caller logs its own lines") {
  std::FILE* file = std::tmpfile();
  REQUIRE(file != nullptr);
  ProgressBar bar({.stream = file, .plainInterval = std::chrono::milliseconds(0)});
  for (int step = 1; step <= 20; ++step) bar.draw(step, 20, "step " + std::to_string(step), true);
  CHECK(contents(file).empty());
  std::fclose(file);
}
