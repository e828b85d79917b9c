#include "strategy/spec_io.h"

#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <numeric>
#include <sstream>

#include "strategy/cost_model.h"
#include "core/error.h"
#include "strategy/toml_reader.h"

namespace parapilot {

namespace {

constexpr int64_t kMaxDim = 1 << 24;

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& i : items) out += (out.empty() ? "" : ", ") + i;
  return out;
}

// Finds `[name]` in a file; throws when the file has none.
const toml::table& table_in_file(const toml::table& root, const std::string& path,
                                 const std::string& name) {
  const toml::node* node = root.get(name);
  if (!node) throw InputError(path + ": no [" + name + "] table in this file");
  const toml::table* table = node->as_table();
  if (!table) {
    throw InputError(path + ":" + std::to_string(node->source().begin.line) + ": '" + name +
                     "' must be a table, got " + toml_type_name(*node));
  }
  return *table;
}

int to_int(int64_t v) { return static_cast<int>(v); }

// ---- model ----

ModelSpec read_model(TableReader& r, const std::string& default_name) {
  ModelSpec m;
  bool from_preset = false;
  if (auto preset = r.get_string("preset")) {
    auto p = model_preset(*preset);
    if (!p)
      r.fail("preset", "unknown model preset \"" + *preset +
                           "\" (presets: " + join(model_preset_names()) + ")");
    m = *p;
    from_preset = true;
  }
  auto required = [&](const std::string& key, int& field) {
    if (auto v = r.get_int(key, 1, kMaxDim))
      field = to_int(*v);
    else if (!from_preset)
      r.fail(key, "missing (required)");
  };
  m.name = r.get_string("name").value_or(from_preset ? m.name : default_name);
  required("layers", m.layers);
  required("hidden", m.hidden);
  required("heads", m.heads);
  required("seq_len", m.seq_len);
  required("vocab", m.vocab);
  if (auto v = r.get_int("ffn_hidden", 1, kMaxDim))
    m.ffn_hidden = to_int(*v);
  else if (!from_preset)
    m.ffn_hidden = 4 * m.hidden;
  if (auto v = r.get_int("kv_heads", 1, kMaxDim))
    m.kv_heads = to_int(*v);
  else if (!from_preset)
    m.kv_heads = m.heads;
  if (auto v = r.get_choice("dtype", {"bf16", "fp16"})) {
    m.dtype = *v == "bf16" ? DType::kBF16 : DType::kFP16;
  }
  if (auto v = r.get_choice("activation", {"gelu", "swiglu"})) {
    m.activation = *v == "gelu" ? Activation::kGelu : Activation::kSwiGLU;
  }
  if (auto v = r.get_bool("tied_embeddings")) m.tied_embeddings = *v;
  r.reject_unknown();
  if (m.hidden % m.heads != 0) {
    r.fail("heads", "heads = " + std::to_string(m.heads) +
                        " must divide hidden = " + std::to_string(m.hidden));
  }
  if (m.kv_heads > m.heads || m.heads % m.kv_heads != 0) {
    r.fail("kv_heads", "kv_heads = " + std::to_string(m.kv_heads) +
                           " must divide heads = " + std::to_string(m.heads));
  }
  return m;
}

// ---- cluster ----

GpuType read_gpu_type(TableReader& r) {
  GpuType t;
  auto name = r.get_string("name");
  if (!name) r.fail("name", "missing (required)");
  t.name = *name;
  auto need = [&](const std::string& key, double min, double max) {
    auto v = r.get_double(key, min, max);
    if (!v) r.fail(key, "missing (required)");
    return *v;
  };
  t.peak_tflops = need("peak_tflops", 1e-3, 1e6);
  t.memory_gib = need("memory_gib", 1e-3, 1e6);
  t.hbm_GBps = need("hbm_GBps", 1e-3, 1e7);
  t.nvlink_GBps_bidir = need("nvlink_GBps", 1e-3, 1e7);
  t.nic_Gbps = r.get_double("nic_Gbps", 1e-3, 1e7).value_or(200);
  t.gemm_efficiency = r.get_double("gemm_efficiency", 0.01, 1.0).value_or(0.75);
  t.attention_efficiency = r.get_double("attention_efficiency", 0.01, 1.0).value_or(0.5);
  t.fp8_tflops = r.get_double("fp8_tflops", 0, 1e6).value_or(0);
  t.network_efficiency = r.get_double("network_efficiency", 0.01, 1.0).value_or(0.70);
  r.reject_unknown();
  return t;
}

ClusterSpec read_cluster(TableReader& r, const std::string& default_name) {
  ClusterSpec c;
  c.name = r.get_string("name").value_or(default_name);
  if (auto v = r.get_double("intra_node_latency_us", 0, 1e6)) c.intra_node_latency_us = *v;
  if (auto v = r.get_double("inter_node_latency_us", 0, 1e6)) c.inter_node_latency_us = *v;
  if (auto v = r.get_double("intra_node_efficiency", 0.01, 1)) c.intra_node_efficiency = *v;
  if (auto v = r.get_double("inter_node_efficiency", 0.01, 1)) c.inter_node_efficiency = *v;
  const auto intra = r.get_double("intra_node_GBps", 1e-3, 1e7);
  const auto inter = r.get_double("inter_node_Gbps", 1e-3, 1e7);

  std::vector<GpuType> custom;
  if (const toml::node* types = r.get_node("gpu_types")) {
    const toml::array* array = types->as_array();
    if (!array) r.fail("gpu_types", "must be an array of tables ([[cluster.gpu_types]])");
    for (const auto& item : *array) {
      const toml::table* t = item.as_table();
      if (!t) r.fail_at(item, "gpu_types", "each entry must be a table");
      TableReader tr(*t, r.source(), "cluster.gpu_types");
      custom.push_back(read_gpu_type(tr));
    }
  }

  std::optional<ClusterSpec> base;
  if (auto preset = r.get_string("preset")) {
    base = cluster_preset(*preset);
    if (!base) {
      r.fail("preset", "\"" + *preset +
                           "\" is not a cluster preset (form NxGxTYPE, e.g. "
                           "4x8xa100-80g, groups joined with '+'; GPU types: " +
                           join(gpu_type_names()) + ")");
    }
    c.groups = base->groups;
  }
  const toml::node* nodes = r.get_node("nodes");
  if (nodes) {
    const toml::array* array = nodes->as_array();
    if (!array || array->empty()) {
      r.fail("nodes", "must be a non-empty array of tables ([[cluster.nodes]])");
    }
    for (const auto& item : *array) {
      const toml::table* t = item.as_table();
      if (!t) r.fail_at(item, "nodes", "each entry must be a table");
      TableReader nr(*t, r.source(), "cluster.nodes");
      NodeGroup g;
      g.count = to_int(nr.get_int("count", 1, 1 << 20).value_or(1));
      auto gpn = nr.get_int("gpus_per_node", 1, 1024);
      if (!gpn) nr.fail("gpus_per_node", "missing (required)");
      g.gpus_per_node = to_int(*gpn);
      auto gpu = nr.get_string("gpu");
      if (!gpu) nr.fail("gpu", "missing (required)");
      std::optional<GpuType> type;
      for (const auto& t2 : custom) {
        if (t2.name == *gpu) type = t2;
      }
      if (!type) type = gpu_type(*gpu);
      if (!type) {
        nr.fail("gpu", "unknown GPU type \"" + *gpu + "\" (catalogue: " + join(gpu_type_names()) +
                           "; or define it in [[cluster.gpu_types]])");
      }
      g.gpu = *type;
      g.intra_node_GBps = nr.get_double("intra_node_GBps", 1e-3, 1e7)
                              .value_or(intra.value_or(type->nvlink_GBps_bidir / 2));
      g.inter_node_Gbps =
          nr.get_double("inter_node_Gbps", 1e-3, 1e7).value_or(inter.value_or(type->nic_Gbps));
      nr.reject_unknown();
      c.groups.push_back(g);
    }
  } else if (!base) {
    r.fail("nodes", "missing (required): add [[cluster.nodes]] entries or a preset");
  } else {
    for (auto& g : c.groups) {
      if (intra) g.intra_node_GBps = *intra;
      if (inter) g.inter_node_Gbps = *inter;
    }
  }
  r.reject_unknown();
  return c;
}

// ---- strategy ----

std::vector<int> read_int_array(TableReader& r, const std::string& key, const toml::node& node,
                                int64_t min, int64_t max) {
  const toml::array* array = node.as_array();
  if (!array) r.fail(key, std::string("must be an array of integers, got ") + toml_type_name(node));
  std::vector<int> out;
  for (const auto& item : *array) {
    const auto* v = item.as_integer();
    if (!v)
      r.fail_at(item, key, std::string("entries must be integers, got ") + toml_type_name(item));
    if (v->get() < min || v->get() > max) {
      r.fail_at(item, key,
                "entry " + std::to_string(v->get()) + " is outside [" + std::to_string(min) + ", " +
                    std::to_string(max) + "]");
    }
    out.push_back(to_int(v->get()));
  }
  return out;
}

Compression read_compression_text(TableReader& r, const std::string& key, const toml::node& node) {
  const auto* text = node.as_string();
  if (!text) r.fail_at(node, key, std::string("must be a string, got ") + toml_type_name(node));
  auto c = parse_compression(text->get());
  if (!c) {
    r.fail_at(node, key,
              "\"" + text->get() + "\" is not one of none | fp16 | topk:RATIO | powersgd:RANK");
  }
  return *c;
}

Strategy read_strategy(TableReader& r, const ModelSpec& model, const ClusterSpec& cluster) {
  Strategy s;
  const auto tp = r.get_int("tp", 1, kMaxDim);
  const auto pp = r.get_int("pp", 1, kMaxDim);
  const auto dp = r.get_int("dp", 1, kMaxDim);
  const auto cp = r.get_int("cp", 1, kMaxDim);
  s.tp = to_int(tp.value_or(1));
  s.pp = to_int(pp.value_or(1));
  s.cp = to_int(cp.value_or(1));
  if (auto v = r.get_bool("sp")) s.sp = *v;
  if (auto v = r.get_choice("attention", {"flash", "unfused"})) {
    s.attention = *v == "flash" ? Attention::kFlash : Attention::kUnfused;
  }
  if (auto v = r.get_bool("fp8")) s.fp8 = *v;
  if (auto v = r.get_int("microbatch_size", 1, kMaxDim)) s.microbatch_size = to_int(*v);
  if (auto v = r.get_int("global_batch", 1, kMaxDim))
    s.global_batch = to_int(*v);
  else
    r.fail("global_batch", "missing (required)");
  if (auto v = r.get_choice("schedule", {"gpipe", "1f1b", "interleaved"})) {
    s.schedule = *v == "gpipe"  ? Schedule::kGPipe
                 : *v == "1f1b" ? Schedule::k1F1B
                                : Schedule::kInterleaved;
  }
  if (auto v = r.get_int("virtual_stages", 1, kMaxDim)) s.virtual_stages = to_int(*v);
  if (auto v = r.get_choice("recompute", {"none", "selective", "full"})) {
    s.recompute = *v == "none"        ? Recompute::kNone
                  : *v == "selective" ? Recompute::kSelective
                                      : Recompute::kFull;
  }
  if (auto v = r.get_int("zero", 0, 3)) s.zero = to_int(*v);
  if (auto v = r.get_bool("overlap_grad_reduce")) s.overlap_grad_reduce = *v;
  if (auto v = r.get_bool("overlap_param_gather")) s.overlap_param_gather = *v;
  if (auto v = r.get_bool("tp_comm_overlap")) s.tp_comm_overlap = *v;
  if (const toml::node* n = r.get_node("stages")) {
    if (const auto* text = n->as_string()) {
      if (text->get() != "balanced") {
        r.fail("stages",
               "must be \"balanced\" or an array of layer counts, got \"" + text->get() + "\"");
      }
    } else {
      s.stage_layers = read_int_array(r, "stages", *n, 1, kMaxDim);
    }
  }
  if (const toml::node* n = r.get_node("placement")) {
    if (const auto* text = n->as_string()) {
      if (text->get() == "tp-pp-dp")
        s.placement = PlacementOrder::kTpPpDp;
      else if (text->get() == "tp-dp-pp")
        s.placement = PlacementOrder::kTpDpPp;
      else
        r.fail("placement", "must be \"tp-pp-dp\", \"tp-dp-pp\" or an array of GPU ids, got \"" +
                                text->get() + "\"");
    } else {
      s.gpus = read_int_array(r, "placement", *n, 0, kMaxDim);
    }
  }
  if (const toml::node* n = r.get_node("dp_shares")) {
    s.dp_shares = read_int_array(r, "dp_shares", *n, 0, kMaxDim);
  }
  if (const toml::node* n = r.get_node("compression")) {
    if (const toml::table* t = n->as_table()) {
      TableReader cr(*t, r.source(), "strategy.compression");
      if (const toml::node* d = cr.get_node("default")) {
        s.compression = read_compression_text(cr, "default", *d);
      }
      if (const toml::node* o = cr.get_node("overrides")) {
        const toml::array* array = o->as_array();
        if (!array)
          cr.fail("overrides", "must be an array of {layers = [first, last], method = \"...\"}");
        for (const auto& item : *array) {
          const toml::table* ot = item.as_table();
          if (!ot) cr.fail_at(item, "overrides", "each entry must be a table");
          TableReader orr(*ot, r.source(), "strategy.compression.overrides");
          CompressionOverride co;
          const toml::node* layers = orr.get_node("layers");
          if (!layers) orr.fail("layers", "missing (required): [first, last]");
          auto range = read_int_array(orr, "layers", *layers, 0, kMaxDim);
          if (range.size() != 2) orr.fail("layers", "must be [first, last]");
          co.first_layer = range[0];
          co.last_layer = range[1];
          const toml::node* method = orr.get_node("method");
          if (!method) orr.fail("method", "missing (required)");
          co.compression = read_compression_text(orr, "method", *method);
          orr.reject_unknown();
          s.compression_overrides.push_back(co);
        }
      }
      cr.reject_unknown();
    } else {
      s.compression = read_compression_text(r, "compression", *n);
    }
  }
  r.reject_unknown();

  // dp defaults to what the GPUs leave after tp, pp and cp.
  const int gpus = s.gpus.empty() ? cluster.num_gpus() : static_cast<int>(s.gpus.size());
  const int model_parallel = s.tp * s.pp * s.cp;
  if (dp) {
    s.dp = to_int(*dp);
  } else if (gpus % model_parallel != 0) {
    r.fail(cp ? "cp" : tp ? "tp" : "pp", "tp*pp*cp = " + std::to_string(model_parallel) +
                                             " does not divide the " + std::to_string(gpus) +
                                             " GPUs");
  } else {
    s.dp = gpus / model_parallel;
  }
  if (auto problem = find_problem(s, model, cluster)) r.fail(problem->key, problem->reason);
  return s;
}

// ---- strategy presets and inline text ----

int largest_divisor_at_most(int n, int limit) {
  for (int d = std::min(n, limit); d > 1; --d) {
    if (n % d == 0) return d;
  }
  return 1;
}

int round_up(int value, int multiple) { return (value + multiple - 1) / multiple * multiple; }

// Preset keys as TOML values, resolved for this model and cluster.
std::map<std::string, std::string> strategy_preset(const std::string& name, const ModelSpec& model,
                                                   const ClusterSpec& cluster) {
  const int gpus = cluster.num_gpus();
  std::map<std::string, std::string> keys;
  if (name == "dp") {
    keys = {{"tp", "1"},
            {"pp", "1"},
            {"zero", "1"},
            {"microbatch_size", "1"},
            {"global_batch", std::to_string(round_up(256, gpus))}};
    return keys;
  }
  if (name == "megatron") {
    int node_gpus = 1 << 20;
    for (const auto& g : cluster.groups) node_gpus = std::min(node_gpus, g.gpus_per_node);
    int tp = largest_divisor_at_most(std::gcd(model.heads, node_gpus), 8);
    while (tp > 1 && (model.kv_heads % tp != 0 && tp % model.kv_heads != 0)) --tp;
    CostModel cost(model, cluster);
    Strategy s;
    s.tp = tp;
    s.sp = tp > 1;
    s.recompute = Recompute::kSelective;
    s.zero = 1;
    // Smallest pipeline depth (a divisor of the remaining GPUs) that fits in memory.
    int best_pp = 1;
    for (int pp = 1; pp <= std::min(gpus / tp, model.layers); ++pp) {
      if ((gpus / tp) % pp != 0) continue;
      s.pp = pp;
      s.dp = gpus / (tp * pp);
      s.global_batch = round_up(256, s.dp);
      best_pp = pp;
      if (find_problem(s, model, cluster)) continue;
      if (cost.evaluate(s).fits_in_memory) break;
    }
    const int dp = gpus / (tp * best_pp);
    keys = {{"tp", std::to_string(tp)},
            {"pp", std::to_string(best_pp)},
            {"sp", tp > 1 ? "true" : "false"},
            {"recompute", "\"selective\""},
            {"zero", "1"},
            {"microbatch_size", "1"},
            {"global_batch", std::to_string(round_up(256, dp))}};
    return keys;
  }
  throw InputError("--strategy: unknown preset \"" + name +
                   "\" (presets: dp, megatron; or a "
                   ".toml file; or inline keys such as \"tp=8,pp=2,global_batch=512\")");
}

bool is_toml_literal(const std::string& v) {
  if (v == "true" || v == "false") return true;
  if (!v.empty() && (v[0] == '[' || v[0] == '"' || v[0] == '{')) return true;
  char* end = nullptr;
  std::strtod(v.c_str(), &end);
  return end && *end == '\0' && !v.empty();
}

Strategy load_inline_strategy(const std::string& arg, const ModelSpec& model,
                              const ClusterSpec& cluster) {
  std::map<std::string, std::string> keys;
  std::vector<std::string> tokens;
  // Split on commas outside brackets, so "stages=[4,4]" stays one token.
  std::string current;
  int depth = 0;
  for (char ch : arg) {
    if (ch == '[' || ch == '{') ++depth;
    if (ch == ']' || ch == '}') --depth;
    if (ch == ',' && depth == 0) {
      tokens.push_back(current);
      current.clear();
    } else {
      current += ch;
    }
  }
  tokens.push_back(current);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string& token = tokens[i];
    const auto eq = token.find('=');
    if (eq == std::string::npos) {
      if (i != 0) throw InputError("--strategy: \"" + token + "\" is not key=value");
      keys = strategy_preset(token, model, cluster);
      continue;
    }
    std::string key = token.substr(0, eq);
    std::string value = token.substr(eq + 1);
    if (key.empty()) throw InputError("--strategy: \"" + token + "\" has no key");
    keys[key] = is_toml_literal(value) ? value : "\"" + value + "\"";
  }
  std::string text = "[strategy]\n";
  for (const auto& [k, v] : keys) text += k + " = " + v + "\n";
  const toml::table root = parse_toml_text(text, "--strategy");
  const toml::table& table = *root.get("strategy")->as_table();
  TableReader r(table, "--strategy", "strategy");
  return read_strategy(r, model, cluster);
}

}  // namespace

bool looks_like_path(const std::string& arg) {
  return arg.find('/') != std::string::npos ||
         (arg.size() > 5 && arg.compare(arg.size() - 5, 5, ".toml") == 0);
}

StatusOr<ModelSpec> load_model(const std::string& arg) {
  return catch_input_error([&]() -> ModelSpec {
  if (!looks_like_path(arg)) {
    if (auto m = model_preset(arg)) return *m;
    throw InputError("--model: unknown preset \"" + arg +
                     "\" (presets: " + join(model_preset_names()) + "; or a path to a .toml file)");
  }
  const toml::table root = parse_toml_file(arg);
  TableReader r(table_in_file(root, arg, "model"), arg, "model");
  return read_model(r, std::filesystem::path(arg).stem().string());
  });
}

StatusOr<ClusterSpec> load_cluster(const std::string& arg) {
  return catch_input_error([&]() -> ClusterSpec {
  if (!looks_like_path(arg)) {
    if (auto c = cluster_preset(arg)) return *c;
    throw InputError("--cluster: \"" + arg +
                     "\" is not a cluster preset (form NxGxTYPE, e.g. "
                     "4x8xa100-80g or 8xh100, groups joined with '+'; GPU types: " +
                     join(gpu_type_names()) + "; or a path to a .toml file)");
  }
  const toml::table root = parse_toml_file(arg);
  TableReader r(table_in_file(root, arg, "cluster"), arg, "cluster");
  return read_cluster(r, std::filesystem::path(arg).stem().string());
  });
}

StatusOr<Strategy> load_strategy(const std::string& arg, const ModelSpec& model,
                                const ClusterSpec& cluster) {
  return catch_input_error([&]() -> Strategy {
    if (!looks_like_path(arg)) return load_inline_strategy(arg, model, cluster);
    const toml::table root = parse_toml_file(arg);
    TableReader r(table_in_file(root, arg, "strategy"), arg, "strategy");
    return read_strategy(r, model, cluster);
  });
}

namespace {

// A per-index factor: either a full array or a table {index = factor} of exceptions.
std::vector<double> read_factors(TableReader& r, const std::string& key, int count, double max) {
  const toml::node* node = r.get_node(key);
  if (!node) return {};
  std::vector<double> out(count, 1.0);
  auto value_of = [&](const toml::node& n) {
    double v = 0;
    if (const auto* f = n.as_floating_point())
      v = f->get();
    else if (const auto* i = n.as_integer())
      v = static_cast<double>(i->get());
    else
      r.fail_at(n, key, std::string("factors must be numbers, got ") + toml_type_name(n));
    if (!(v > 0 && v <= max)) {
      r.fail_at(n, key,
                "factor " + std::to_string(v) + " is outside (0, " + std::to_string(max) + "]");
    }
    return v;
  };
  if (const toml::array* array = node->as_array()) {
    if (static_cast<int>(array->size()) != count) {
      r.fail(key, "has " + std::to_string(array->size()) + " entries but the cluster has " +
                      std::to_string(count));
    }
    for (int i = 0; i < count; ++i) out[i] = value_of(*array->get(i));
  } else if (const toml::table* table = node->as_table()) {
    for (const auto& [k, v] : *table) {
      int index = -1;
      const std::string name(k.str());
      auto [ptr, ec] = std::from_chars(name.data(), name.data() + name.size(), index);
      if (ec != std::errc() || ptr != name.data() + name.size() || index < 0 || index >= count) {
        r.fail_at(v, key,
                  "\"" + name + "\" is not an index in [0, " + std::to_string(count - 1) + "]");
      }
      out[index] = value_of(v);
    }
  } else {
    r.fail(key, "must be an array of factors or a table {index = factor}");
  }
  return out;
}

}  // namespace

StatusOr<Conditions> load_conditions(const std::string& path, const ClusterSpec& cluster) {
  return catch_input_error([&]() -> Conditions {
  const toml::table root = parse_toml_file(path);
  TableReader r(table_in_file(root, path, "conditions"), path, "conditions");
  Conditions c;
  c.gpu_speed = read_factors(r, "gpu_speed", cluster.num_gpus(), 100.0);
  c.node_inter_bw = read_factors(r, "node_inter_bw", cluster.num_nodes(), 100.0);
  c.node_intra_bw = read_factors(r, "node_intra_bw", cluster.num_nodes(), 100.0);
  if (const toml::node* node = r.get_node("failed_gpus")) {
    c.gpu_failed.assign(cluster.num_gpus(), false);
    for (int g : read_int_array(r, "failed_gpus", *node, 0, cluster.num_gpus() - 1)) {
      c.gpu_failed[g] = true;
    }
  }
  r.reject_unknown();
  return c;
  });
}

std::string strategy_to_toml(const Strategy& s) {
  std::ostringstream out;
  auto list = [&](const std::vector<int>& v) {
    out << "[";
    for (size_t i = 0; i < v.size(); ++i) out << (i ? ", " : "") << v[i];
    out << "]";
  };
  out << "[strategy]\n";
  out << "dp = " << s.dp << "\ntp = " << s.tp << "\npp = " << s.pp << "\ncp = " << s.cp << "\n";
  out << "sp = " << (s.sp ? "true" : "false") << "\n";
  out << "attention = \"" << to_string(s.attention) << "\"\n";
  out << "fp8 = " << (s.fp8 ? "true" : "false") << "\n";
  out << "microbatch_size = " << s.microbatch_size << "\nglobal_batch = " << s.global_batch << "\n";
  out << "schedule = \"" << to_string(s.schedule) << "\"\nvirtual_stages = " << s.virtual_stages
      << "\n";
  out << "recompute = \"" << to_string(s.recompute) << "\"\nzero = " << s.zero << "\n";
  out << "overlap_grad_reduce = " << (s.overlap_grad_reduce ? "true" : "false") << "\n";
  out << "overlap_param_gather = " << (s.overlap_param_gather ? "true" : "false") << "\n";
  out << "tp_comm_overlap = " << (s.tp_comm_overlap ? "true" : "false") << "\n";
  out << "stages = ";
  if (s.stage_layers.empty())
    out << "\"balanced\"";
  else
    list(s.stage_layers);
  out << "\nplacement = ";
  if (s.gpus.empty())
    out << "\"" << to_string(s.placement) << "\"";
  else
    list(s.gpus);
  out << "\n";
  if (!s.dp_shares.empty()) {
    out << "dp_shares = ";
    list(s.dp_shares);
    out << "\n";
  }
  if (s.compression_overrides.empty()) {
    out << "compression = \"" << to_string(s.compression) << "\"\n";
  } else {
    out << "\n[strategy.compression]\ndefault = \"" << to_string(s.compression) << "\"\n";
    out << "overrides = [\n";
    for (const auto& o : s.compression_overrides) {
      out << "  { layers = [" << o.first_layer << ", " << o.last_layer << "], method = \""
          << to_string(o.compression) << "\" },\n";
    }
    out << "]\n";
  }
  return out.str();
}

}  // namespace parapilot
