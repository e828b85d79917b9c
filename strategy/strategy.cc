#include "strategy/strategy.h"

#include <charconv>
#include <cstdio>
#include <numeric>
#include <set>

namespace parapilot {

std::vector<int> Strategy::layers_per_chunk(int layers) const {
  if (!stage_layers.empty()) return stage_layers;
  const int chunks = num_chunks();
  std::vector<int> counts(chunks, layers / chunks);
  // The remainder goes to the middle chunks (the cost model's ChunkLayout agrees): the first
  // and last also carry the embedding and the logits.
  const int remainder = layers % chunks;
  const int first_extra = (chunks - remainder) / 2;
  for (int c = first_extra; c < first_extra + remainder; ++c) counts[c] += 1;
  return counts;
}

std::vector<int> Strategy::shares() const {
  if (!dp_shares.empty()) return dp_shares;
  return std::vector<int>(dp, global_batch / dp);
}

const Compression& Strategy::compression_of_layer(int layer) const {
  // Later overrides win over earlier ones.
  for (auto it = compression_overrides.rbegin(); it != compression_overrides.rend(); ++it) {
    if (layer >= it->first_layer && layer <= it->last_layer) return it->compression;
  }
  return compression;
}

namespace {

std::optional<StrategyProblem> problem(std::string key, std::string reason) {
  return StrategyProblem{std::move(key), std::move(reason)};
}

std::string str(int v) { return std::to_string(v); }

// Degrees, the GPU count and how the model's heads and sequence divide among them.
std::optional<StrategyProblem> degree_problem(const Strategy& s, const ModelSpec& model, const ClusterSpec& cluster) {
  if (s.dp < 1) return problem("dp", "must be >= 1");
  if (s.tp < 1) return problem("tp", "must be >= 1");
  if (s.pp < 1) return problem("pp", "must be >= 1");
  if (s.cp < 1) return problem("cp", "must be >= 1");
  if (s.microbatch_size < 1) return problem("microbatch_size", "must be >= 1");
  if (s.global_batch < 1) return problem("global_batch", "must be >= 1");
  if (s.virtual_stages < 1) return problem("virtual_stages", "must be >= 1");
  if (s.zero < 0 || s.zero > 3) return problem("zero", "must be 0, 1, 2 or 3");

  const int gpus = cluster.num_gpus();
  if (s.gpus.empty() && s.num_gpus() != gpus) {
    return problem("dp", "dp*tp*pp*cp = " + str(s.dp) + "*" + str(s.tp) + "*" + str(s.pp) + "*" +
                             str(s.cp) + " = " + str(s.num_gpus()) + " but the cluster has " +
                             str(gpus) + " GPUs");
  }
  if (!s.gpus.empty()) {
    if (static_cast<int>(s.gpus.size()) != s.num_gpus()) {
      return problem("placement", "lists " + str(static_cast<int>(s.gpus.size())) +
                                      " GPUs but dp*tp*pp*cp = " + str(s.num_gpus()));
    }
    std::set<int> seen;
    for (int g : s.gpus) {
      if (g < 0 || g >= gpus) {
        return problem("placement",
                       "GPU " + str(g) + " does not exist (cluster has " + str(gpus) + " GPUs)");
      }
      if (!seen.insert(g).second) return problem("placement", "GPU " + str(g) + " listed twice");
    }
  }

  if (model.heads % s.tp != 0) {
    return problem("tp", "tp = " + str(s.tp) + " does not divide the model's " + str(model.heads) +
                             " attention heads");
  }
  if (model.kv_heads % s.tp != 0 && s.tp % model.kv_heads != 0) {
    return problem("tp", "tp = " + str(s.tp) + " and the model's " + str(model.kv_heads) +
                             " key/value heads must divide one another");
  }
  if (s.cp > 1) {
    if (s.attention != Attention::kFlash) {
      return problem("cp", "context parallelism (cp = " + str(s.cp) +
                               ") needs attention = \"flash\": ring attention runs inside the "
                               "fused attention kernel");
    }
    // The sequence is cut into 2*cp chunks, two per rank, so that causal work balances.
    if (model.seq_len % (2 * s.cp) != 0) {
      return problem("cp", "cp = " + str(s.cp) + " needs 2*cp = " + str(2 * s.cp) +
                               " to divide seq_len = " + str(model.seq_len));
    }
  }
  if (s.sp && (model.seq_len / s.cp) % s.tp != 0) {
    return problem("sp", "sequence parallelism needs tp = " + str(s.tp) +
                             " to divide the sequence each context-parallel rank holds (" +
                             str(model.seq_len / s.cp) + ")");
  }
  return std::nullopt;
}

// Where the ranks sit: tensor-parallel groups inside a node, FP8 where the GPUs have it.
std::optional<StrategyProblem> placement_problem(const Strategy& s, const ClusterSpec& cluster) {
  // Tensor-parallel groups must stay inside one node; FP8 needs FP8 tensor cores on every GPU
  // the layout uses.
  ClusterTopology topo(cluster);
  for (int d = 0; d < s.dp; ++d) {
    for (int p = 0; p < s.pp; ++p) {
      for (int c = 0; c < s.cp; ++c) {
        const int node = topo.node_of_gpu[s.gpu_of_rank(d, p, 0, c)];
        for (int t = 1; t < s.tp; ++t) {
          if (topo.node_of_gpu[s.gpu_of_rank(d, p, t, c)] != node) {
            return problem("tp", "the tensor-parallel group of replica " + str(d) + ", stage " +
                                     str(p) + (s.cp > 1 ? ", context rank " + str(c) : "") +
                                     " spans nodes (tp = " + str(s.tp) +
                                     " does not fit the node boundaries)");
          }
        }
        const GpuType& type = topo.types[topo.nodes[node].type];
        if (s.fp8 && type.fp8_tflops <= 0) {
          return problem("fp8", "fp8 = true needs FP8 tensor cores, which the " + type.name +
                                    " lacks (its fp8_tflops is 0); use fp8 = false or Hopper "
                                    "GPUs (h100, h800, h200)");
        }
      }
    }
  }
  return std::nullopt;
}

// The pipeline schedule, ZeRO with pipelines, and the stage boundaries.
std::optional<StrategyProblem> schedule_problem(const Strategy& s, const ModelSpec& model) {
  if (s.schedule == Schedule::kInterleaved) {
    if (s.pp < 2) return problem("schedule", "the interleaved schedule needs pp >= 2");
    if (s.virtual_stages < 2) {
      return problem("virtual_stages", "the interleaved schedule needs virtual_stages >= 2");
    }
  } else if (s.virtual_stages != 1) {
    return problem("virtual_stages", "virtual_stages > 1 needs schedule = \"interleaved\"");
  }
  if (s.zero >= 2 && s.pp > 1) {
    return problem("zero", "ZeRO stage " + str(s.zero) +
                               " partitions gradients, which pipeline parallelism (pp > 1) "
                               "accumulates across microbatches; use zero <= 1");
  }

  if (s.num_chunks() > model.layers) {
    return problem("pp", "pp*virtual_stages = " + str(s.num_chunks()) + " exceeds the model's " +
                             str(model.layers) + " layers");
  }
  if (!s.stage_layers.empty()) {
    if (static_cast<int>(s.stage_layers.size()) != s.num_chunks()) {
      return problem("stages", "has " + str(static_cast<int>(s.stage_layers.size())) +
                                   " entries but pp*virtual_stages = " + str(s.num_chunks()));
    }
    int sum = 0;
    for (int n : s.stage_layers) {
      if (n < 1) return problem("stages", "every stage needs at least one layer");
      sum += n;
    }
    if (sum != model.layers) {
      return problem("stages",
                     "covers " + str(sum) + " layers but the model has " + str(model.layers));
    }
  }
  return std::nullopt;
}

// The global batch over replicas and microbatches (uniform or elastic shares).
std::optional<StrategyProblem> batch_problem(const Strategy& s) {
  if (s.dp_shares.empty()) {
    if (s.global_batch % (s.microbatch_size * s.dp) != 0) {
      return problem("global_batch", "global_batch = " + str(s.global_batch) +
                                         " is not divisible by microbatch_size*dp = " +
                                         str(s.microbatch_size * s.dp));
    }
  } else {
    if (static_cast<int>(s.dp_shares.size()) != s.dp) {
      return problem("dp_shares", "has " + str(static_cast<int>(s.dp_shares.size())) +
                                      " entries but dp = " + str(s.dp));
    }
    long sum = 0;
    for (int share : s.dp_shares) {
      if (share <= 0 || share % s.microbatch_size != 0) {
        return problem("dp_shares", "share " + str(share) +
                                        " is not a positive multiple of microbatch_size = " +
                                        str(s.microbatch_size));
      }
      sum += share;
    }
    if (sum != s.global_batch) {
      return problem("dp_shares", "shares sum to " + std::to_string(sum) +
                                      " but global_batch = " + str(s.global_batch));
    }
  }
  if (s.schedule == Schedule::kInterleaved) {
    for (int share : s.shares()) {
      if ((share / s.microbatch_size) % s.pp != 0) {
        return problem("schedule",
                       "the interleaved schedule needs each replica's microbatch "
                       "count (" +
                           str(share / s.microbatch_size) +
                           ") to be a multiple of pp = " + str(s.pp));
      }
    }
  }
  return std::nullopt;
}

// Gradient compression settings and their layer ranges.
std::optional<StrategyProblem> compression_problem(const Strategy& s, const ModelSpec& model) {
  auto check_compression = [&](const Compression& c) -> std::optional<StrategyProblem> {
    if (c.kind == Compression::Kind::kTopK && !(c.topk_ratio > 0 && c.topk_ratio < 1)) {
      return problem("compression", "topk ratio must be in (0, 1)");
    }
    if (c.kind == Compression::Kind::kPowerSGD && c.powersgd_rank < 1) {
      return problem("compression", "powersgd rank must be >= 1");
    }
    return std::nullopt;
  };
  if (auto p = check_compression(s.compression)) return p;
  for (const auto& o : s.compression_overrides) {
    if (o.first_layer < 0 || o.last_layer >= model.layers || o.first_layer > o.last_layer) {
      return problem("compression", "layer range [" + str(o.first_layer) + ", " +
                                        str(o.last_layer) + "] is not inside [0, " +
                                        str(model.layers - 1) + "]");
    }
    if (auto p = check_compression(o.compression)) return p;
  }
  return std::nullopt;
}

}  // namespace

std::optional<StrategyProblem> find_problem(const Strategy& s, const ModelSpec& model,
                                            const ClusterSpec& cluster) {
  if (auto p = degree_problem(s, model, cluster)) return p;
  if (auto p = placement_problem(s, cluster)) return p;
  if (auto p = schedule_problem(s, model)) return p;
  if (auto p = batch_problem(s)) return p;
  return compression_problem(s, model);
}

const char* to_string(Schedule schedule) {
  switch (schedule) {
    case Schedule::kGPipe:
      return "gpipe";
    case Schedule::k1F1B:
      return "1f1b";
    case Schedule::kInterleaved:
      return "interleaved";
  }
  return "?";
}

const char* to_string(Recompute recompute) {
  switch (recompute) {
    case Recompute::kNone:
      return "none";
    case Recompute::kSelective:
      return "selective";
    case Recompute::kFull:
      return "full";
  }
  return "?";
}

const char* to_string(Attention attention) {
  return attention == Attention::kFlash ? "flash" : "unfused";
}

const char* to_string(PlacementOrder order) {
  return order == PlacementOrder::kTpPpDp ? "tp-pp-dp" : "tp-dp-pp";
}

std::string to_string(const Compression& c) {
  switch (c.kind) {
    case Compression::Kind::kNone:
      return "none";
    case Compression::Kind::kFP16:
      return "fp16";
    case Compression::Kind::kTopK: {
      char buf[64];
      std::snprintf(buf, sizeof buf, "topk:%g", c.topk_ratio);
      return buf;
    }
    case Compression::Kind::kPowerSGD:
      return "powersgd:" + std::to_string(c.powersgd_rank);
  }
  return "?";
}

std::optional<Compression> parse_compression(const std::string& text) {
  Compression c;
  if (text == "none") return c;
  if (text == "fp16") {
    c.kind = Compression::Kind::kFP16;
    return c;
  }
  auto colon = text.find(':');
  if (colon == std::string::npos) return std::nullopt;
  const std::string method = text.substr(0, colon);
  const std::string arg = text.substr(colon + 1);
  if (arg.empty()) return std::nullopt;
  if (method == "topk") {
    double ratio = 0;
    auto [ptr, ec] = std::from_chars(arg.data(), arg.data() + arg.size(), ratio);
    if (ec != std::errc() || ptr != arg.data() + arg.size()) return std::nullopt;
    c.kind = Compression::Kind::kTopK;
    c.topk_ratio = ratio;
    return c;
  }
  if (method == "powersgd") {
    int rank = 0;
    auto [ptr, ec] = std::from_chars(arg.data(), arg.data() + arg.size(), rank);
    if (ec != std::errc() || ptr != arg.data() + arg.size()) return std::nullopt;
    c.kind = Compression::Kind::kPowerSGD;
    c.powersgd_rank = rank;
    return c;
  }
  return std::nullopt;
}

}  // namespace parapilot
