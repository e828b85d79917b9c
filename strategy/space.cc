#include "strategy/space.h"

#include <algorithm>

#include "core/error.h"
#include "strategy/toml_reader.h"

namespace parapilot {

namespace {

constexpr int64_t kMaxDim = 1 << 24;

const toml::table* find_table(const toml::table& root, const std::string& path,
                              const std::string& name, bool required) {
  const toml::node* node = root.get(name);
  if (!node) {
    if (required) throw InputError(path + ": no [" + name + "] table in this file");
    return nullptr;
  }
  const toml::table* table = node->as_table();
  if (!table) {
    throw InputError(path + ":" + std::to_string(node->source().begin.line) + ": '" + name +
                     "' must be a table, got " + toml_type_name(*node));
  }
  return table;
}

// An integer or an array of integers in [min, max], as a list (duplicates removed, order kept).
std::vector<int> read_int_list(TableReader& r, const std::string& key, int64_t min, int64_t max) {
  const toml::node* node = r.get_node(key);
  if (!node) return {};
  std::vector<int> out;
  auto add = [&](const toml::node& item) {
    const auto* v = item.as_integer();
    if (!v) {
      r.fail_at(
          item, key,
          std::string("must be an integer or an array of integers, got ") + toml_type_name(item));
    }
    if (v->get() < min || v->get() > max) {
      r.fail_at(item, key,
                "value " + std::to_string(v->get()) + " is outside [" + std::to_string(min) + ", " +
                    std::to_string(max) + "]");
    }
    const int value = static_cast<int>(v->get());
    for (int existing : out) {
      if (existing == value) return;
    }
    out.push_back(value);
  };
  if (const toml::array* array = node->as_array()) {
    if (array->empty()) r.fail(key, "must list at least one value (omit the key for all)");
    for (const auto& item : *array) add(item);
  } else {
    add(*node);
  }
  return out;
}

// A string or an array of strings, each one of `allowed`.
std::vector<std::string> read_choice_list(TableReader& r, const std::string& key,
                                          std::initializer_list<const char*> allowed) {
  const toml::node* node = r.get_node(key);
  if (!node) return {};
  std::vector<std::string> out;
  auto add = [&](const toml::node& item) {
    const auto* s = item.as_string();
    std::string options;
    for (const char* a : allowed) options += (options.empty() ? "" : " | ") + std::string(a);
    if (!s) {
      r.fail_at(
          item, key,
          "must be a string or an array of strings (" + options + "), got " + toml_type_name(item));
    }
    for (const char* a : allowed) {
      if (s->get() == a) {
        out.push_back(s->get());
        return;
      }
    }
    r.fail_at(item, key, "must be one of " + options + ", got \"" + s->get() + "\"");
  };
  if (const toml::array* array = node->as_array()) {
    if (array->empty()) r.fail(key, "must list at least one value (omit the key for all)");
    for (const auto& item : *array) add(item);
  } else {
    add(*node);
  }
  return out;
}

// A number for every layer, or an array with one entry per transformer block.
std::vector<double> read_per_layer(TableReader& r, const std::string& key, int layers) {
  const toml::node* node = r.get_node(key);
  if (!node) return {};
  auto value_of = [&](const toml::node& n) {
    double v = 0;
    if (const auto* f = n.as_floating_point())
      v = f->get();
    else if (const auto* i = n.as_integer())
      v = static_cast<double>(i->get());
    else
      r.fail_at(n, key, std::string("must be a number in [0, 1], got ") + toml_type_name(n));
    if (!(v >= 0 && v <= 1)) r.fail_at(n, key, "value " + std::to_string(v) + " is outside [0, 1]");
    return v;
  };
  if (const toml::array* array = node->as_array()) {
    if (static_cast<int>(array->size()) != layers) {
      r.fail(key, "has " + std::to_string(array->size()) + " entries but the model has " +
                      std::to_string(layers) + " layers");
    }
    std::vector<double> out;
    for (const auto& item : *array) out.push_back(value_of(item));
    return out;
  }
  return std::vector<double>(layers, value_of(*node));
}

}  // namespace

StatusOr<SearchSpace> load_search_space(const std::string& path, const ModelSpec& model) {
  return catch_input_error([&]() -> SearchSpace {
  const toml::table root = parse_toml_file(path);
  TableReader r(*find_table(root, path, "space", true), path, "space");
  SearchSpace s;
  s.tp = read_int_list(r, "tp", 1, 1024);
  s.pp = read_int_list(r, "pp", 1, model.layers);
  s.cp = read_int_list(r, "cp", 1, 1024);
  s.dp = read_int_list(r, "dp", 1, kMaxDim);
  s.microbatch_size = read_int_list(r, "microbatch_size", 1, kMaxDim);
  s.virtual_stages = read_int_list(r, "virtual_stages", 1, model.layers);
  s.zero = read_int_list(r, "zero", 0, 3);
  if (const toml::node* node = r.get_node("sp")) {
    auto add = [&](const toml::node& item) {
      const auto* b = item.as_boolean();
      if (!b) {
        r.fail_at(item, "sp",
                  std::string("must be true, false or [false, true], got ") + toml_type_name(item));
      }
      s.sp.push_back(b->get());
    };
    if (const toml::array* array = node->as_array()) {
      if (array->empty()) r.fail("sp", "must list at least one value (omit the key for all)");
      for (const auto& item : *array) add(item);
    } else {
      add(*node);
    }
  }
  for (const auto& v : read_choice_list(r, "schedule", {"gpipe", "1f1b", "interleaved"})) {
    s.schedule.push_back(v == "gpipe"  ? Schedule::kGPipe
                         : v == "1f1b" ? Schedule::k1F1B
                                       : Schedule::kInterleaved);
  }
  for (const auto& v : read_choice_list(r, "recompute", {"none", "selective", "full"})) {
    s.recompute.push_back(v == "none"        ? Recompute::kNone
                          : v == "selective" ? Recompute::kSelective
                                             : Recompute::kFull);
  }
  if (auto v = r.get_int("max_pp", 1, model.layers)) s.max_pp = static_cast<int>(*v);
  if (auto v = r.get_int("global_batch", 1, kMaxDim)) s.global_batch = static_cast<int>(*v);
  if (const toml::node* node = r.get_node("global_batch_range")) {
    const toml::array* array = node->as_array();
    if (!array || array->size() != 2 || !array->get(0)->as_integer() ||
        !array->get(1)->as_integer()) {
      r.fail("global_batch_range", "must be [min, max] (two integers)");
    }
    const int64_t lo = array->get(0)->as_integer()->get();
    const int64_t hi = array->get(1)->as_integer()->get();
    if (lo < 1 || hi < lo || hi > kMaxDim) {
      r.fail("global_batch_range", "needs 1 <= min <= max <= " + std::to_string(kMaxDim) +
                                       ", got [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                       "]");
    }
    if (s.global_batch > 0) {
      r.fail("global_batch_range", "set either global_batch or global_batch_range, not both");
    }
    s.global_batch_min = static_cast<int>(lo);
    s.global_batch_max = static_cast<int>(hi);
  }
  if (auto v = r.get_bool("mixed_types_in_pipeline")) s.mixed_types_in_pipeline = *v;
  if (auto v = r.get_bool("compression")) s.compression = *v;
  r.reject_unknown();

  if (!s.virtual_stages.empty() &&
      *std::max_element(s.virtual_stages.begin(), s.virtual_stages.end()) < 2 &&
      s.schedule == std::vector<Schedule>{Schedule::kInterleaved}) {
    r.fail("virtual_stages", "the interleaved schedule needs virtual_stages >= 2");
  }
  for (int tp : s.tp) {
    if (model.heads % tp != 0) {
      r.fail("tp", "tp = " + std::to_string(tp) + " does not divide the model's " +
                       std::to_string(model.heads) + " attention heads");
    }
  }
  if (s.max_pp > 0 && !s.pp.empty()) {
    bool any = false;
    for (int p : s.pp) any = any || p <= s.max_pp;
    if (!any) r.fail("max_pp", "excludes every value listed in pp");
  }
  return s;
  });
}

StatusOr<GradientStats> load_gradient_stats(const std::string& path, const ModelSpec& model) {
  return catch_input_error([&]() -> GradientStats {
  const toml::table root = parse_toml_file(path);
  const toml::table* table = find_table(root, path, "gradients", false);
  GradientStats g;
  if (!table) return g;
  TableReader r(*table, path, "gradients");
  if (auto v = r.get_double("topk_ratio", 1e-6, 0.5)) g.topk_ratio = *v;
  g.topk_energy = read_per_layer(r, "topk_energy", model.layers);
  if (auto v = r.get_int("powersgd_rank", 1, 1024)) g.powersgd_rank = static_cast<int>(*v);
  g.lowrank_residual = read_per_layer(r, "lowrank_residual", model.layers);
  if (auto v = r.get_double("fp16_error", 0, 1)) g.fp16_error = *v;
  if (auto v = r.get_double("error_budget", 0, 1))
    g.error_budget = *v;
  else
    r.fail("error_budget", "missing (required): the largest relative gradient error allowed");
  r.reject_unknown();
  return g;
  });
}

int default_global_batch(int gpus) {
  int b = 256;
  while (b < gpus) b *= 2;
  return b;
}

}  // namespace parapilot
