// Pipeline schedules (GPipe, 1F1B, interleaved 1F1B) played out on a timeline, and the
// Chrome trace event export of one simulated iteration (opens in Perfetto / chrome://tracing).
//
// Pure functions of their inputs; thread-safe. They allocate and are meant for reporting and
// tests, not for the planner's inner loop (the cost model has the closed form).
#pragma once

#include <ostream>
#include <vector>

#include "strategy/cost_model.h"

namespace parapilot {

struct ScheduledOp {
  int rank = 0;   // pipeline rank
  int chunk = 0;  // global chunk index (virtual stage k of rank p is k * pp + p)
  int microbatch = 0;
  bool forward = true;
  double start_s = 0;
  double end_s = 0;
};

// The order in which pipeline rank `rank` runs its forward and backward passes:
// (chunk, microbatch, forward) triples, per the strategy's schedule.
struct PassRef {
  int chunk;
  int microbatch;
  bool forward;
};
std::vector<PassRef> schedule_order(const Strategy& s, int rank, int microbatches);

// Plays the schedule out: every pass starts when its rank is free and its input has arrived
// (the previous chunk's forward plus the p2p transfer, or the next chunk's backward plus the
// transfer back). Returns all passes with their times.
std::vector<ScheduledOp> simulate_schedule(const Strategy& s, const PipelineTimings& timings);

// Writes one iteration as Chrome trace event JSON: one process per pipeline stage with a
// compute thread (forward/backward per microbatch) and a communication thread (p2p sends,
// exposed data-parallel reduction), then the optimizer step. Returns the simulated
// iteration time in seconds.
double write_chrome_trace(const CostModel& cost, const Strategy& s, const Conditions& c,
                          std::ostream& out);

}  // namespace parapilot
