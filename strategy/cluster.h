// ClusterSpec: nodes of GPUs (mixed generations are first-class), their links, and the GPU
// catalogue with the physical constants the cost model uses.
//
// ClusterSpec is an immutable value once built; ClusterTopology (below) is its flattened,
// per-GPU view that the cost model and planner index in O(1). Both are safe to share
// read-only between threads.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace parapilot {

// One GPU model. Sources: vendor datasheets (dense bf16/fp16 tensor TFLOP/s, memory, HBM and
// NVLink bandwidth); see docs/specs.md for the table and the efficiency constants.
struct GpuType {
  std::string name;
  double peak_tflops = 0;        // dense bf16/fp16 tensor-core peak
  double memory_gib = 0;         // device memory
  double hbm_GBps = 0;           // HBM bandwidth
  double nvlink_GBps_bidir = 0;  // NVLink bandwidth per GPU, both directions together
  double nic_Gbps = 0;           // usual network bandwidth per GPU in a node of this type
  double gemm_efficiency = 0;    // fraction of peak reached by large, well-shaped GEMMs
  // Fraction of peak the fused (flash) attention kernel sustains, forward and backward.
  double attention_efficiency = 0;
  double fp8_tflops = 0;  // dense FP8 tensor-core peak; 0 = the GPU has no FP8 tensor cores
  // Fraction of the usual NIC's line rate that large collectives reach between nodes of
  // this type (the default of ClusterSpec::inter_node_efficiency).
  double network_efficiency = 0.70;
};

// Catalogue lookup: v100, a100-40g, a100-80g, h800, h100, h200.
std::optional<GpuType> gpu_type(const std::string& name);
std::vector<std::string> gpu_type_names();

struct NodeGroup {
  int count = 0;          // nodes in this group
  int gpus_per_node = 0;  // GPUs per node
  GpuType gpu;
  double intra_node_GBps = 0;  // per GPU, one direction (default: NVLink bidirectional / 2)
  double inter_node_Gbps = 0;  // per GPU (default: the GPU type's usual NIC)
};

struct ClusterSpec {
  std::string name;
  std::vector<NodeGroup> groups;
  double intra_node_latency_us = 3.0;  // per collective step over NVLink/NVSwitch
  double inter_node_latency_us = 8.0;  // per collective step or p2p message over the network
  // Fraction of the nominal link rate collectives reach for large messages (busbw / link).
  double intra_node_efficiency = 0.80;
  // 0 = the lowest network_efficiency of the node groups' GPU types (their usual NICs).
  double inter_node_efficiency = 0;

  int num_gpus() const;
  int num_nodes() const;
};

// Presets are composed by name: "NxGxTYPE" is N nodes of G GPUs of TYPE (e.g. "4x8xa100-80g"),
// "GxTYPE" one node, and groups joined with '+' form a mixed cluster
// ("1x8xa100-80g+1x8xh800"). Returns nullopt when the text is not of that form.
std::optional<ClusterSpec> cluster_preset(const std::string& name);

// Flattened per-GPU view of a ClusterSpec. GPU ids run node by node, group by group.
struct ClusterTopology {
  struct Node {
    int first_gpu = 0;
    int gpus = 0;
    int type = 0;  // index into types
    double intra_GBps = 0;
    double inter_GBps = 0;  // per GPU, in GB/s
  };
  std::vector<GpuType> types;  // distinct GPU types present
  std::vector<Node> nodes;
  std::vector<int> node_of_gpu;
  std::vector<int> type_of_gpu;
  double intra_latency_s = 0;
  double inter_latency_s = 0;
  double intra_efficiency = 0;
  double inter_efficiency = 0;

  explicit ClusterTopology(const ClusterSpec& spec);
  int num_gpus() const { return static_cast<int>(node_of_gpu.size()); }
  int num_nodes() const { return static_cast<int>(nodes.size()); }
};

}  // namespace parapilot
