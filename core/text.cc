#include "core/text.h"

#include <charconv>
#include <cmath>
#include <cstdlib>

#include "core/error.h"

namespace parapilot::text {

std::vector<std::string_view> split(std::string_view text, char sep) {
  std::vector<std::string_view> out;
  std::size_t start = 0;
  while (true) {
    const std::size_t end = text.find(sep, start);
    out.push_back(text.substr(start, end == std::string_view::npos ? end : end - start));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

double to_double(std::string_view text, const std::string& what) {
  const std::string s(trim(text));
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v))
    throw InputError(what + ": '" + s + "' is not a finite number");
  return v;
}

std::int64_t to_int(std::string_view text, const std::string& what) {
  text = trim(text);
  std::int64_t v = 0;
  const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || p != text.data() + text.size())
    throw InputError(what + ": '" + std::string(text) + "' is not an integer");
  return v;
}

}  // namespace parapilot::text
