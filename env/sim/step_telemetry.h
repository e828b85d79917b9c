// What each rank of a synchronous hybrid-parallel job measures in one training step under the
// true conditions: the telemetry the simulator env feeds its monitor and the simulated cluster
// sends over the bus, so both (and through them training and deployment) see the same signal.
//
// Per GPU of the layout (rank r = GPU r):
// - compute-only time: its replica's microbatches times its pipeline stage's forward + backward
//   of one microbatch at nominal speed (the cost model's pipeline timings, scaled by the GPU
//   type's peak against the type they were timed on), plus the optimizer step, divided by the
//   GPU's true speed, times lognormal noise;
// - samples processed (its replica's share) and the optimizer step as the part that does not
//   scale with samples;
// - where its data-parallel group spans nodes, the gradient reduction's bytes and time: the
//   wait for the last rank to arrive at the collective (the synchronous all-reduce trap) plus
//   the transfer at its node's true inter-node bandwidth, times noise.
// Ranks start the step together; it ends when the last arrival's slowest transfer is done.
//
// Immutable after construction; generate() is const and thread-compatible (the caller's rng).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <vector>

#include "env/monitor/monitor.h"
#include "strategy/cost_model.h"

namespace parapilot::env {

/// std::normal_distribution<double>(0, sigma) drawn from a std::mt19937_64 as libstdc++ draws
/// it, value for value and engine call for engine call (Marsaglia's polar method: uniform pairs
/// in the unit disc, the second value of each pair kept for the next draw), written out so that
/// it inlines into the per-sample loop. The telemetry's noise must stay the same sequence; the
/// env tests compare it with std::normal_distribution over many draws.
class NormalDraws {
 public:
  explicit NormalDraws(double sigma) : sigma_(sigma) {}
  double operator()(std::mt19937_64& rng) {
    double z;
    if (saved_available_) {
      saved_available_ = false;
      z = saved_;
    } else {
      double x, y, r2;
      do {
        x = 2.0 * canonical(rng) - 1.0;
        y = 2.0 * canonical(rng) - 1.0;
        r2 = x * x + y * y;
      } while (r2 > 1.0 || r2 == 0.0);
      const double mult = std::sqrt(-2 * std::log(r2) / r2);
      saved_ = x * mult;
      saved_available_ = true;
      z = y * mult;
    }
    return z * sigma_ + 0.0;  // stddev, then the mean (0), as the distribution evaluates it
  }

 private:
  static double canonical(std::mt19937_64& rng) {
    return std::generate_canonical<double, std::numeric_limits<double>::digits>(rng);
  }
  double sigma_;
  double saved_ = 0;
  bool saved_available_ = false;
};

class StepTelemetry {
 public:
  /// For `layout` (legal for the cost model's model and cluster).
  StepTelemetry(const CostModel& cost, const Strategy& layout);

  /// One step's samples, one per GPU the layout uses, skipping GPUs that truly failed and those
  /// `alive` marks 0 (when given, one entry per GPU), appended to `out`. `noise` is the
  /// lognormal sigma of each reported time. With `missing_prob`, each of those samples then
  /// goes missing with that chance: after the step's noise, one std::uniform_real_distribution
  /// (0, 1) draw per sample in rank order, the sample kept when the draw is >= missing_prob
  /// (the step's wall time still counts the missing ones). Returns the step's wall time in ms.
  double generate(const Conditions& truth, uint64_t step, uint64_t start_ns, double noise,
                  std::mt19937_64& rng, std::vector<monitor::StepSample>& out,
                  const std::vector<uint8_t>* alive = nullptr,
                  std::optional<double> missing_prob = std::nullopt) const;

  /// Samples each GPU processes per step: its replica's share over the replica's GPUs (0 for
  /// GPUs the layout does not use), so that summing over GPUs counts each sample once.
  const std::vector<double>& gpu_samples() const { return gpu_samples_; }

 private:
  struct Rank {
    int gpu = 0;
    int node = 0;
    double compute_ms = 0;  // nominal, optimizer included
    double fixed_ms = 0;    // nominal optimizer step
    double samples = 0;     // its replica's share
    double inter_bytes = 0;  // gradient bytes crossing nodes; 0 when its group is on one node
    double inter_GBps = 0;   // its node's nominal inter-node bandwidth per GPU
  };
  std::vector<Rank> ranks_;
  std::vector<double> gpu_samples_;
};

}  // namespace parapilot::env
