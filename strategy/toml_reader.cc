#include "strategy/toml_reader.h"

#include <cmath>
#include <filesystem>
#include <sstream>

#include "core/error.h"

namespace parapilot {

namespace {

std::string where(const std::string& source, const toml::node* node) {
  // Flags ("--strategy") hold generated text whose line numbers mean nothing to the user.
  const bool from_flag = source.rfind("--", 0) == 0;
  if (!from_flag && node && node->source().begin.line > 0) {
    return source + ":" + std::to_string(node->source().begin.line);
  }
  return source;
}

std::string format_double(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

}  // namespace

const char* toml_type_name(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::table:
      return "table";
    case toml::node_type::array:
      return "array";
    case toml::node_type::string:
      return "string";
    case toml::node_type::integer:
      return "integer";
    case toml::node_type::floating_point:
      return "float";
    case toml::node_type::boolean:
      return "boolean";
    case toml::node_type::date:
      return "date";
    case toml::node_type::time:
      return "time";
    case toml::node_type::date_time:
      return "date-time";
    default:
      return "nothing";
  }
}

TableReader::TableReader(const toml::table& table, std::string source, std::string table_name)
    : table_(table), source_(std::move(source)), table_name_(std::move(table_name)) {}

void TableReader::fail(const std::string& key, const std::string& reason) const {
  const toml::node* node = table_.get(key);
  throw InputError(where(source_, node ? node : &table_) + ": [" + table_name_ + "] " + key + ": " +
                   reason);
}

void TableReader::fail_at(const toml::node& node, const std::string& key,
                          const std::string& reason) const {
  throw InputError(where(source_, &node) + ": [" + table_name_ + "] " + key + ": " + reason);
}

const toml::node* TableReader::get_node(const std::string& key) {
  known_.insert(key);
  return table_.get(key);
}

std::optional<int64_t> TableReader::get_int(const std::string& key, int64_t min, int64_t max) {
  const toml::node* node = get_node(key);
  if (!node) return std::nullopt;
  const auto* value = node->as_integer();
  if (!value) {
    fail(key, std::string("must be an integer, got ") + toml_type_name(*node));
  }
  const int64_t v = value->get();
  if (v < min || v > max) {
    fail(key, "must be in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " +
                  std::to_string(v));
  }
  return v;
}

std::optional<double> TableReader::get_double(const std::string& key, double min, double max) {
  const toml::node* node = get_node(key);
  if (!node) return std::nullopt;
  double v = 0;
  if (const auto* f = node->as_floating_point()) {
    v = f->get();
  } else if (const auto* i = node->as_integer()) {
    v = static_cast<double>(i->get());
  } else {
    fail(key, std::string("must be a number, got ") + toml_type_name(*node));
  }
  if (!std::isfinite(v) || v < min || v > max) {
    fail(key, "must be in [" + format_double(min) + ", " + format_double(max) + "], got " +
                  format_double(v));
  }
  return v;
}

std::optional<bool> TableReader::get_bool(const std::string& key) {
  const toml::node* node = get_node(key);
  if (!node) return std::nullopt;
  const auto* value = node->as_boolean();
  if (!value) fail(key, std::string("must be true or false, got ") + toml_type_name(*node));
  return value->get();
}

std::optional<std::string> TableReader::get_string(const std::string& key) {
  const toml::node* node = get_node(key);
  if (!node) return std::nullopt;
  const auto* value = node->as_string();
  if (!value) fail(key, std::string("must be a string, got ") + toml_type_name(*node));
  return value->get();
}

std::optional<std::string> TableReader::get_choice(const std::string& key,
                                                   std::initializer_list<const char*> allowed) {
  auto value = get_string(key);
  if (!value) return std::nullopt;
  std::string options;
  for (const char* a : allowed) {
    if (*value == a) return value;
    options += options.empty() ? "" : " | ";
    options += a;
  }
  fail(key, "must be one of " + options + ", got \"" + *value + "\"");
}

void TableReader::reject_unknown() const {
  for (const auto& [key, node] : table_) {
    const std::string name(key.str());
    if (!known_.count(name)) {
      std::string options;
      for (const auto& k : known_) options += (options.empty() ? "" : ", ") + k;
      throw InputError(where(source_, &node) + ": [" + table_name_ + "] unknown key '" + name +
                       "' (known keys: " + options + ")");
    }
  }
}

toml::table parse_toml_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    throw InputError(path + ": no such file");
  }
  try {
    return toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw InputError(path + ":" + std::to_string(e.source().begin.line) +
                     ": invalid TOML: " + std::string(e.description()));
  }
}

toml::table parse_toml_text(const std::string& text, const std::string& source) {
  try {
    return toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw InputError(source + ": invalid value: " + std::string(e.description()));
  }
}

}  // namespace parapilot
