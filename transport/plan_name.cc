#include "transport/plan_name.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "core/text.h"

namespace parapilot::transport {

namespace {

using text::split;
using text::to_double;
using text::to_int;
using text::trim;

/// An integer in [lo, hi] for a layout name field.
int to_bounded(std::string_view text, std::int64_t lo, std::int64_t hi, const std::string& what) {
  const std::int64_t v = to_int(text, what);
  if (v < lo || v > hi)
    throw InputError(what + ": " + std::to_string(v) + " is outside [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]");
  return static_cast<int>(v);
}

std::string format_number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

char compression_code(CompressionMethod c) {
  switch (c) {
    case CompressionMethod::none:
      return 'n';
    case CompressionMethod::fp16:
      return 'h';
    case CompressionMethod::topk:
      return 't';
    case CompressionMethod::powersgd:
      return 'p';
  }
  return 'n';
}

constexpr int kMaxCount = 1 << 20;  // entries of a list field, and a run's length

using Kind = PlanNameKind;

// --- action texts ---------------------------------------------------------------------------

std::string encode_action_or_throw(const ActionPlanName& a) {
  std::string out;
  auto field = [&out](const std::string& f) {
    if (!out.empty()) out.push_back(';');
    out.append(f);
  };
  if (!a.shares.empty()) {
    std::string s = "s=";
    for (std::size_t i = 0; i < a.shares.size(); ++i) {
      if (i) s.push_back('/');
      s.append(format_number(a.shares[i]));
    }
    field(s);
  }
  if (!a.compression.empty()) {
    std::string s = "c=";
    for (std::size_t i = 0; i < a.compression.size();) {
      std::size_t j = i;
      while (j < a.compression.size() && a.compression[j] == a.compression[i]) ++j;
      s.append(std::to_string(j - i));
      s.push_back(compression_code(a.compression[i]));
      i = j;
    }
    field(s);
  }
  if (a.topk_ratio > 0) field("k=" + format_number(a.topk_ratio));
  if (a.powersgd_rank > 0) field("r=" + std::to_string(a.powersgd_rank));
  if (a.bucket_bytes >= 0) field("b=" + std::to_string(a.bucket_bytes));
  if (a.microbatch > 0) field("m=" + std::to_string(a.microbatch));
  if (!a.layout.empty()) {
    if (a.layout.find(';') != std::string::npos)
      throw InputError("live action: layout '" + a.layout + "' contains ';'");
    field("l=" + a.layout);
  }
  if (out.empty()) out = "keep";
  if (out.size() > kMaxNameBytes)
    throw InputError("live action too long for the bus (" + std::to_string(out.size()) + " > " +
                     std::to_string(kMaxNameBytes) + " bytes): " + out);
  return out;
}

void decode_compression(std::string_view value, const std::string& where,
                        std::vector<CompressionMethod>& out) {
  std::size_t i = 0;
  while (i < value.size()) {
    std::size_t j = i;
    while (j < value.size() && value[j] >= '0' && value[j] <= '9') ++j;
    if (j == i || j >= value.size()) throw InputError(where + ": bad compression run");
    const std::int64_t n = to_int(value.substr(i, j - i), where + " c");
    if (n < 1 || n > 65536) throw InputError(where + ": bad compression run length");
    CompressionMethod c{};
    switch (value[j]) {
      case 'n':
        c = CompressionMethod::none;
        break;
      case 'h':
        c = CompressionMethod::fp16;
        break;
      case 't':
        c = CompressionMethod::topk;
        break;
      case 'p':
        c = CompressionMethod::powersgd;
        break;
      default:
        throw InputError(where + ": unknown compression code '" + std::string(1, value[j]) + "'");
    }
    out.insert(out.end(), static_cast<std::size_t>(n), c);
    i = j + 1;
  }
}

ActionPlanName decode_action_or_throw(std::string_view text) {
  ActionPlanName a;
  if (text == "keep") return a;
  const std::string where = "live action '" + std::string(text) + "'";
  for (std::string_view part : split(text, ';')) {
    if (part.size() < 2 || part[1] != '=')
      throw InputError(where + ": bad field '" + std::string(part) + "'");
    const char key = part[0];
    const std::string_view value = part.substr(2);
    switch (key) {
      case 's': {
        a.shares.clear();
        for (std::string_view v : split(value, '/')) a.shares.push_back(to_double(v, where + " s"));
        double sum = 0;
        for (double v : a.shares) {
          if (v < 0) throw InputError(where + ": negative share");
          sum += v;
        }
        if (sum <= 0) throw InputError(where + ": shares sum to zero");
        for (double& v : a.shares) v /= sum;
        break;
      }
      case 'c':
        decode_compression(value, where, a.compression);
        break;
      case 'k':
        a.topk_ratio = to_double(value, where + " k");
        if (!(a.topk_ratio > 0 && a.topk_ratio <= 1))
          throw InputError(where + ": k must be in (0, 1]");
        break;
      case 'r':
        a.powersgd_rank = static_cast<int>(to_int(value, where + " r"));
        if (a.powersgd_rank < 1 || a.powersgd_rank > 1024)
          throw InputError(where + ": r must be in [1, 1024]");
        break;
      case 'b':
        a.bucket_bytes = to_int(value, where + " b");
        if (a.bucket_bytes < 0) throw InputError(where + ": b must be >= 0");
        break;
      case 'm':
        a.microbatch = static_cast<int>(to_int(value, where + " m"));
        if (a.microbatch < 1) throw InputError(where + ": m must be >= 1");
        break;
      case 'l':
        if (value.empty()) throw InputError(where + ": empty layout");
        a.layout = std::string(value);
        break;
      default:
        throw InputError(where + ": unknown field '" + std::string(1, key) + "'");
    }
  }
  return a;
}

// --- layout names ---------------------------------------------------------------------------

const std::vector<std::string_view> kSchedules{"gpipe", "1f1b", "interleaved"};
const std::vector<std::string_view> kRecomputes{"none", "selective", "full"};

bool one_of(std::string_view v, const std::vector<std::string_view>& allowed) {
  for (std::string_view a : allowed)
    if (v == a) return true;
  return false;
}

/// Appends `sep` (unless `first`) and `v` to `out`.
void append(std::string& out, bool first, std::string_view sep, long long v) {
  if (!first) out.append(sep);
  out.append(std::to_string(v));
}

std::string encode_layout_or_throw(const LayoutPlanName& n) {
  std::string out;
  append(out, false, "dp", n.dp);
  append(out, false, "-tp", n.tp);
  append(out, false, "-pp", n.pp);
  append(out, false, "-mb", n.microbatch);
  if (n.sp) out += "-sp";
  if (n.virtual_stages > 1) append(out, false, "-v", n.virtual_stages);
  append(out, false, "-z", n.zero);
  if (n.elastic) out += "-elastic";
  if (n.schedule) {
    if (!one_of(*n.schedule, kSchedules)) throw InputError("layout name: sc '" + *n.schedule + "'");
    out += ";sc=";
    out += *n.schedule;
  }
  if (n.recompute) {
    if (!one_of(*n.recompute, kRecomputes))
      throw InputError("layout name: rc '" + *n.recompute + "'");
    out += ";rc=";
    out += *n.recompute;
  }
  if (!n.stage_layers.empty()) {
    out += ";st=";
    for (std::size_t i = 0; i < n.stage_layers.size(); ++i)
      append(out, i == 0, ",", n.stage_layers[i]);
  }
  if (!n.dp_shares.empty()) {
    // Runs of equal shares: "33*7,29".
    out += ";sh=";
    for (std::size_t i = 0; i < n.dp_shares.size();) {
      std::size_t j = i;
      while (j < n.dp_shares.size() && n.dp_shares[j] == n.dp_shares[i]) ++j;
      append(out, i == 0, ",", n.dp_shares[i]);
      if (j - i > 1) append(out, false, "*", static_cast<long long>(j - i));
      i = j;
    }
  }
  if (!n.gpus.empty()) {
    // Ranges of consecutive GPUs: "0-2,4-15,3".
    out += ";g=";
    for (std::size_t i = 0; i < n.gpus.size();) {
      std::size_t j = i + 1;
      while (j < n.gpus.size() && n.gpus[j] == n.gpus[j - 1] + 1) ++j;
      append(out, i == 0, ",", n.gpus[i]);
      if (j - i > 1) append(out, false, "-", n.gpus[j - 1]);
      i = j;
    }
  }
  if (out.size() > kMaxNameBytes)
    throw InputError("layout name too long for the bus (" + std::to_string(out.size()) + " > " +
                     std::to_string(kMaxNameBytes) + " bytes)");
  return out;
}

/// "dp8-tp2-pp1-mb1[-sp][-vV]-zZ[-elastic]".
void decode_head(std::string_view head, const std::string& where, LayoutPlanName& n) {
  const std::vector<std::string_view> parts = split(head, '-');
  std::size_t i = 0;
  auto number = [&](std::string_view prefix, std::int64_t lo, std::int64_t hi) {
    if (i >= parts.size() || !parts[i].starts_with(prefix))
      throw InputError(where + ": head: expected '" + std::string(prefix) + "<n>' at part " +
                       std::to_string(i + 1));
    return to_bounded(parts[i++].substr(prefix.size()), lo, hi, where + " " + std::string(prefix));
  };
  n.dp = number("dp", 1, kMaxRanks);
  n.tp = number("tp", 1, kMaxRanks);
  n.pp = number("pp", 1, kMaxRanks);
  n.microbatch = number("mb", 1, kMaxCount);
  if (i < parts.size() && parts[i] == "sp") n.sp = true, ++i;
  if (i < parts.size() && parts[i].starts_with("v")) n.virtual_stages = number("v", 2, kMaxCount);
  n.zero = number("z", 0, 3);
  if (i < parts.size() && parts[i] == "elastic") n.elastic = true, ++i;
  if (i != parts.size())
    throw InputError(where + ": head: unexpected '" + std::string(parts[i]) + "'");
}

/// "a,b*3,c" (with runs) or "a,b,c": each item in [lo, kMaxRanks].
std::vector<int> decode_list(std::string_view value, bool runs, int lo, const std::string& what) {
  std::vector<int> out;
  for (std::string_view item : split(value, ',')) {
    const std::size_t star = runs ? item.find('*') : std::string_view::npos;
    const int v = to_bounded(item.substr(0, star), lo, kMaxRanks, what);
    const int count =
        star == std::string_view::npos ? 1 : to_bounded(item.substr(star + 1), 1, kMaxCount, what);
    if (out.size() + static_cast<std::size_t>(count) > static_cast<std::size_t>(kMaxCount))
      throw InputError(what + ": more than " + std::to_string(kMaxCount) + " entries");
    out.insert(out.end(), static_cast<std::size_t>(count), v);
  }
  return out;
}

/// "0-2,4,5-7": ranges of GPUs.
std::vector<int> decode_ranges(std::string_view value, const std::string& what) {
  std::vector<int> out;
  for (std::string_view item : split(value, ',')) {
    const std::size_t dash = item.find('-');
    const int first = to_bounded(item.substr(0, dash), 0, kMaxRanks, what);
    const int last = dash == std::string_view::npos
                         ? first
                         : to_bounded(item.substr(dash + 1), first, kMaxRanks, what);
    if (out.size() + static_cast<std::size_t>(last - first + 1) >
        static_cast<std::size_t>(kMaxCount))
      throw InputError(what + ": more than " + std::to_string(kMaxCount) + " entries");
    for (int g = first; g <= last; ++g) out.push_back(g);
  }
  return out;
}

LayoutPlanName decode_layout_or_throw(std::string_view text) {
  const std::string where = "layout name '" + std::string(text) + "'";
  const std::vector<std::string_view> fields = split(text, ';');
  LayoutPlanName n;
  decode_head(fields[0], where, n);
  for (std::size_t f = 1; f < fields.size(); ++f) {
    const std::string_view field = fields[f];
    const std::size_t eq = field.find('=');
    if (eq == std::string_view::npos)
      throw InputError(where + ": bad field '" + std::string(field) + "'");
    const std::string_view key = field.substr(0, eq), value = field.substr(eq + 1);
    const std::string what = where + " " + std::string(key);
    if (key == "sc") {
      if (!one_of(value, kSchedules))
        throw InputError(what + ": unknown schedule '" + std::string(value) + "'");
      n.schedule = std::string(value);
    } else if (key == "rc") {
      if (!one_of(value, kRecomputes))
        throw InputError(what + ": unknown recompute '" + std::string(value) + "'");
      n.recompute = std::string(value);
    } else if (key == "st") {
      n.stage_layers = decode_list(value, false, 0, what);
    } else if (key == "sh") {
      n.dp_shares = decode_list(value, true, 1, what);
    } else if (key == "g") {
      n.gpus = decode_ranges(value, what);
    } else {
      throw InputError(where + ": unknown field '" + std::string(key) + "'");
    }
  }
  return n;
}

}  // namespace

PlanNameKind plan_name_kind(std::string_view text) {
  if (text == "keep") return Kind::action;
  if (text.size() >= 2 && text[1] == '=' &&
      std::string_view("sckrbml").find(text[0]) != std::string_view::npos)
    return Kind::action;
  if (text.size() >= 3 && text.starts_with("dp") && text[2] >= '0' && text[2] <= '9')
    return Kind::layout;
  return Kind::label;
}

StatusOr<std::string> encode_plan_name(const PlanName& name) {
  return catch_input_error([&]() -> std::string {
    if (const auto* a = std::get_if<ActionPlanName>(&name)) return encode_action_or_throw(*a);
    if (const auto* l = std::get_if<LayoutPlanName>(&name)) return encode_layout_or_throw(*l);
    const std::string& label = std::get<LabelPlanName>(name).label;
    if (plan_name_kind(label) != Kind::label || label.find_first_of(";=") != std::string::npos ||
        label.size() > kMaxNameBytes)
      throw InputError("plan label '" + label + "' would not read back as a label");
    return label;
  });
}

StatusOr<PlanName> decode_plan_name(std::string_view text) {
  return catch_input_error([&]() -> PlanName {
    switch (plan_name_kind(text)) {
      case Kind::action:
        return decode_action_or_throw(text);
      case Kind::layout:
        return decode_layout_or_throw(text);
      case Kind::label:
        break;
    }
    if (text.find_first_of(";=") != std::string_view::npos)
      throw InputError("plan name '" + std::string(text) +
                       "': neither a layout name (dp<n>-...), a live action (keep, s=..., ...) "
                       "nor a label (no ';' or '=')");
    return LabelPlanName{std::string(text)};
  });
}

}  // namespace parapilot::transport
