// Error policy for user input (spec files, flags, conditions files).
//
// Every loader that reads something a person wrote throws InputError with a message that
// names the source (file and line, or the flag) and the key, and says why the value is wrong.
// The CLI catches InputError at its boundary and exits with code 2; nothing is written before
// input has been fully validated. Programmer errors (broken invariants) are checked with
// assert-style checks instead and never surface as InputError.
#pragma once

#include <stdexcept>
#include <string>

namespace parapilot {

class InputError : public std::runtime_error {
 public:
  explicit InputError(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace parapilot
