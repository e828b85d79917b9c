// InputError: how the readers of what a person wrote (spec, scenario, space and conditions
// files, flags, trace files) unwind from deep inside a parser, and the two bridges between it
// and Status (core/status.h, docs/architecture.md "Errors").
//
// InputError never leaves a module's public API: a reader's public entry point returns a
// StatusOr and turns the InputError of its parser into kInvalidArgument (catch_input_error).
// A parser that reads a nested spec through another module's reader gets its value with
// take(), which throws InputError again, so the message reaches the outermost reader unchanged.
// The CLI does the same with check() and take(): an InputError becomes exit code 2. Programmer
// errors are asserts and never surface as InputError.
#pragma once

#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "core/status.h"

namespace parapilot {

class InputError : public std::runtime_error {
 public:
  explicit InputError(const std::string& message) : std::runtime_error(message) {}
};

/// Throws, for a failed `status`: InputError with its message, or std::logic_error (a bug) for
/// kInternal. Nothing for OK.
inline void check(const Status& status) {
  if (status.ok()) return;
  if (status.code() == StatusCode::kInternal) throw std::logic_error(status.message());
  throw InputError(status.message());
}

/// The value of `result`, or check()'s exception.
template <class T>
T take(StatusOr<T> result) {
  check(result.status());
  return std::move(result).value();
}

/// Runs `read` (a parser that throws InputError) and returns its value, or kInvalidArgument
/// with the InputError's message. A `read` that returns nothing gives a Status.
template <class F>
auto catch_input_error(F&& read) {
  using T = decltype(read());
  try {
    if constexpr (std::is_void_v<T>) {
      read();
      return Status{};
    } else {
      return StatusOr<T>(read());
    }
  } catch (const InputError& e) {
    if constexpr (std::is_void_v<T>) {
      return Status::invalid_argument(e.what());
    } else {
      return StatusOr<T>(Status::invalid_argument(e.what()));
    }
  }
}

}  // namespace parapilot
