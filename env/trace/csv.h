// Internal: a streaming CSV line splitter and strict number parsing with located errors.
// Not part of the public contract of env/trace.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <istream>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace parapilot::trace::csv {

// Reads one line at a time and splits it on commas (no quoting beyond stripping a pair of
// surrounding double quotes; the trace schemas never quote commas).
class LineReader {
 public:
  LineReader(std::istream& in, std::string source) : in_(in), source_(std::move(source)) {}

  // Next non-empty line split into fields; false at end of input.
  bool next(std::vector<std::string_view>& fields) {
    while (std::getline(in_, line_)) {
      ++line_number_;
      if (!line_.empty() && line_.back() == '\r') line_.pop_back();
      if (line_.empty()) continue;
      split(fields);
      return true;
    }
    if (in_.bad())
      throw InputError(source_ + ": read error after line " + std::to_string(line_number_));
    return false;
  }

  std::int64_t line_number() const { return line_number_; }
  const std::string& source() const { return source_; }
  const std::string& line() const { return line_; }

  [[noreturn]] void fail(std::string_view column, const std::string& why) const {
    throw InputError(source_ + ":" + std::to_string(line_number_) + ": column '" +
                     std::string(column) + "': " + why);
  }

  double parse_double(std::string_view field, std::string_view column) const {
    double v = 0;
    const char* first = field.data();
    const char* last = field.data() + field.size();
    if (first != last && *first == '+') ++first;
    const auto [ptr, ec] = std::from_chars(first, last, v);
    if (field.empty() || ec != std::errc() || ptr != last)
      fail(column, quoted(field, "is not a number"));
    if (!std::isfinite(v)) fail(column, quoted(field, "is not finite"));
    return v;
  }

  // Integers; "3.0" is accepted (pandas writes nullable integer columns as floats).
  std::int64_t parse_int(std::string_view field, std::string_view column) const {
    std::int64_t v = 0;
    const auto [ptr, ec] = std::from_chars(field.data(), field.data() + field.size(), v);
    if (!field.empty() && ec == std::errc() && ptr == field.data() + field.size()) return v;
    const double d = parse_double(field, column);
    if (d != std::floor(d) || std::fabs(d) > 9e15) fail(column, quoted(field, "is not an integer"));
    return static_cast<std::int64_t>(d);
  }

 private:
  // "'<field>' <why>", built by appending (GCC 12 warns falsely on literal + string at -O3).
  static std::string quoted(std::string_view field, const char* why) {
    std::string s;
    s.reserve(field.size() + 32);
    s.push_back('\'');
    s.append(field);
    s.append("' ");
    s.append(why);
    return s;
  }

  void split(std::vector<std::string_view>& fields) const {
    fields.clear();
    std::string_view rest(line_);
    while (true) {
      const std::size_t comma = rest.find(',');
      std::string_view f = rest.substr(0, comma);
      while (!f.empty() && (f.front() == ' ' || f.front() == '\t')) f.remove_prefix(1);
      while (!f.empty() && (f.back() == ' ' || f.back() == '\t')) f.remove_suffix(1);
      if (f.size() >= 2 && f.front() == '"' && f.back() == '"') f = f.substr(1, f.size() - 2);
      fields.push_back(f);
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
  }

  std::istream& in_;
  std::string source_;
  std::string line_;
  std::int64_t line_number_ = 0;
};

}  // namespace parapilot::trace::csv
