#include "agent/runtime/job.h"

#include <algorithm>
#include <sstream>

#include "strategy/error.h"

namespace parapilot::agent::runtime {

const Strategy& Job::initial(const std::string& name) const {
  if (name == "planned") return planned_initial;
  if (name == "uniform-dp") return uniform_dp;
  throw InputError("unknown initial layout \"" + name + "\" (planned | uniform-dp)");
}

std::shared_ptr<const Job> make_job(const std::string& scenario, int gpus) {
  if (scenario.size() > 5 && scenario.substr(scenario.size() - 5) == ".toml") {
    return make_job(env::load_scenario(scenario));
  }
  return make_job(env::builtin_scenario(env::parse_family(scenario), gpus));
}

std::shared_ptr<const Job> make_job(env::Scenario scenario) {
  auto job = std::make_shared<Job>();
  job->scenario = std::move(scenario);
  env::Scenario& s = job->scenario;
  job->global_batch =
      s.global_batch > 0 ? s.global_batch : default_global_batch(s.cluster.num_gpus());
  s.space.global_batch = job->global_batch;
  job->planner = std::make_unique<Planner>(s.model, s.cluster);
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
  return l;
}

std::string layout_name(const Strategy& s) {
  std::ostringstream out;
  out << "dp" << s.dp << "-tp" << s.tp << "-pp" << s.pp << "-mb" << s.microbatch_size;
  if (s.sp) out << "-sp";
  if (s.virtual_stages > 1) out << "-v" << s.virtual_stages;
  out << "-z" << s.zero;
  if (!s.dp_shares.empty()) out << "-elastic";
  std::string name = out.str();
  if (name.size() > transport::kMaxNameBytes) name.resize(transport::kMaxNameBytes);
  return name;
}

std::optional<Strategy> from_wire(const transport::Layout& l, const Job& job) {
  const SearchSpace& space = job.scenario.space;
  Strategy s;
  s.dp = static_cast<int>(l.dp);
  s.tp = static_cast<int>(l.tp);
  s.pp = static_cast<int>(l.pp);
  s.global_batch = job.global_batch;
  if (l.dp == 0 || l.micro_batches == 0) return std::nullopt;
  s.microbatch_size = std::max(1, job.global_batch / static_cast<int>(l.dp * l.micro_batches));
  s.sp = space.sp.empty() ? false : space.sp.front() && s.tp > 1;
  s.recompute = space.recompute.empty() ? Recompute::kSelective : space.recompute.front();
  s.zero = space.zero.empty() ? 1 : space.zero.front();
  s.schedule = space.schedule.empty() ? Schedule::k1F1B : space.schedule.front();
  if (find_problem(s, job.scenario.model, job.scenario.cluster)) {
    s.sp = !s.sp;
    if (find_problem(s, job.scenario.model, job.scenario.cluster)) return std::nullopt;
  }
  return s;
}

}  // namespace parapilot::agent::runtime
