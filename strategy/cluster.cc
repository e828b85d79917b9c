#include "strategy/cluster.h"

#include <algorithm>
#include <charconv>

namespace parapilot {

namespace {

// Datasheet figures (NVIDIA V100, A100, H100/H800, H200 datasheets). gemm_efficiency is the
// fraction of peak that large cuBLAS half-precision GEMMs sustain: ~80% on V100 and A100
// (about 250 of 312 TFLOP/s), ~72% on Hopper (about 700 of 989 TFLOP/s), from public GEMM
// benchmarks. NICs: EDR 100 Gb/s with V100 (DGX-1), HDR 200 Gb/s with A100 (DGX A100),
// NDR 400 Gb/s with Hopper (DGX H100).
// Network: HDR (and EDR) fabrics at 0.70 of line rate, between the nccl-tests all-reduce
// figures of 16 HDR A100 nodes (~0.58) and the SC'21 rows; NDR at 0.85, the nccl-tests
// all-reduce of 2 nodes of 8 H100 (~339 GB/s busbw = 8 NICs x 50 GB/s x 0.85).
constexpr double kHdrEfficiency = 0.70;
constexpr double kNdrEfficiency = 0.85;
constexpr double kHopperGemm = 0.65;
constexpr double kHopperAttention = 0.35;

const std::vector<GpuType>& catalogue() {
  static const std::vector<GpuType> types = {
      {"v100", 125, 32, 900, 300, 100, 0.80, 0.40, 0, kHdrEfficiency},
      {"a100-40g", 312, 40, 1555, 600, 200, 0.72, 0.55, 0, kHdrEfficiency},
      {"a100-80g", 312, 80, 2039, 600, 200, 0.72, 0.55, 0, kHdrEfficiency},
      {"h800", 989, 80, 3350, 400, 400, kHopperGemm, kHopperAttention, 1979, kNdrEfficiency},
      {"h100", 989, 80, 3350, 900, 400, kHopperGemm, kHopperAttention, 1979, kNdrEfficiency},
      {"h200", 989, 141, 4800, 900, 400, kHopperGemm, kHopperAttention, 1979, kNdrEfficiency},
  };
  return types;
}

std::optional<int> parse_positive(std::string_view text) {
  int value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size() || value <= 0) return std::nullopt;
  return value;
}

std::optional<NodeGroup> parse_group(std::string_view text) {
  // NxGxTYPE or GxTYPE. The type name itself may not contain 'x' followed by digits only.
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (parts.size() < 2) {
    size_t x = text.find('x', start);
    if (x == std::string_view::npos) break;
    auto piece = text.substr(start, x - start);
    if (!parse_positive(piece)) break;
    parts.push_back(piece);
    start = x + 1;
  }
  if (parts.empty()) return std::nullopt;
  auto type = gpu_type(std::string(text.substr(start)));
  if (!type) return std::nullopt;
  NodeGroup g;
  g.count = parts.size() == 2 ? *parse_positive(parts[0]) : 1;
  g.gpus_per_node = *parse_positive(parts.back());
  g.gpu = *type;
  g.intra_node_GBps = type->nvlink_GBps_bidir / 2;
  g.inter_node_Gbps = type->nic_Gbps;
  return g;
}

}  // namespace

std::optional<GpuType> gpu_type(const std::string& name) {
  for (const auto& t : catalogue()) {
    if (t.name == name) return t;
  }
  return std::nullopt;
}

std::vector<std::string> gpu_type_names() {
  std::vector<std::string> names;
  for (const auto& t : catalogue()) names.push_back(t.name);
  return names;
}

int ClusterSpec::num_gpus() const {
  int n = 0;
  for (const auto& g : groups) n += g.count * g.gpus_per_node;
  return n;
}

int ClusterSpec::num_nodes() const {
  int n = 0;
  for (const auto& g : groups) n += g.count;
  return n;
}

std::optional<ClusterSpec> cluster_preset(const std::string& name) {
  ClusterSpec spec;
  spec.name = name;
  std::string_view rest = name;
  while (!rest.empty()) {
    size_t plus = rest.find('+');
    auto group = parse_group(rest.substr(0, plus));
    if (!group) return std::nullopt;
    spec.groups.push_back(*group);
    if (plus == std::string_view::npos) break;
    rest = rest.substr(plus + 1);
    if (rest.empty()) return std::nullopt;
  }
  if (spec.groups.empty()) return std::nullopt;
  return spec;
}

ClusterTopology::ClusterTopology(const ClusterSpec& spec)
    : intra_latency_s(spec.intra_node_latency_us * 1e-6),
      inter_latency_s(spec.inter_node_latency_us * 1e-6),
      intra_efficiency(spec.intra_node_efficiency),
      inter_efficiency(spec.inter_node_efficiency) {
  if (inter_efficiency <= 0) {
    inter_efficiency = 1.0;
    for (const NodeGroup& g : spec.groups)
      inter_efficiency = std::min(inter_efficiency, g.gpu.network_efficiency);
  }
  for (const auto& group : spec.groups) {
    int type = -1;
    for (size_t i = 0; i < types.size(); ++i) {
      if (types[i].name == group.gpu.name) type = static_cast<int>(i);
    }
    if (type < 0) {
      types.push_back(group.gpu);
      type = static_cast<int>(types.size()) - 1;
    }
    for (int n = 0; n < group.count; ++n) {
      Node node;
      node.first_gpu = static_cast<int>(node_of_gpu.size());
      node.gpus = group.gpus_per_node;
      node.type = type;
      node.intra_GBps = group.intra_node_GBps;
      node.inter_GBps = group.inter_node_Gbps / 8.0;
      for (int g = 0; g < group.gpus_per_node; ++g) {
        node_of_gpu.push_back(static_cast<int>(nodes.size()));
        type_of_gpu.push_back(type);
      }
      nodes.push_back(node);
    }
  }
}

}  // namespace parapilot
