#include "experiments/cli_common.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <stdexcept>

#include "core/error.h"

namespace parapilot::cli {

nlohmann::json to_json(const Strategy& s) {
  nlohmann::json j;
  j["dp"] = s.dp;
  j["tp"] = s.tp;
  j["pp"] = s.pp;
  j["cp"] = s.cp;
  j["sp"] = s.sp;
  j["attention"] = to_string(s.attention);
  j["fp8"] = s.fp8;
  j["microbatch_size"] = s.microbatch_size;
  j["global_batch"] = s.global_batch;
  j["schedule"] = to_string(s.schedule);
  j["virtual_stages"] = s.virtual_stages;
  j["recompute"] = to_string(s.recompute);
  j["zero"] = s.zero;
  j["overlap_grad_reduce"] = s.overlap_grad_reduce;
  j["overlap_param_gather"] = s.overlap_param_gather;
  j["tp_comm_overlap"] = s.tp_comm_overlap;
  if (s.stage_layers.empty())
    j["stages"] = "balanced";
  else
    j["stages"] = s.stage_layers;
  if (s.gpus.empty())
    j["placement"] = to_string(s.placement);
  else
    j["placement"] = s.gpus;
  j["dp_shares"] = s.shares();
  nlohmann::json compression;
  compression["default"] = to_string(s.compression);
  compression["overrides"] = nlohmann::json::array();
  for (const auto& o : s.compression_overrides) {
    compression["overrides"].push_back(
        {{"layers", {o.first_layer, o.last_layer}}, {"method", to_string(o.compression)}});
  }
  j["compression"] = compression;
  return j;
}

nlohmann::json to_json(const CostBreakdown& b) {
  nlohmann::json j;
  j["feasible"] = b.feasible;
  if (!b.reason.empty()) j["reason"] = b.reason;
  if (!b.feasible) return j;
  j["iteration_time_s"] = b.iteration_time_s;
  j["tflops_per_gpu"] = b.tflops_per_gpu;
  j["mfu"] = b.mfu;
  j["tokens_per_s"] = b.tokens_per_s;
  j["memory_gb_per_gpu"] = b.memory_gib;
  j["memory_capacity_gb"] = b.memory_capacity_gib;
  j["fits_in_memory"] = b.fits_in_memory;
  j["breakdown"] = {{"compute_s", b.compute_s}, {"recompute_s", b.recompute_s},
                    {"tp_comm_s", b.tp_comm_s}, {"cp_comm_s", b.cp_comm_s},
                    {"pp_comm_s", b.pp_comm_s}, {"bubble_s", b.bubble_s},
                    {"dp_comm_s", b.dp_comm_s}, {"optimizer_s", b.optimizer_s}};
  return j;
}

std::string describe(const Strategy& s) {
  std::ostringstream out;
  out << "dp=" << s.dp << " tp=" << s.tp << " pp=" << s.pp;
  if (s.cp > 1) out << " cp=" << s.cp;
  out << (s.sp ? " sp" : "") << " mb=" << s.microbatch_size << " gb=" << s.global_batch << " "
      << to_string(s.schedule);
  if (s.virtual_stages > 1) out << "(v=" << s.virtual_stages << ")";
  out << " recompute=" << to_string(s.recompute) << " zero=" << s.zero
      << " attention=" << to_string(s.attention) << (s.fp8 ? " fp8" : "");
  if (!s.stage_layers.empty()) {
    out << " stages=[";
    for (size_t i = 0; i < s.stage_layers.size(); ++i) out << (i ? "," : "") << s.stage_layers[i];
    out << "]";
  }
  if (!s.dp_shares.empty()) {
    out << " shares=[";
    for (size_t i = 0; i < s.dp_shares.size() && i < 16; ++i)
      out << (i ? "," : "") << s.dp_shares[i];
    if (s.dp_shares.size() > 16) out << ",...";
    out << "]";
  }
  if (s.compression.kind != Compression::Kind::kNone || !s.compression_overrides.empty()) {
    out << " compression=" << to_string(s.compression);
    if (!s.compression_overrides.empty())
      out << "+" << s.compression_overrides.size() << " overrides";
  }
  return out.str();
}

std::pair<std::string, uint16_t> parse_address(const std::string& flag, const std::string& text,
                                               bool port_required) {
  std::string host = "127.0.0.1";
  std::string port_text = text;
  const auto colon = text.rfind(':');
  if (colon != std::string::npos) {
    if (colon > 0) host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
  }
  int port = -1;
  try {
    size_t used = 0;
    port = std::stoi(port_text, &used);
    if (used != port_text.size()) port = -1;
  } catch (const std::exception&) {
    port = -1;
  }
  if (port < 0 || port > 65535 || (port_required && port == 0)) {
    throw InputError(flag + " \"" + text + "\": expected HOST:PORT with a port in " +
                     (port_required ? "1" : "0") + "..65535");
  }
  return {host, static_cast<uint16_t>(port)};
}

}  // namespace parapilot::cli
