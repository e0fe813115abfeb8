#pragma once
// The one parser of the fault specs tests set in the environment
// (BULKHEAD_FAULT, BULKHEAD_CHECKPOINT_FAULT): comma-separated key=value
// fields, an action named by its value, "name:NUMBER" where it takes an
// argument. Each fault module keeps its own keys and actions; malformed text
// is a ConfigError that names the variable, quotes the text and shows the
// expected form.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace bulkhead::fault {

struct SpecSyntax {
  std::string variable;           // "BULKHEAD_FAULT"
  std::string form;               // the expected form, shown in every error
  std::vector<std::string> keys;  // the keys a spec may hold
};

class FaultSpec {
 public:
  // ConfigError for a field that is not key=value, a key that is not in
  // syntax.keys, or a key given twice.
  FaultSpec(SpecSyntax syntax, std::string text);

  bool has(const std::string& key) const { return fields_.count(key) != 0; }
  // The value of `key` ("" when absent).
  std::string text(const std::string& key) const;
  // The value of `key` as an integer in [minimum, maximum]; ConfigError
  // when absent, not an integer or out of range.
  int64_t integer(const std::string& key, int64_t minimum, int64_t maximum) const;

  struct Action {
    std::string name;                // "stall" of "stall:2.5"
    std::optional<double> argument;  // 2.5 (non-negative), nullopt without ':'
  };
  // The value of `key` as an action; ConfigError when absent or when its
  // argument is not a non-negative number.
  Action action(const std::string& key) const;

  // A ConfigError naming the variable and the text, saying `why`.
  [[noreturn]] void reject(const std::string& why) const;

 private:
  SpecSyntax syntax_;
  std::string text_;
  std::map<std::string, std::string> fields_;
};

}  // namespace bulkhead::fault
