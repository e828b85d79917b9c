#include "agent/runtime/job.h"

#include <algorithm>
#include <cassert>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "core/error.h"
#include "strategy/spec_io.h"

namespace parapilot::agent::runtime {

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
  // Elastic shares travel in the structured field; the layout name repeats them (";sh=") for
  // peers that read only the name.
  l.dp_shares.assign(s.dp_shares.begin(), s.dp_shares.end());
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

std::optional<std::string> wire_name(const Strategy& s) {
  std::ostringstream out;
  out << "dp" << s.dp << "-tp" << s.tp << "-pp" << s.pp << "-mb" << s.microbatch_size;
  if (s.sp) out << "-sp";
  if (s.virtual_stages > 1) out << "-v" << s.virtual_stages;
  out << "-z" << s.zero;
  out << ";sc=" << to_string(s.schedule) << ";rc=" << to_string(s.recompute);
  if (!s.stage_layers.empty()) {
    out << ";st=";
    for (size_t i = 0; i < s.stage_layers.size(); ++i) out << (i ? "," : "") << s.stage_layers[i];
  }
  if (!s.dp_shares.empty()) {
    out << ";sh=";
    for (size_t i = 0; i < s.dp_shares.size();) {
      size_t j = i;
      while (j < s.dp_shares.size() && s.dp_shares[j] == s.dp_shares[i]) ++j;
      out << (i ? "," : "") << s.dp_shares[i];
      if (j - i > 1) out << '*' << (j - i);
      i = j;
    }
  }
  bool identity = true;
  for (size_t i = 0; i < s.gpus.size(); ++i)
    identity = identity && s.gpus[i] == static_cast<int>(i);
  if (!identity) {
    // Device mapping as ranges of consecutive GPUs: "0-2,4-15,3".
    out << ";g=";
    for (size_t i = 0; i < s.gpus.size();) {
      size_t j = i + 1;
      while (j < s.gpus.size() && s.gpus[j] == s.gpus[j - 1] + 1) ++j;
      out << (i ? "," : "") << s.gpus[i];
      if (j - i > 1) out << '-' << s.gpus[j - 1];
      i = j;
    }
  }
  if (s.placement != PlacementOrder::kTpPpDp || !(s.compression == Compression{}) ||
      !s.compression_overrides.empty()) {
    return std::nullopt;  // not carried by wire v1
  }
  std::string text = out.str();
  if (text.size() > transport::kMaxNameBytes) return std::nullopt;
  return text;
}

namespace {

// Parses "a,b*3,c" into integers; false on malformed text.
bool parse_int_list(const std::string& text, bool run_length, std::vector<int>& out) {
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    int value = 0, count = 1;
    char tail = 0;
    const int n = run_length ? std::sscanf(item.c_str(), "%d*%d%c", &value, &count, &tail)
                             : std::sscanf(item.c_str(), "%d%c", &value, &tail);
    if (n < 1 || (run_length && n > 2) || (!run_length && n > 1) || count < 1 || count > 1 << 20) {
      return false;
    }
    out.insert(out.end(), static_cast<size_t>(count), value);
  }
  return !out.empty();
}

}  // namespace

std::optional<Strategy> from_wire(const transport::Layout& l, const Job& job,
                                  const std::string& name) {
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
  // The parts wire_name() carries.
  const auto semicolon = name.find(';');
  if (semicolon != std::string::npos) {
    const std::string head = name.substr(0, semicolon);
    int dp = 0, tp = 0, pp = 0, mb = 0;
    if (std::sscanf(head.c_str(), "dp%d-tp%d-pp%d-mb%d", &dp, &tp, &pp, &mb) == 4 && dp == s.dp &&
        tp == s.tp && pp == s.pp && mb >= 1) {
      s.microbatch_size = mb;
      s.sp = head.find("-sp") != std::string::npos;
      const auto v = head.find("-v");
      s.virtual_stages = v == std::string::npos ? 1 : std::atoi(head.c_str() + v + 2);
      const auto z = head.find("-z");
      if (z != std::string::npos) s.zero = std::atoi(head.c_str() + z + 2);
    }
    std::istringstream fields(name.substr(semicolon + 1));
    std::string field;
    while (std::getline(fields, field, ';')) {
      const auto eq = field.find('=');
      if (eq == std::string::npos) return std::nullopt;
      const std::string key = field.substr(0, eq), value = field.substr(eq + 1);
      if (key == "sc") {
        bool found = false;
        for (Schedule x : {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved}) {
          if (value == to_string(x)) s.schedule = x, found = true;
        }
        if (!found) return std::nullopt;
      } else if (key == "rc") {
        bool found = false;
        for (Recompute x : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
          if (value == to_string(x)) s.recompute = x, found = true;
        }
        if (!found) return std::nullopt;
      } else if (key == "st") {
        if (!parse_int_list(value, false, s.stage_layers)) return std::nullopt;
      } else if (key == "sh") {
        if (!parse_int_list(value, true, s.dp_shares)) return std::nullopt;
      } else if (key == "g") {
        std::istringstream in(value);
        std::string item;
        while (std::getline(in, item, ',')) {
          int a = 0, b = 0;
          char tail = 0;
          const int n = std::sscanf(item.c_str(), "%d-%d%c", &a, &b, &tail);
          if (n == 1) b = a;
          if (n < 1 || n > 2 || a < 0 || b < a || b - a > (1 << 20)) return std::nullopt;
          for (int g = a; g <= b; ++g) s.gpus.push_back(g);
        }
      } else {
        return std::nullopt;
      }
    }
    if (find_problem(s, job.scenario.model, job.scenario.cluster)) return std::nullopt;
    return s;
  }
  if (find_problem(s, job.scenario.model, job.scenario.cluster)) {
    s.sp = !s.sp;
    if (find_problem(s, job.scenario.model, job.scenario.cluster)) return std::nullopt;
  }
  return s;
}

}  // namespace parapilot::agent::runtime
