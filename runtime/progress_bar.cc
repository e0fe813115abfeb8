#include "runtime/progress_bar.h"

#include <unistd.h>

#include <algorithm>

namespace bulkhead {

ProgressBar::ProgressBar(ProgressBarOptions options)
    : options_(std::move(options)), active_(options_.enabled && ::isatty(::fileno(options_.stream)) == 1) {}

void ProgressBar::draw(int64_t done, int64_t total, const std::string& text, bool finish) {
  if (!active_) return;
  const bool end = done >= total;
  const auto now = std::chrono::steady_clock::now();
  if (!end && now - last_ < options_.interval) return;
  last_ = now;
  const int64_t clamped = std::clamp<int64_t>(done, 0, std::max<int64_t>(total, 0));
  const int filled = total > 0 ? static_cast<int>(options_.width * clamped / total) : options_.width;
  const std::string bar = std::string(filled, '#') + std::string(options_.width - filled, '.');
  std::fprintf(options_.stream, "\r%s%s[%s] %s", options_.label.c_str(), options_.label.empty() ? "" : " ", bar.c_str(),
               text.c_str());
  if (end && finish) std::fputc('\n', options_.stream);
  std::fflush(options_.stream);
}

void ProgressBar::clear() {
  if (!active_) return;
  std::fputs("\r\033[K", options_.stream);
  std::fflush(options_.stream);
}

}  // namespace bulkhead
