#include "env/live/run_summary.h"

#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/error.h"

namespace parapilot::live {

std::string run_summary_json(const RunSummary& s) {
  nlohmann::json j;
  j["first_step"] = s.first_step;
  j["steps"] = s.steps;
  j["samples"] = s.samples;
  j["train_s"] = s.train_s;
  j["throughput_samples_per_s"] = s.train_s > 0 ? static_cast<double>(s.samples) / s.train_s : 0.0;
  j["layout"] = s.layout;
  j["started_unix_s"] = s.started_unix_s;
  j["first_step_end_unix_s"] = s.first_step_end_unix_s;
  j["last_step_end_unix_s"] = s.last_step_end_unix_s;
  j["step_ms"] = s.step_ms;
  j["step_end_s"] = s.step_end_s;
  nlohmann::json switches = nlohmann::json::array();
  for (const SwitchSummary& w : s.switches)
    switches.push_back({{"plan_id", w.plan_id},
                        {"layout", w.layout},
                        {"at_step", w.at_step},
                        {"pause_ms", w.pause_ms},
                        {"staged_ms", w.staged_ms},
                        {"bytes_moved", w.bytes_moved},
                        {"prepared_at_step", w.prepared_at_step},
                        {"ready_at_step", w.ready_at_step}});
  j["switches"] = std::move(switches);
  return j.dump(1) + "\n";
}

Status write_run_summary(const std::string& path, const RunSummary& summary) {
  return write_file_atomically(path, [&](std::ostream& out) { out << run_summary_json(summary); });
}

}  // namespace parapilot::live
