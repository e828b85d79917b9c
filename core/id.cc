#include "core/id.h"

#include <algorithm>

#include "core/error.h"

namespace parapilot {

namespace {

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t") - begin + 1);
}

}  // namespace

ParsedId parse_id_or_throw(const std::string& id, const std::string& kind,
                           const std::string& example) {
  ParsedId out;
  const auto colon = id.find(':');
  const auto paren = id.find('(');
  out.name = trim(id.substr(0, std::min(colon, paren)));
  if (out.name.empty()) {
    throw InputError(kind + " \"" + id + "\": missing a name (e.g. " + example + ")");
  }
  if (colon != std::string::npos && (paren == std::string::npos || colon < paren)) {
    out.variant = trim(
        id.substr(colon + 1, paren == std::string::npos ? std::string::npos : paren - colon - 1));
  }
  if (paren != std::string::npos) {
    if (id.back() != ')') throw InputError(kind + " \"" + id + "\": parameters must end with ')'");
    const std::string inner = id.substr(paren + 1, id.size() - paren - 2);
    size_t start = 0;
    while (start <= inner.size()) {
      const auto comma = inner.find(',', start);
      const std::string item = trim(inner.substr(start, comma - start));
      if (!item.empty()) {
        const auto eq = item.find('=');
        if (eq == std::string::npos || eq == 0) {
          throw InputError(kind + " \"" + id + "\": parameter \"" + item + "\" is not key=value");
        }
        out.params[trim(item.substr(0, eq))] = trim(item.substr(eq + 1));
      }
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  return out;
}

std::vector<std::string> split_ids(const std::string& list) {
  std::vector<std::string> out;
  std::string item;
  int depth = 0;  // commas inside parentheses belong to an id's parameters
  for (char c : list) {
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if (c == ',' && depth == 0) {
      if (!item.empty()) out.push_back(item);
      item.clear();
    } else {
      item.push_back(c);
    }
  }
  if (!item.empty()) out.push_back(item);
  return out;
}

}  // namespace parapilot
