#include "env/live/live_job.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/status.h"
#include "core/atomic_file.h"
#include "core/error.h"

namespace parapilot::live {

namespace {

Status write_whole(const std::string& path, const std::string& text) {
  return write_file_atomically(path, [&](std::ostream& out) { out << text; });
}

}  // namespace

StatusOr<std::string> write_job_scenario(const ModelConfig& m, int workers, int global_batch,
                                         const std::string& dir, const JobSwitches& switches) {
  const bool mlp = m.kind == "mlp";
  std::ostringstream model;
  model << "# The live workers' " << m.kind << ".\n"
        << "[model]\nname = \"live-" << m.kind << "\"\nlayers = " << m.layers
        << "\nhidden = " << m.d_model << "\nheads = " << (mlp ? 1 : m.heads)
        << "\nseq_len = " << (mlp ? m.context : m.seq_len) << "\nvocab = " << m.kVocab << "\n";
  const std::string model_path = dir + "/model.toml";
  if (Status written = write_whole(model_path, model.str()); !written.ok()) return written;
  return write_job_scenario(model_path, workers, global_batch, dir, switches);
}

StatusOr<std::string> write_job_scenario(const std::string& model_path, int workers,
                                         int global_batch, const std::string& dir,
                                         const JobSwitches& switches) {
  auto list = [](const std::vector<int>& v) {
    std::string out = "[";
    for (std::size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
    return out + "]";
  };
  const bool hybrid = switches.tp != std::vector<int>{1} || switches.pp != std::vector<int>{1};
  std::ostringstream job;
  job << "# The local live cluster as the deploy agent sees it.\n"
      << "[scenario]\nfamily = \"straggler\"\ncluster = \"1x" << workers
      << "xa100-80g\"\nmodel = \"" << model_path << "\"\nglobal_batch = " << global_batch
      << "\n\n# What the workers can switch: data-parallel shares"
      << (hybrid ? ", tensor- and pipeline-parallel degrees and stage boundaries" : "")
      << ".\n[space]\ntp = " << list(switches.tp) << "\npp = " << list(switches.pp)
      << "\nmicrobatch_size = [1]\nzero = [1]\nrecompute = [\"selective\"]\n"
      << (hybrid ? "# The workers run 1F1B over one stage per rank.\nschedule = [\"1f1b\"]\n" : "");
  const std::string path = dir + "/job.toml";
  if (Status written = write_whole(path, job.str()); !written.ok()) return written;
  return path;
}

}  // namespace parapilot::live
