#include "runtime/progress_bar.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string_view>

namespace bulkhead {

bool ProgressBar::watched(std::FILE* stream) {
  if (::isatty(::fileno(stream)) != 1) return false;
  const char* term = std::getenv("TERM");
  if (term == nullptr || std::string_view(term) == "dumb" || std::getenv("CI") != nullptr) return false;
  for (const char* launcher : {"OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMIX_RANK", "SLURM_STEP_ID"})
    if (std::getenv(launcher) != nullptr) return false;
  return true;
}

ProgressBar::ProgressBar(ProgressBarOptions options)
    : options_(std::move(options)),
      active_(options_.enabled && watched(options_.stream)),
      plain_(options_.enabled && !active_ && options_.plainInterval.count() > 0) {}

std::string ProgressBar::bar(int64_t done, int64_t total) const {
  const int64_t clamped = std::clamp<int64_t>(done, 0, std::max<int64_t>(total, 0));
  const int filled = total > 0 ? static_cast<int>(options_.width * clamped / total) : options_.width;
  return std::string(options_.label) + (options_.label.empty() ? "" : " ") + "[" + std::string(filled, '#') +
         std::string(options_.width - filled, '.') + "]";
}

void ProgressBar::draw(int64_t done, int64_t total, const std::string& text, bool finish) {
  if (!active_ && !plain_) return;
  const bool end = done >= total;
  const auto now = std::chrono::steady_clock::now();
  // The first plain line waits a whole interval: a short task prints only its end.
  if (plain_ && last_ == std::chrono::steady_clock::time_point{}) last_ = now;
  if (!end && now - last_ < (active_ ? options_.interval : options_.plainInterval)) return;
  last_ = now;
  if (active_) {
    std::fprintf(options_.stream, "\r%s %s", bar(done, total).c_str(), text.c_str());
    if (end && finish) std::fputc('\n', options_.stream);
  } else {
    std::fprintf(options_.stream, "%s %s\n", bar(done, total).c_str(), text.c_str());
  }
  std::fflush(options_.stream);
}

void ProgressBar::clear() {
  if (!active_) return;
  std::fputs("\r\033[K", options_.stream);
  std::fflush(options_.stream);
}

}  // namespace bulkhead
