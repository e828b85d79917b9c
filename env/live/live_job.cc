#include "env/live/live_job.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/status.h"

namespace parapilot::live {

namespace {

Status write_whole(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.flush();
    if (!out) return Status::invalid_argument("cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return Status::invalid_argument("cannot write " + path);
  }
  return {};
}

}  // namespace

StatusOr<std::string> write_job_scenario(const ModelConfig& m, int workers, int global_batch,
                                         const std::string& dir) {
  const bool mlp = m.kind == "mlp";
  std::ostringstream model;
  model << "# The live workers' " << m.kind << ".\n"
        << "[model]\nname = \"live-" << m.kind << "\"\nlayers = " << m.layers
        << "\nhidden = " << m.d_model << "\nheads = " << (mlp ? 1 : m.heads)
        << "\nseq_len = " << (mlp ? m.context : m.seq_len) << "\nvocab = " << m.kVocab << "\n";
  const std::string model_path = dir + "/model.toml";
  if (Status written = write_whole(model_path, model.str()); !written.ok()) return written;
  return write_job_scenario(model_path, workers, global_batch, dir);
}

StatusOr<std::string> write_job_scenario(const std::string& model_path, int workers,
                                         int global_batch, const std::string& dir) {
  std::ostringstream job;
  job << "# The local live cluster as the deploy agent sees it.\n"
      << "[scenario]\nfamily = \"straggler\"\ncluster = \"1x" << workers
      << "xa100-80g\"\nmodel = \"" << model_path << "\"\nglobal_batch = " << global_batch
      << "\n\n# What the workers can switch: data-parallel shares.\n[space]\ntp = [1]\npp = [1]\n"
      << "microbatch_size = [1]\nzero = [1]\nrecompute = [\"selective\"]\n";
  const std::string path = dir + "/job.toml";
  if (Status written = write_whole(path, job.str()); !written.ok()) return written;
  return path;
}

}  // namespace parapilot::live
