// Result<T>: a value or the reason it could not be produced.
//
// Purpose: the transport never throws across the network boundary. Functions that can fail on
// untrusted input (frame decoding, payload parsing, secret loading) return Result<T>, which
// holds either a value or a human-readable reason ("bad magic 0x...", "truncated payload").
// Reasons never contain secret material. Thread-safety: a plain value type.
#pragma once

#include <optional>
#include <string>
#include <utility>

namespace parapilot::transport {

/// Tag for constructing a failed Result: `return Error{"reason"};`.
struct Error {
  std::string reason;
};

template <class T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}             // NOLINT(google-explicit-constructor)
  Result(Error error) : error_(std::move(error.reason)) {}  // NOLINT(google-explicit-constructor)

  /// True when a value is held.
  bool ok() const { return value_.has_value(); }
  explicit operator bool() const { return ok(); }

  /// Precondition: ok().
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }

  /// Why it failed; empty when ok().
  const std::string& error() const { return error_; }

 private:
  std::optional<T> value_;
  std::string error_;
};

}  // namespace parapilot::transport
