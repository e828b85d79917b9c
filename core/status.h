// Status and StatusOr<T>: how a fallible call says what went wrong.
//
// The error policy (docs/architecture.md, "Errors"): every call that can fail on input it does
// not control (a file, a frame from the network, a peer, a collective, an option) returns a
// Status or a StatusOr<T>, and never throws across that boundary. The code says what kind of
// failure it is, so a caller can tell bad input from a transient fault from a bug; the message
// says what, for a person, and never holds secret material. Programmer errors (a broken
// precondition) are asserts, not Statuses. Exceptions stay inside a module's parsers, which
// unwind with InputError to the module's entry point, and in the CLI, which turns a Status into
// InputError and exit code 2 (core/error.h: catch_input_error, check, take).
//
// Thread-safety: plain value types.
#pragma once

#include <optional>
#include <string>
#include <utility>

namespace parapilot {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,   ///< the input is malformed or out of range: fix the input.
  kNotFound,          ///< a named file, variable or peer does not exist.
  kUnavailable,       ///< a transient fault: a peer or port is not reachable now; retry may work.
  kRejected,          ///< well-formed, but refused: a state or policy says no.
  kCollectiveFailed,  ///< a collective operation failed or timed out among the ranks.
  kInternal,          ///< an invariant broke: a bug.
};

/// The code's name, e.g. "invalid argument".
const char* code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  /// OK.
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
  static Status rejected(std::string m) { return {StatusCode::kRejected, std::move(m)}; }
  static Status collective_failed(std::string m) { return {StatusCode::kCollectiveFailed, std::move(m)}; }
  static Status internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return ok(); }
  StatusCode code() const { return code_; }
  /// What went wrong; empty when ok().
  const std::string& message() const { return message_; }

  bool operator==(const Status&) const = default;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline const char* code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kNotFound: return "not found";
    case StatusCode::kUnavailable: return "unavailable";
    case StatusCode::kRejected: return "rejected";
    case StatusCode::kCollectiveFailed: return "collective failed";
    case StatusCode::kInternal: return "internal";
  }
  return "unknown";
}

/// A value, or the Status saying why there is none.
template <class T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  /// A failure; an OK status here is a bug and becomes an internal error.
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (status_.ok()) status_ = Status::internal("StatusOr made from an OK status");
  }

  bool ok() const { return value_.has_value(); }
  explicit operator bool() const { return ok(); }
  /// OK when a value is held.
  const Status& status() const { return status_; }

  /// Precondition: ok().
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace parapilot
