#include "env/live/action.h"

#include <algorithm>
#include <cassert>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>

#include "core/error.h"
#include "core/text.h"
#include "transport/plan_name.h"
#include "env/live/fault_spec.h"

namespace parapilot::live {

namespace {

using text::split;
using text::to_double;
using text::to_int;
using text::trim;

/// Value with a unit suffix: "3x", "20ms", "100s", "1.5".
double with_unit(std::string_view value, std::string_view unit, const std::string& what) {
  value = trim(value);
  if (value.size() >= unit.size() && value.substr(value.size() - unit.size()) == unit)
    value.remove_suffix(unit.size());
  return to_double(value, what);
}

Compression from_wire(transport::CompressionMethod m) {
  switch (m) {
    case transport::CompressionMethod::none:
      return Compression::none;
    case transport::CompressionMethod::fp16:
      return Compression::fp16;
    case transport::CompressionMethod::topk:
      return Compression::topk;
    case transport::CompressionMethod::powersgd:
      return Compression::powersgd;
  }
  throw InputError("unknown compression method " + std::to_string(static_cast<int>(m)));
}

transport::CompressionMethod to_wire(Compression c) {
  switch (c) {
    case Compression::none:
      return transport::CompressionMethod::none;
    case Compression::fp16:
      return transport::CompressionMethod::fp16;
    case Compression::topk:
      return transport::CompressionMethod::topk;
    case Compression::powersgd:
      return transport::CompressionMethod::powersgd;
  }
  return transport::CompressionMethod::none;
}

transport::ActionPlanName to_plan_name(const LiveAction& a) {
  transport::ActionPlanName n;
  n.shares = a.shares;
  for (Compression c : a.compression) n.compression.push_back(to_wire(c));
  n.topk_ratio = a.topk_ratio;
  n.powersgd_rank = a.powersgd_rank;
  n.bucket_bytes = a.bucket_bytes;
  n.microbatch = a.microbatch;
  n.layout = a.layout;
  return n;
}

LiveAction from_plan_name(const transport::ActionPlanName& n) {
  LiveAction a;
  a.shares = n.shares;
  for (transport::CompressionMethod c : n.compression) a.compression.push_back(from_wire(c));
  a.topk_ratio = n.topk_ratio;
  a.powersgd_rank = n.powersgd_rank;
  a.bucket_bytes = n.bucket_bytes;
  a.microbatch = n.microbatch;
  a.layout = n.layout;
  return a;
}

}  // namespace

std::string_view compression_name(Compression c) {
  switch (c) {
    case Compression::none:
      return "none";
    case Compression::fp16:
      return "fp16";
    case Compression::topk:
      return "topk";
    case Compression::powersgd:
      return "powersgd";
  }
  return "none";
}

bool is_action_text(std::string_view name) {
  return transport::plan_name_kind(name) == transport::PlanNameKind::action;
}

namespace {

LiveAction plan_or_throw(const transport::PlanPrepare& plan, int world_size,
                         std::size_t layers) {
  StatusOr<transport::PlanName> decoded = transport::decode_plan_name(plan.layout_name);
  if (!decoded.ok()) throw InputError(decoded.status().message());
  if (const auto* action = std::get_if<transport::ActionPlanName>(&*decoded))
    return from_plan_name(*action);
  // A layout name, or a label: the structured Layout plus what the name carries.
  const transport::LayoutPlanName name =
      std::holds_alternative<transport::LayoutPlanName>(*decoded)
          ? std::get<transport::LayoutPlanName>(*decoded)
          : transport::LayoutPlanName{};
  const transport::Layout& l = plan.layout;
  const std::string what = "layout '" + plan.layout_name + "'";
  if (static_cast<std::int64_t>(l.dp) * l.tp * l.pp != world_size)
    throw InputError(what + ": dp x tp x pp = " + std::to_string(l.dp) + " x " +
                     std::to_string(l.tp) + " x " + std::to_string(l.pp) + ", but the job has " +
                     std::to_string(world_size) + " ranks");
  const bool hybrid = l.tp != 1 || l.pp != 1;
  if (name.virtual_stages > 1)
    throw InputError(what + ": interleaved pipeline stages (v" +
                     std::to_string(name.virtual_stages) +
                     ") are not run by the workers (1F1B over one stage per rank)");
  std::string stages;
  for (std::size_t i = 0; i < name.stage_layers.size(); ++i) {
    if (i) stages.push_back(',');
    stages.append(std::to_string(name.stage_layers[i]));
  }
  if (hybrid && !name.gpus.empty()) {
    // The workers place ranks in the rank order (tp fastest, then stage, then replica).
    bool identity = name.gpus.size() == static_cast<std::size_t>(world_size);
    for (std::size_t i = 0; identity && i < name.gpus.size(); ++i)
      identity = name.gpus[i] == static_cast<int>(i);
    if (!identity)
      throw InputError(what + ": device map of " + std::to_string(name.gpus.size()) +
                       " entries: the workers place a hybrid layout's ranks in the rank order "
                       "only");
  }
  std::string layout_text =
      "dp=" + std::to_string(l.dp) + ",tp=" + std::to_string(l.tp) + ",pp=" + std::to_string(l.pp);
  if (!stages.empty()) layout_text += ",stages=[" + stages + "]";
  if (hybrid) {
    LiveAction a;
    a.layout = layout_text;
    if (!l.dp_shares.empty()) {
      if (l.dp_shares.size() != l.dp)
        throw InputError(what + ": " + std::to_string(l.dp_shares.size()) + " shares for " +
                         std::to_string(l.dp) + " replicas");
      double total = 0;
      for (std::uint32_t v : l.dp_shares) total += v;
      if (!(total > 0)) throw InputError(what + ": shares sum to zero");
      for (std::uint32_t v : l.dp_shares) a.shares.push_back(v / total);
    }
    if (!l.compression.empty()) {
      a.compression.assign(layers, Compression::none);
      for (const transport::LayerCompression& c : l.compression) {
        if (c.first_layer >= layers) continue;
        const std::size_t last = std::min<std::size_t>(c.last_layer, layers - 1);
        for (std::size_t i = c.first_layer; i <= last; ++i) a.compression[i] = from_wire(c.method);
        if (c.method == transport::CompressionMethod::topk) a.topk_ratio = c.parameter;
        if (c.method == transport::CompressionMethod::powersgd)
          a.powersgd_rank = static_cast<int>(std::lround(c.parameter));
      }
    }
    return a;
  }
  LiveAction a;
  a.layout = layout_text;
  std::vector<double> per_replica(l.dp_shares.begin(), l.dp_shares.end());
  if (per_replica.empty()) per_replica.assign(static_cast<std::size_t>(world_size), 1.0);
  if (per_replica.size() != static_cast<std::size_t>(world_size))
    throw InputError(what + ": " + std::to_string(per_replica.size()) + " shares for " +
                     std::to_string(world_size) + " ranks");
  // The device map ";g=..." of the layout name: replica i on rank g[i].
  std::vector<int> device_of(per_replica.size());
  std::iota(device_of.begin(), device_of.end(), 0);
  if (!name.gpus.empty()) device_of = name.gpus;
  for (int g : device_of) {
    if (g >= world_size)
      throw InputError(what + ": device map entry " + std::to_string(g) + " is out of range");
  }
  std::vector<int> sorted = device_of;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int> ranks(per_replica.size());
  std::iota(ranks.begin(), ranks.end(), 0);
  if (sorted != ranks) throw InputError(what + ": the device map is not a permutation of the ranks");
  const double total = std::accumulate(per_replica.begin(), per_replica.end(), 0.0);
  if (!(total > 0)) throw InputError(what + ": shares sum to zero");
  a.shares.assign(per_replica.size(), 0.0);
  for (std::size_t i = 0; i < per_replica.size(); ++i)
    a.shares[static_cast<std::size_t>(device_of[i])] = per_replica[i] / total;
  if (!l.compression.empty()) {
    a.compression.assign(layers, Compression::none);
    for (const transport::LayerCompression& c : l.compression) {  // later entries override
      if (c.first_layer >= layers) continue;
      const std::size_t last = std::min<std::size_t>(c.last_layer, layers - 1);
      for (std::size_t i = c.first_layer; i <= last; ++i)
        a.compression[i] = from_wire(c.method);
      if (c.method == transport::CompressionMethod::topk) a.topk_ratio = c.parameter;
      if (c.method == transport::CompressionMethod::powersgd)
        a.powersgd_rank = static_cast<int>(std::lround(c.parameter));
    }
  }
  return a;
}

}  // namespace

std::vector<int> microbatch_counts(const std::vector<double>& shares, int microbatches) {
  // Preconditions (action.h): the shares come from parse_shares or action_from_plan.
  assert(!shares.empty());
  double sum = 0;
  for (double s : shares) {
    assert(s >= 0 && std::isfinite(s));
    sum += s;
  }
  assert(sum > 0);
  std::vector<int> counts(shares.size());
  std::vector<std::pair<double, std::size_t>> rest;
  int given = 0;
  for (std::size_t r = 0; r < shares.size(); ++r) {
    const double exact = shares[r] / sum * microbatches;
    counts[r] = static_cast<int>(std::floor(exact));
    given += counts[r];
    rest.emplace_back(exact - counts[r], r);
  }
  std::stable_sort(rest.begin(), rest.end(),
                   [](const auto& x, const auto& y) { return x.first > y.first; });
  for (std::size_t i = 0; given < microbatches; ++i, ++given)
    ++counts[rest[i % rest.size()].second];
  return counts;
}

namespace {

std::vector<double> parse_shares_or_throw(std::string_view text) {
  std::vector<double> out;
  const char sep = text.find('/') != std::string_view::npos ? '/' : ',';
  for (std::string_view v : split(text, sep)) out.push_back(to_double(v, "--shares"));
  double sum = 0;
  for (double v : out) {
    if (v < 0) throw InputError("--shares: negative share in '" + std::string(text) + "'");
    sum += v;
  }
  if (sum <= 0) throw InputError("--shares: the shares in '" + std::string(text) + "' sum to zero");
  for (double& v : out) v /= sum;
  return out;
}

}  // namespace

StatusOr<std::vector<double>> parse_shares(std::string_view text) {
  return catch_input_error([&] { return parse_shares_or_throw(text); });
}

namespace {

std::vector<Compression> parse_compression_list_or_throw(std::string_view text) {
  std::vector<Compression> out;
  for (std::string_view v : split(text, ',')) {
    v = trim(v);
    if (v == "none")
      out.push_back(Compression::none);
    else if (v == "fp16")
      out.push_back(Compression::fp16);
    else if (v == "topk")
      out.push_back(Compression::topk);
    else if (v == "powersgd")
      out.push_back(Compression::powersgd);
    else
      throw InputError("--compression: unknown compression '" + std::string(v) +
                       "' (none, fp16, topk, powersgd, or auto)");
  }
  return out;
}

}  // namespace

StatusOr<std::vector<Compression>> parse_compression_list(std::string_view text) {
  return catch_input_error([&] { return parse_compression_list_or_throw(text); });
}

namespace {

void validate_or_throw(const ModelConfig& m) {
  if (m.kind != "transformer" && m.kind != "mlp")
    throw InputError("--model: '" + m.kind + "' is not a model (transformer, mlp)");
  if (m.layers < 1 || m.layers > 64) throw InputError("--layers: must be in [1, 64]");
  if (m.d_model < 4 || m.d_model > 4096) throw InputError("--d-model: must be in [4, 4096]");
  if (m.kind == "transformer" && (m.heads < 1 || m.d_model % m.heads != 0))
    throw InputError("--heads: must be >= 1 and divide --d-model");
  if (m.seq_len < 2 || m.seq_len > 8192) throw InputError("--seq-len: must be in [2, 8192]");
  if (m.kind == "mlp" && (m.context < 1 || m.context >= m.seq_len))
    throw InputError("--context: must be in [1, seq-len)");
}

}  // namespace

Status validate(const ModelConfig& m) {
  return catch_input_error([&] { validate_or_throw(m); });
}

std::int64_t LayerShape::numel() const {
  return std::accumulate(shape.begin(), shape.end(), std::int64_t{1},
                         [](std::int64_t a, std::int64_t b) { return a * b; });
}

std::vector<LayerShape> model_layers(const ModelConfig& m) {
  const std::int64_t d = m.d_model, v = ModelConfig::kVocab;
  std::vector<LayerShape> out;
  if (m.kind == "transformer") {
    // Own parameters first (pos), then submodules in registration order (libtorch's order).
    out.push_back({"pos", {m.seq_len, d}});
    out.push_back({"tok.weight", {v, d}});
    for (int b = 0; b < m.layers; ++b) {
      const std::string p = "blocks." + std::to_string(b) + ".";
      out.push_back({p + "ln1.weight", {d}});
      out.push_back({p + "ln1.bias", {d}});
      out.push_back({p + "qkv.weight", {3 * d, d}});
      out.push_back({p + "qkv.bias", {3 * d}});
      out.push_back({p + "proj.weight", {d, d}});
      out.push_back({p + "proj.bias", {d}});
      out.push_back({p + "ln2.weight", {d}});
      out.push_back({p + "ln2.bias", {d}});
      out.push_back({p + "fc1.weight", {4 * d, d}});
      out.push_back({p + "fc1.bias", {4 * d}});
      out.push_back({p + "fc2.weight", {d, 4 * d}});
      out.push_back({p + "fc2.bias", {d}});
    }
    out.push_back({"lnf.weight", {d}});
    out.push_back({"lnf.bias", {d}});
    out.push_back({"head.weight", {v, d}});
    out.push_back({"head.bias", {v}});
  } else {
    const std::int64_t hidden = 4 * d;
    out.push_back({"tok.weight", {v, d}});
    std::int64_t in = m.context * d;
    for (int l = 0; l < m.layers; ++l) {
      const std::string p = "hidden." + std::to_string(l) + ".";
      out.push_back({p + "weight", {hidden, in}});
      out.push_back({p + "bias", {hidden}});
      in = hidden;
    }
    out.push_back({"head.weight", {v, in}});
    out.push_back({"head.bias", {v}});
  }
  return out;
}

std::vector<Compression> select_compression(const std::vector<LayerShape>& layers,
                                            const std::vector<LayerGradSummary>& grads,
                                            const SelectorOptions& o) {
  std::vector<Compression> out;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const LayerShape& l = layers[i];
    const LayerGradSummary g = i < grads.size() ? grads[i] : LayerGradSummary{};
    Compression c = Compression::none;
    if (g.nonfinite == 0 && l.numel() >= o.min_elements) {
      c = g.max_abs <= o.fp16_max_abs ? Compression::fp16 : Compression::none;
      if (l.shape.size() == 2) {
        const double m = static_cast<double>(l.shape[0]), n = static_cast<double>(l.shape[1]);
        const double saving = m * n / ((m + n) * o.powersgd_rank);
        if (saving >= o.powersgd_min_saving) c = Compression::powersgd;
      }
    }
    out.push_back(c);
  }
  return out;
}

namespace {

// "20steps" or "1step": a time in training steps; nullopt for any other form (seconds).
std::optional<std::int64_t> steps_of(std::string_view value, const std::string& what) {
  value = trim(value);
  for (std::string_view unit : {"steps", "step"})
    if (value.ends_with(unit)) return to_int(value.substr(0, value.size() - unit.size()), what);
  return std::nullopt;
}

FaultSpec parse_fault_or_throw(std::string_view spec) {
  const std::string where = "--inject '" + std::string(spec) + "'";
  FaultSpec f;
  bool have_rank = false, have_kind = false;
  for (std::string_view part : split(spec, ',')) {
    part = trim(part);
    const std::size_t eq = part.find('=');
    const std::string_view key = part.substr(0, eq);
    const std::string_view value = eq == std::string_view::npos ? "" : part.substr(eq + 1);
    auto set_kind = [&](FaultSpec::Kind k) {
      if (have_kind) throw InputError(where + ": more than one fault kind");
      f.kind = k;
      have_kind = true;
    };
    if (key == "rank") {
      const std::int64_t r = to_int(value, where + " rank");
      if (r < 0 || r > 1 << 20) throw InputError(where + ": rank out of range");
      f.rank = static_cast<int>(r);
      have_rank = true;
    } else if (key == "slow") {
      set_kind(FaultSpec::Kind::slow);
      f.factor = with_unit(value, "x", where + " slow");
      if (f.factor < 1 || f.factor > 1000)
        throw InputError(where + ": slow must be in [1x, 1000x]");
    } else if (key == "link-delay") {
      set_kind(FaultSpec::Kind::link_delay);
      f.delay_ms = with_unit(value, "ms", where + " link-delay");
      if (f.delay_ms < 0 || f.delay_ms > 60000)
        throw InputError(where + ": link-delay must be in [0, 60000] ms");
    } else if (key == "kill") {
      if (!value.empty()) throw InputError(where + ": kill takes no value");
      set_kind(FaultSpec::Kind::kill);
    } else if (key == "link-cut") {
      if (!value.empty()) throw InputError(where + ": link-cut takes no value");
      set_kind(FaultSpec::Kind::link_cut);
    } else if (key == "at") {
      if (const auto steps = steps_of(value, where + " at")) {
        f.at_step = *steps;
        if (f.at_step < 0) throw InputError(where + ": at must be >= 0 steps");
      } else {
        f.at_s = with_unit(value, "s", where + " at");
        if (f.at_s < 0) throw InputError(where + ": at must be >= 0");
      }
    } else if (key == "for") {
      if (const auto steps = steps_of(value, where + " for")) {
        f.for_steps = *steps;
        if (f.for_steps <= 0) throw InputError(where + ": for must be > 0 steps");
      } else {
        f.for_s = with_unit(value, "s", where + " for");
        if (f.for_s <= 0) throw InputError(where + ": for must be > 0");
      }
    } else {
      throw InputError(where + ": unknown key '" + std::string(key) +
                       "' (rank, slow, link-delay, kill, link-cut, at, for)");
    }
  }
  if (!have_rank) throw InputError(where + ": missing rank=");
  if (!have_kind)
    throw InputError(where + ": missing a fault (slow=Nx, link-delay=Nms, kill or link-cut)");
  if (f.kind == FaultSpec::Kind::kill && (f.at_step >= 0 || f.for_steps >= 0))
    throw InputError(where + ": a kill's at is in seconds");
  if (f.kind == FaultSpec::Kind::link_cut && (f.at_step < 0 || f.for_steps >= 0 || f.at_s != 0 ||
                                              f.for_s < std::numeric_limits<double>::infinity()))
    throw InputError(where + ": a link cut takes at=Nsteps and no for");
  const bool seconds = f.at_s != 0 || f.for_s < std::numeric_limits<double>::infinity();
  if ((f.at_step >= 0 || f.for_steps >= 0) && seconds)
    throw InputError(where + ": at and for both in steps or both in seconds");
  if (f.for_steps >= 0 && f.at_step < 0) f.at_step = 0;
  return f;
}

}  // namespace

StatusOr<FaultSpec> parse_fault(std::string_view spec) {
  return catch_input_error([&] { return parse_fault_or_throw(spec); });
}

StatusOr<std::string> encode_action(const LiveAction& a) {
  return transport::encode_plan_name(to_plan_name(a));
}

StatusOr<LiveAction> decode_action(std::string_view text) {
  StatusOr<transport::PlanName> decoded = transport::decode_plan_name(text);
  if (!decoded.ok()) return decoded.status();
  const auto* action = std::get_if<transport::ActionPlanName>(&*decoded);
  if (!action) {
    return Status::invalid_argument("live action '" + std::string(text) +
                                    "': not an action text (keep, s=..., c=..., l=...)");
  }
  return catch_input_error([&] { return from_plan_name(*action); });
}

StatusOr<LiveAction> action_from_plan(const transport::PlanPrepare& plan, int world_size,
                                      std::size_t layers) {
  StatusOr<LiveAction> a =
      catch_input_error([&] { return plan_or_throw(plan, world_size, layers); });
  // A plan on the bus was validated when decoded: one this job cannot run is refused.
  if (!a.ok()) return Status::rejected(a.status().message());
  return a;
}

}  // namespace parapilot::live
