// TableReader: strict, typed access to one TOML table that people wrote.
//
// Every getter checks the value's type and range and throws InputError naming the source,
// line, table and key ("specs/x.toml:7: [strategy] tp: must be an integer >= 1, got 0").
// Keys that were never asked for are reported by reject_unknown(), so a typo is an error and
// never a silently ignored setting. Not thread-safe; one reader per table.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <set>
#include <string>

#include <toml++/toml.h>

namespace parapilot {

class TableReader {
 public:
  // source: file path or flag name; table: the dotted table name used in messages.
  TableReader(const toml::table& table, std::string source, std::string table_name);

  std::optional<int64_t> get_int(const std::string& key, int64_t min, int64_t max);
  std::optional<double> get_double(const std::string& key, double min, double max);
  std::optional<bool> get_bool(const std::string& key);
  std::optional<std::string> get_string(const std::string& key);
  // A string that must be one of `allowed`.
  std::optional<std::string> get_choice(const std::string& key,
                                        std::initializer_list<const char*> allowed);
  // The raw node for structured values (arrays, sub-tables); marks the key as known.
  const toml::node* get_node(const std::string& key);

  // Throws InputError for `key` (its line when present, else the table's).
  [[noreturn]] void fail(const std::string& key, const std::string& reason) const;
  // Throws InputError at `node`'s line.
  [[noreturn]] void fail_at(const toml::node& node, const std::string& key,
                            const std::string& reason) const;
  // Throws InputError for the first key never read by a getter.
  void reject_unknown() const;

  const std::string& source() const { return source_; }

 private:
  const toml::table& table_;
  std::string source_;
  std::string table_name_;
  std::set<std::string> known_;
};

// Parses a TOML file; throws InputError with the file, line and parser message.
toml::table parse_toml_file(const std::string& path);
// Parses TOML text attributed to `source` in messages.
toml::table parse_toml_text(const std::string& text, const std::string& source);

// Describes a node's type for messages ("string", "integer", "array", ...).
const char* toml_type_name(const toml::node& node);

}  // namespace parapilot
