// Job: the description of a training job that the deploy agent watches and that the simulated
// and live clusters run — the model, the cluster, the planner's search space (all from a
// simulator scenario: a family name or a scenario TOML, the same file the job was launched
// with), the global batch, the start layouts, and the mapping between planner layouts
// (Strategy) and the bus's wire Layout. It lives below both the agent and the envs that play
// a job's ranks, so that they share one description.
//
// A Job is immutable after make_job() and safe to share between threads (Planner::plan is const
// and thread-safe).
#pragma once

#include <memory>
#include <string>

#include "core/status.h"
#include "env/sim/scenario.h"
#include "strategy/planner.h"
#include "transport/messages.h"

namespace parapilot {

struct Job {
  env::Scenario scenario;
  int global_batch = 0;
  std::unique_ptr<Planner> planner;
  Strategy planned_initial;  ///< the best plan for the nominal cluster ("planned").
  Strategy uniform_dp;       ///< pure data parallel with equal shares ("uniform-dp").

  int gpus() const { return scenario.cluster.num_gpus(); }
  int nodes() const { return scenario.cluster.num_nodes(); }
  /// The layout the job starts on: "planned", "uniform-dp", or a layout in the strategy
  /// language's inline form ("dp=2,pp=2,stages=[1,3]", docs/specs.md), which runs the job's
  /// global batch. kInvalidArgument quoting the text (the caller names the option) when it is
  /// none of these or not legal for this model and cluster.
  StatusOr<Strategy> start_layout(const std::string& name) const;
};

/// Builds the job of `scenario` (a family name such as "straggler", or a scenario .toml path) on
/// `gpus` GPUs (ignored for a TOML file, which names its own size): kInvalidArgument for an
/// unknown family or a bad scenario file.
StatusOr<std::shared_ptr<const Job>> make_job(const std::string& scenario, int gpus);
/// The same from a scenario already built.
std::shared_ptr<const Job> make_job(env::Scenario scenario);

/// The wire form of a layout: degrees and micro-batches per replica.
transport::Layout to_wire(const Strategy& s);
/// A short name of a layout for logs: "dp8-tp2-pp1-mb1-sp-z1[-v2][-elastic]".
std::string layout_name(const Strategy& s);
/// The text carried in PlanPrepare::layout_name: the short name plus what the wire Layout lacks —
/// the schedule (";sc=gpipe|1f1b|interleaved"), recompute (";rc=none|selective|full"), stage
/// boundaries (";st=16,16") and elastic data-parallel shares, run-length coded (";sh=33*7,29").
/// nullopt when it does not fit in kMaxNameBytes (the layout cannot be sent on the wire). Both
/// names are written by transport/plan_name.h's codec.
std::optional<std::string> wire_name(const Strategy& s);
/// The PlanPrepare that switches a job to `s`: its wire Layout and, in layout_name, its
/// wire_name (or, when that does not fit, its short name). plan_id and deadline_ms are the
/// executor's to set (transport/plan_executor.h).
transport::PlanPrepare plan_prepare_for(const Strategy& s);
/// plan_prepare_for(s) for a job that keeps its own schedule and recompute: the name leaves
/// them out (no ";sc=", no ";rc="). A learned pipeline job's plans (agent/deploy/agent.h): its
/// JobInfo does not say its schedule, no plan changes it, and the job refuses a plan that names
/// another (docs/pytorch.md, "Pipeline jobs").
transport::PlanPrepare plan_prepare_keeping_schedule(const Strategy& s);
/// Why a job that announced `capabilities` (transport::Capability bits) cannot make the switch
/// from `from` to `to`: a degree or knob it cannot switch (a tensor- or pipeline-parallel degree
/// changed in either direction, stage boundaries moved), or a switch that changes only
/// settings it ignores (ZeRO stage, recompute, schedule; micro-batches without kCapMicroBatches;
/// compression without kCapCompression). OK when it can, else kRejected saying why.
Status unsupported_switch(const Strategy& from, const Strategy& to, uint32_t capabilities);

/// A layout rebuilt from its wire form: the degrees, then what wire_name() encodes; missing parts
/// take the job's defaults (search-space first choices, equal shares, balanced stages); a name
/// without fields (a label, layout_name()'s log form) carries nothing. kInvalidArgument, saying
/// why, when the degrees or the name are malformed, the name is a live action, or the result is
/// not legal for the job (find_problem's reason).
StatusOr<Strategy> from_wire(const transport::Layout& layout, const Job& job,
                             const std::string& name = "");

}  // namespace parapilot
