#include "env/live/layout.h"

#include <cassert>

#include "core/error.h"
#include "strategy/spec_io.h"

namespace parapilot::live {

namespace {

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  for (std::size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
}

// The strategy reader's message, worded for the worker's flag and its ranks.
std::string layout_message(std::string m, int world_size) {
  replace_all(m, "--strategy: [strategy] ", "--layout: ");
  replace_all(m, "--strategy: ", "--layout: ");
  const std::string n = std::to_string(world_size);
  replace_all(m, "the cluster has " + n + " GPUs", "the job has " + n + " ranks");
  replace_all(m, "the " + n + " GPUs", "the job's " + n + " ranks");
  return m;
}

// The key=value tokens of the text (commas inside brackets stay in their token). Only the keys
// the workers run may appear; the values are the strategy reader's to check.
std::vector<std::string> checked_tokens(std::string_view text) {
  std::vector<std::string> tokens(1);
  int depth = 0;
  for (char c : text) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0)
      tokens.emplace_back();
    else
      tokens.back() += c;
  }
  for (const std::string& token : tokens) {
    const std::size_t eq = token.find('=');
    if (eq == std::string::npos)
      throw InputError("--layout: \"" + token + "\" is not key=value (keys: dp, tp, pp, stages)");
    const std::string key = token.substr(0, eq);
    if (key != "dp" && key != "tp" && key != "pp" && key != "stages")
      throw InputError("--layout: unknown key '" + key +
                       "' (the workers run the keys dp, tp, pp, stages)");
  }
  return tokens;
}

LiveLayout parse_layout_or_throw(std::string_view text, int world_size, const ModelConfig& m) {
  if (world_size < 1) throw InputError("--layout: the job needs at least one rank");
  if (text.empty()) return data_parallel_layout(world_size, m);
  const std::vector<std::string> tokens = checked_tokens(text);
  const bool transformer = m.kind == "transformer";
  ModelSpec spec;
  spec.name = "live-" + m.kind;
  spec.layers = m.layers;
  spec.hidden = m.d_model;
  spec.heads = transformer ? m.heads : 1;
  spec.kv_heads = spec.heads;
  spec.ffn_hidden = 4 * m.d_model;
  spec.seq_len = m.seq_len;
  spec.vocab = ModelConfig::kVocab;
  const ClusterSpec cluster = take(load_cluster("1x" + std::to_string(world_size) + "xa100-80g"));
  // The batch is the worker's business (elastic shares); one sample per rank keeps the strategy
  // reader's batch checks satisfied whatever the degrees.
  StatusOr<Strategy> read = load_strategy(
      std::string(text) + ",global_batch=" + std::to_string(world_size), spec, cluster);
  if (!read.ok()) {
    // A value the TOML reader could not read names no key: find the token that alone fails so.
    const std::string& why = read.status().message();
    if (why.find("[strategy]") == std::string::npos)
      for (const std::string& token : tokens) {
        const StatusOr<Strategy> alone = load_strategy(token + ",global_batch=1", spec, cluster);
        if (!alone.ok() && alone.status().message().find("[strategy]") == std::string::npos)
          throw InputError("--layout: " + token.substr(0, token.find('=')) + ": '" +
                           token.substr(token.find('=') + 1) + "' is not a value (" +
                           layout_message(why, world_size).substr(10) + ")");
      }
    throw InputError(layout_message(why, world_size));
  }
  const Strategy& s = *read;
  if (!transformer && (s.tp > 1 || s.pp > 1))
    throw InputError("--layout: tp and pp need --model transformer (the " + m.kind +
                     " model runs data parallel only)");
  LiveLayout l;
  l.dp = s.dp;
  l.tp = s.tp;
  l.pp = s.pp;
  l.stages = s.layers_per_chunk(m.layers);
  return l;
}

std::vector<int> ranks_where(const LiveLayout& l, int rank, bool same_dp, bool same_tp,
                             bool same_stage) {
  const RankCoords me = coords_of(l, rank);
  std::vector<int> out;
  for (int r = 0; r < l.world_size(); ++r) {
    const RankCoords c = coords_of(l, r);
    if ((!same_dp || c.dp == me.dp) && (!same_tp || c.tp == me.tp) &&
        (!same_stage || c.stage == me.stage))
      out.push_back(r);
  }
  return out;
}

}  // namespace

LiveLayout data_parallel_layout(int world_size, const ModelConfig& model) {
  LiveLayout l;
  l.dp = world_size;
  l.stages = {model.layers};
  return l;
}

StatusOr<LiveLayout> parse_layout(std::string_view text, int world_size, const ModelConfig& model) {
  return catch_input_error([&] { return parse_layout_or_throw(text, world_size, model); });
}

std::string layout_text(const LiveLayout& l) {
  std::string out = "dp=" + std::to_string(l.dp) + ",tp=" + std::to_string(l.tp) +
                    ",pp=" + std::to_string(l.pp) + ",stages=[";
  for (std::size_t i = 0; i < l.stages.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(l.stages[i]);
  }
  out += ']';
  return out;
}

RankCoords coords_of(const LiveLayout& l, int rank) {
  assert(rank >= 0 && rank < l.world_size());
  RankCoords c;
  c.tp = rank % l.tp;
  c.stage = (rank / l.tp) % l.pp;
  c.dp = rank / (l.tp * l.pp);
  return c;
}

int rank_of(const LiveLayout& l, const RankCoords& at) {
  return (at.dp * l.pp + at.stage) * l.tp + at.tp;
}

std::vector<int> dp_group(const LiveLayout& l, int rank) {
  return ranks_where(l, rank, false, true, true);
}
std::vector<int> tp_group(const LiveLayout& l, int rank) {
  return ranks_where(l, rank, true, false, true);
}
std::vector<int> pipeline_group(const LiveLayout& l, int rank) {
  return ranks_where(l, rank, true, true, false);
}

std::vector<GroupSpec> layout_groups(const LiveLayout& l) {
  std::vector<GroupSpec> out;
  auto tag = [](const char* a, int x, const char* b, int y) {
    std::string name = a;
    name += std::to_string(x);
    name += b;
    name += std::to_string(y);
    return name;
  };
  if (l.dp > 1)
    for (int s = 0; s < l.pp; ++s)
      for (int t = 0; t < l.tp; ++t)
        out.push_back({"dp/" + tag("s", s, "t", t), dp_group(l, rank_of(l, {0, t, s}))});
  if (l.tp > 1)
    for (int d = 0; d < l.dp; ++d)
      for (int s = 0; s < l.pp; ++s)
        out.push_back({"tp/" + tag("d", d, "s", s), tp_group(l, rank_of(l, {d, 0, s}))});
  if (l.pp > 1)
    for (int d = 0; d < l.dp; ++d)
      for (int t = 0; t < l.tp; ++t)
        out.push_back({"pp/" + tag("d", d, "t", t), pipeline_group(l, rank_of(l, {d, t, 0}))});
  return out;
}

int first_block(const LiveLayout& l, int stage) {
  int b = 0;
  for (int s = 0; s < stage; ++s) b += l.stages[static_cast<std::size_t>(s)];
  return b;
}

int end_block(const LiveLayout& l, int stage) {
  return first_block(l, stage) + l.stages[static_cast<std::size_t>(stage)];
}

std::vector<ParamShard> rank_shards(const LiveLayout& l, const ModelConfig& m, int rank) {
  const std::vector<LayerShape> full = model_layers(m);
  std::vector<ParamShard> out;
  const RankCoords c = coords_of(l, rank);
  auto add = [&](int layer, ShardKind kind = ShardKind::replicated, int parts = 1) {
    ParamShard p;
    p.layer = layer;
    p.kind = kind;
    p.shape = full[static_cast<std::size_t>(layer)].shape;
    if (kind != ShardKind::replicated) {
      p.parts = parts;
      p.pieces = l.tp;
      p.piece = c.tp;
      p.shape[kind == ShardKind::rows ? 0 : 1] /= l.tp;
    }
    out.push_back(std::move(p));
  };
  if (m.kind != "transformer") {
    for (std::size_t i = 0; i < full.size(); ++i) add(static_cast<int>(i));
    return out;
  }
  constexpr int kPerBlock = 12;
  if (c.stage == 0) {
    add(0);  // pos
    add(1);  // tok.weight
  }
  for (int b = first_block(l, c.stage); b < end_block(l, c.stage); ++b) {
    const int base = 2 + kPerBlock * b;
    add(base + 0);                       // ln1.weight
    add(base + 1);                       // ln1.bias
    add(base + 2, ShardKind::rows, 3);   // qkv.weight: q, k, v blocks split by heads
    add(base + 3, ShardKind::rows, 3);   // qkv.bias
    add(base + 4, ShardKind::columns);   // proj.weight (row-parallel: input columns)
    add(base + 5);                       // proj.bias (added once, after the all-reduce)
    add(base + 6);                       // ln2.weight
    add(base + 7);                       // ln2.bias
    add(base + 8, ShardKind::rows);      // fc1.weight (column-parallel: output rows)
    add(base + 9, ShardKind::rows);      // fc1.bias
    add(base + 10, ShardKind::columns);  // fc2.weight (row-parallel)
    add(base + 11);                      // fc2.bias
  }
  if (c.stage == l.pp - 1) {
    const int base = 2 + kPerBlock * m.layers;
    for (int i = 0; i < 4; ++i) add(base + i);  // lnf.weight, lnf.bias, head.weight, head.bias
  }
  return out;
}

bool writes_in_gather(const LiveLayout& l, int rank, const ParamShard& shard) {
  const RankCoords c = coords_of(l, rank);
  return c.dp == 0 && (shard.kind != ShardKind::replicated || c.tp == 0);
}

}  // namespace parapilot::live
