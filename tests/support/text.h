#pragma once
// Checks on the text of messages, shared by every test.

#include <string>

namespace bulkhead::testing {

// Whether `text` holds `part`.
inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace bulkhead::testing
