#include "env/job.h"

#include <algorithm>
#include <cassert>

#include "core/error.h"
#include "transport/plan_name.h"
#include "strategy/spec_io.h"

namespace parapilot {

StatusOr<Strategy> Job::start_layout(const std::string& name) const {
  if (name == "planned") return planned_initial;
  if (name == "uniform-dp") return uniform_dp;
  if (name.find('=') == std::string::npos) {
    return Status::invalid_argument("\"" + name +
                                    "\": expected planned, uniform-dp or a layout such as "
                                    "dp=2,pp=2,stages=[1,3]");
  }
  // The job runs its own global batch, whatever the text says.
  const std::string text = name.find("global_batch") == std::string::npos
                               ? name + ",global_batch=" + std::to_string(global_batch)
                               : name;
  StatusOr<Strategy> read = load_strategy(text, scenario.model, scenario.cluster);
  if (!read.ok())
    return Status::invalid_argument("\"" + name + "\": " + read.status().message());
  Strategy s = std::move(read).value();
  s.global_batch = global_batch;
  if (auto problem = find_problem(s, scenario.model, scenario.cluster))
    return Status::invalid_argument("\"" + name + "\": " + problem->key + ": " +
                                    problem->reason);
  return s;
}

StatusOr<std::shared_ptr<const Job>> make_job(const std::string& scenario, int gpus) {
  if (scenario.size() > 5 && scenario.substr(scenario.size() - 5) == ".toml") {
    StatusOr<env::Scenario> read = env::load_scenario(scenario);
    if (!read.ok()) return read.status();
    return make_job(std::move(read).value());
  }
  const StatusOr<env::Family> family = env::parse_family(scenario);
  if (!family.ok()) return family.status();
  return make_job(env::builtin_scenario(*family, gpus));
}

std::shared_ptr<const Job> make_job(env::Scenario scenario) {
  auto job = std::make_shared<Job>();
  job->scenario = std::move(scenario);
  env::Scenario& s = job->scenario;
  job->global_batch =
      s.global_batch > 0 ? s.global_batch : default_global_batch(s.cluster.num_gpus());
  s.space.global_batch = job->global_batch;
  job->planner =
      std::make_unique<Planner>(s.model, s.cluster, PlannerOptions{s.switch_pause_s});
  PlanRequest request;
  request.space = s.space;
  request.top_k = 1;
  const PlanResult nominal = job->planner->plan(request);
  if (nominal.candidates.empty()) {
    throw InputError("scenario " + s.name + ": no layout fits this model on this cluster");
  }
  job->planned_initial = nominal.candidates.front().strategy;
  Strategy dp;
  dp.dp = s.cluster.num_gpus();
  dp.global_batch = job->global_batch;
  dp.zero = 1;
  dp.microbatch_size = 1;
  dp.recompute = s.space.recompute.empty() ? Recompute::kSelective : s.space.recompute.front();
  if (!find_problem(dp, s.model, s.cluster))
    job->uniform_dp = dp;
  else
    job->uniform_dp = job->planned_initial;
  return job;
}

transport::Layout to_wire(const Strategy& s) {
  transport::Layout l;
  l.dp = static_cast<uint32_t>(s.dp);
  l.tp = static_cast<uint32_t>(s.tp);
  l.pp = static_cast<uint32_t>(s.pp);
  const int per_replica = s.global_batch / std::max(1, s.dp * s.microbatch_size);
  l.micro_batches = static_cast<uint32_t>(std::clamp(per_replica, 1, 65536));
  // Elastic shares travel in the structured field; the layout name repeats them (";sh=") for
  // peers that read only the name.
  l.dp_shares.assign(s.dp_shares.begin(), s.dp_shares.end());
  // Compression: the default for every layer (the ranks clip the range to their layers), then
  // the overrides, later entries overriding earlier ones as on the wire.
  auto layer = [](int first, int last, const Compression& c) {
    transport::LayerCompression w;
    w.first_layer = static_cast<uint32_t>(std::max(0, first));
    w.last_layer = static_cast<uint32_t>(std::clamp(last, first, int{transport::kMaxLayers} - 1));
    switch (c.kind) {
      case Compression::Kind::kNone:
        w.method = transport::CompressionMethod::none;
        break;
      case Compression::Kind::kFP16:
        w.method = transport::CompressionMethod::fp16;
        break;
      case Compression::Kind::kTopK:
        w.method = transport::CompressionMethod::topk;
        w.parameter = static_cast<float>(c.topk_ratio);
        break;
      case Compression::Kind::kPowerSGD:
        w.method = transport::CompressionMethod::powersgd;
        w.parameter = static_cast<float>(c.powersgd_rank);
        break;
    }
    return w;
  };
  if (!(s.compression == Compression{})) {
    l.compression.push_back(layer(0, int{transport::kMaxLayers} - 1, s.compression));
  }
  for (const CompressionOverride& o : s.compression_overrides) {
    l.compression.push_back(layer(o.first_layer, o.last_layer, o.compression));
  }
  return l;
}

Status unsupported_switch(const Strategy& from, const Strategy& to, uint32_t c) {
  // A degree changes either way (into or out of tensor or pipeline parallelism); stage
  // boundaries are the pipeline's.
  if (to.tp != from.tp && !(c & transport::kCapTensor)) {
    return Status::rejected("the job cannot switch tensor parallel");
  }
  if ((to.pp != from.pp || (to.pp > 1 && to.stage_layers != from.stage_layers)) &&
      !(c & transport::kCapPipeline)) {
    return Status::rejected("the job cannot switch pipeline parallel");
  }
  if (!to.dp_shares.empty() && to.dp_shares != from.dp_shares && !(c & transport::kCapDpShares)) {
    return Status::rejected("the job cannot switch batch shares");
  }
  // What the switch changes that this job acts on.
  auto acted_on = [c](const Strategy& x) {
    Strategy k;
    k.dp = x.dp;
    k.tp = x.tp;
    k.pp = x.pp;
    k.stage_layers = x.stage_layers;
    k.dp_shares = x.dp_shares;
    // A pure data-parallel job keeps each rank on its device: a new device map means only a
    // new assignment of shares to ranks.
    const bool placed = (c & (transport::kCapTensor | transport::kCapPipeline)) != 0;
    if (placed || !x.dp_shares.empty()) k.gpus = x.gpus;
    if (c & transport::kCapMicroBatches) k.microbatch_size = x.microbatch_size;
    if (c & transport::kCapCompression) {
      k.compression = x.compression;
      k.compression_overrides = x.compression_overrides;
    }
    return k;
  };
  if (acted_on(from) == acted_on(to)) return Status::rejected("the switch changes only settings the job ignores");
  return {};
}

namespace {

// The name's head: what every layout name starts with.
transport::LayoutPlanName head_of(const Strategy& s) {
  transport::LayoutPlanName n;
  n.dp = s.dp;
  n.tp = s.tp;
  n.pp = s.pp;
  n.microbatch = s.microbatch_size;
  n.sp = s.sp;
  n.virtual_stages = s.virtual_stages;
  n.zero = s.zero;
  return n;
}

}  // namespace

std::string layout_name(const Strategy& s) {
  transport::LayoutPlanName n = head_of(s);
  n.elastic = !s.dp_shares.empty();
  StatusOr<std::string> text = transport::encode_plan_name(n);
  // A head alone is far below kMaxNameBytes.
  assert(text.ok());
  return std::move(text).value();
}

namespace {

// wire_name(), the schedule and recompute left out unless `with_schedule`.
std::optional<std::string> wire_name(const Strategy& s, bool with_schedule) {
  if (s.placement != PlacementOrder::kTpPpDp || !(s.compression == Compression{}) ||
      !s.compression_overrides.empty()) {
    return std::nullopt;  // not carried by wire v1
  }
  transport::LayoutPlanName n = head_of(s);
  if (with_schedule) {
    n.schedule = to_string(s.schedule);
    n.recompute = to_string(s.recompute);
  }
  n.stage_layers = s.stage_layers;
  n.dp_shares = s.dp_shares;
  bool identity = true;
  for (size_t i = 0; i < s.gpus.size(); ++i)
    identity = identity && s.gpus[i] == static_cast<int>(i);
  if (!identity) n.gpus = s.gpus;
  StatusOr<std::string> text = transport::encode_plan_name(n);
  if (!text.ok()) return std::nullopt;  // longer than the wire's kMaxNameBytes
  return std::move(text).value();
}

}  // namespace

std::optional<std::string> wire_name(const Strategy& s) { return wire_name(s, true); }

StatusOr<Strategy> from_wire(const transport::Layout& l, const Job& job, const std::string& name) {
  const SearchSpace& space = job.scenario.space;
  Strategy s;
  s.dp = static_cast<int>(l.dp);
  s.tp = static_cast<int>(l.tp);
  s.pp = static_cast<int>(l.pp);
  s.global_batch = job.global_batch;
  if (l.dp == 0 || l.micro_batches == 0)
    return Status::invalid_argument("layout with dp " + std::to_string(l.dp) +
                                    " and micro-batches " + std::to_string(l.micro_batches));
  s.microbatch_size = std::max(1, job.global_batch / static_cast<int>(l.dp * l.micro_batches));
  s.sp = space.sp.empty() ? false : space.sp.front() && s.tp > 1;
  s.recompute = space.recompute.empty() ? Recompute::kSelective : space.recompute.front();
  s.zero = space.zero.empty() ? 1 : space.zero.front();
  s.schedule = space.schedule.empty() ? Schedule::k1F1B : space.schedule.front();
  StatusOr<transport::PlanName> decoded = transport::decode_plan_name(name);
  if (!decoded.ok()) return decoded.status();
  if (std::holds_alternative<transport::ActionPlanName>(*decoded))
    return Status::invalid_argument("plan name \"" + name + "\" is a live action, not a layout");
  const auto* n = std::get_if<transport::LayoutPlanName>(&*decoded);
  // The parts wire_name() carries; a name without them (a label, or layout_name()'s log form)
  // leaves the job's defaults.
  if (n && (n->schedule || n->recompute || !n->stage_layers.empty() || !n->dp_shares.empty() ||
            !n->gpus.empty())) {
    if (n->dp == s.dp && n->tp == s.tp && n->pp == s.pp) {
      s.microbatch_size = n->microbatch;
      s.sp = n->sp;
      s.virtual_stages = n->virtual_stages;
      s.zero = n->zero;
    }
    for (Schedule x : {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved}) {
      if (n->schedule == to_string(x)) s.schedule = x;
    }
    for (Recompute x : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
      if (n->recompute == to_string(x)) s.recompute = x;
    }
    s.stage_layers = n->stage_layers;
    s.dp_shares = n->dp_shares;
    s.gpus = n->gpus;
    if (auto problem = find_problem(s, job.scenario.model, job.scenario.cluster))
      return Status::invalid_argument("layout not legal for this job: " + problem->reason);
    return s;
  }
  if (find_problem(s, job.scenario.model, job.scenario.cluster)) {
    s.sp = !s.sp;
    if (auto problem = find_problem(s, job.scenario.model, job.scenario.cluster))
      return Status::invalid_argument("layout not legal for this job: " + problem->reason);
  }
  return s;
}

transport::PlanPrepare plan_prepare_for(const Strategy& s) {
  transport::PlanPrepare p;
  p.layout = to_wire(s);
  p.layout_name = wire_name(s).value_or(layout_name(s));
  return p;
}

transport::PlanPrepare plan_prepare_keeping_schedule(const Strategy& s) {
  transport::PlanPrepare p;
  p.layout = to_wire(s);
  p.layout_name = wire_name(s, false).value_or(layout_name(s));
  return p;
}

}  // namespace parapilot
