// Pieces of the project's small text parsers (the plan name, live actions and faults): split a
// field list, trim blanks, read a number. They unwind with InputError (core/error.h), as a
// parser inside a module does; the module's entry point turns it into a Status.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace parapilot::text {

/// The pieces of `text` between the separators, empty ones included ("a,,b" -> a, "", b).
std::vector<std::string_view> split(std::string_view text, char sep);
/// `s` without leading and trailing spaces and tabs.
std::string_view trim(std::string_view s);
/// A finite number (blanks around it allowed); InputError "WHAT: 'TEXT' is not a finite number".
double to_double(std::string_view text, const std::string& what);
/// An integer (blanks around it allowed); InputError "WHAT: 'TEXT' is not an integer".
std::int64_t to_int(std::string_view text, const std::string& what);

}  // namespace parapilot::text
