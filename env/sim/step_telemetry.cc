#include "env/sim/step_telemetry.h"

#include <algorithm>
#include <cmath>

namespace parapilot::env {

StepTelemetry::StepTelemetry(const CostModel& cost, const Strategy& layout) {
  const ClusterTopology& topo = cost.topology();
  const int gpus = topo.num_gpus();
  const int pp = std::max(1, layout.pp);
  const int tp = std::max(1, layout.tp);
  const PipelineTimings nominal = cost.pipeline_timings(layout, Conditions{});
  const std::vector<int> shares = layout.shares();
  // Bytes of gradients one GPU reduces: bf16, its tensor- and pipeline-parallel shard.
  const double grad_bytes = static_cast<double>(cost.model().total_params()) * 2.0 / (tp * pp);
  gpu_samples_.assign(gpus, 0.0);
  ranks_.reserve(static_cast<size_t>(std::max(0, layout.dp) * pp * tp));
  for (int d = 0; d < layout.dp; ++d) {
    const double share = d < static_cast<int>(shares.size()) ? shares[d] : 0.0;
    const double microbatches = share / std::max(1, layout.microbatch_size);
    for (int p = 0; p < pp; ++p) {
      // The stage's chunks were timed on the slowest replica's GPUs: scale by peak throughput.
      const int timed_gpu = layout.gpu_of_rank(nominal.replica, p, 0);
      const double timed_peak = topo.types[topo.type_of_gpu[timed_gpu]].peak_tflops;
      double per_microbatch_s = 0;
      for (int k = 0; k < std::max(1, layout.virtual_stages); ++k) {
        const size_t chunk = static_cast<size_t>(k * pp + p);
        if (chunk < nominal.forward_s.size()) {
          per_microbatch_s += nominal.forward_s[chunk] + nominal.backward_s[chunk];
        }
      }
      // Does this stage's data-parallel group cross nodes?
      bool spans = false;
      const int node0 = topo.node_of_gpu[layout.gpu_of_rank(0, p, 0)];
      for (int e = 1; e < layout.dp && !spans; ++e) {
        spans = topo.node_of_gpu[layout.gpu_of_rank(e, p, 0)] != node0;
      }
      for (int i = 0; i < tp; ++i) {
        const int g = layout.gpu_of_rank(d, p, i);
        if (g < 0 || g >= gpus) continue;
        Rank r;
        r.gpu = g;
        r.node = topo.node_of_gpu[g];
        const double scale = timed_peak / topo.types[topo.type_of_gpu[g]].peak_tflops;
        r.fixed_ms = 1e3 * nominal.optimizer_s * scale;
        r.compute_ms = 1e3 * microbatches * per_microbatch_s * scale + r.fixed_ms;
        r.samples = share;
        r.inter_bytes = spans ? grad_bytes : 0.0;
        r.inter_GBps = topo.nodes[r.node].inter_GBps;
        ranks_.push_back(r);
        gpu_samples_[g] = share / (tp * pp);
      }
    }
  }
}

double StepTelemetry::generate(const Conditions& truth, uint64_t step, uint64_t start_ns,
                               double noise, std::mt19937_64& rng,
                               std::vector<monitor::StepSample>& out,
                               const std::vector<uint8_t>* alive,
                               std::optional<double> missing_prob) const {
  // The noisy times of each reporting rank first (all of the step's noise draws come before
  // its missing-sample draws); the samples are built once the step's end is known, only for
  // those kept, so that none is written twice or moved.
  struct Measured {
    const Rank* rank;
    double compute_ms;
    double fixed_ms;
    double transfer_ms;  // the transfer alone, without the wait for the last arrival
  };
  // Per-thread scratch (generate() runs once per simulated step): no allocation per call.
  thread_local std::vector<Measured> measured;
  measured.clear();
  NormalDraws jitter(noise);
  double last_arrival = 0, longest_transfer = 0;
  for (const Rank& r : ranks_) {
    if (truth.failed(r.gpu) || (alive && !(*alive)[r.gpu])) continue;
    const double speed = std::max(truth.speed(r.gpu), 1e-6);
    Measured& m = measured.emplace_back();
    m.rank = &r;
    m.compute_ms = r.compute_ms / speed * std::exp(jitter(rng));
    m.fixed_ms = std::min(m.compute_ms, r.fixed_ms / speed);
    double t = 0;
    if (r.inter_bytes > 0) {
      const double GBps = std::max(r.inter_GBps * truth.inter(r.node), 1e-9);
      t = r.inter_bytes / GBps / 1e6 * std::exp(jitter(rng));
    }
    m.transfer_ms = t;
    last_arrival = std::max(last_arrival, m.compute_ms);
    longest_transfer = std::max(longest_transfer, t);
  }
  const double step_ms = last_arrival + longest_transfer;
  const uint64_t end_ns = start_ns + static_cast<uint64_t>(step_ms * 1e6);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (const Measured& m : measured) {
    if (missing_prob && !(uniform(rng) >= *missing_prob)) continue;
    const Rank& r = *m.rank;
    // The collective's time, where the rank's group crosses nodes: the wait for the last
    // arrival, then the transfer.
    const double collective_ms =
        r.inter_bytes > 0 ? std::min(last_arrival - m.compute_ms + m.transfer_ms, step_ms) : 0.0;
    // Each field written once (emplace_back() would write every default first); those not
    // named keep their defaults (no wait reported, an empty queue).
    out.push_back({.rank = r.gpu,
                   .step = step,
                   .start_ns = start_ns,
                   .end_ns = end_ns,
                   .compute_ms = m.compute_ms,
                   .samples = r.samples,
                   .fixed_ms = m.fixed_ms,
                   .inter_bytes = r.inter_bytes,
                   .inter_ms = r.inter_bytes > 0 ? collective_ms : m.transfer_ms,
                   .longest_collective_ms = collective_ms,
                   .layers = {},
                   .stage = {}});
  }
  return step_ms;
}

}  // namespace parapilot::env
