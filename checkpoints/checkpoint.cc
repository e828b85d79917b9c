#include "checkpoints/checkpoint.h"


#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <span>
#include <sstream>
#include <vector>

#include <cereal/archives/json.hpp>
#include <cereal/types/map.hpp>
#include <cereal/types/string.hpp>
#include <cereal/types/vector.hpp>

#include "core/atomic_file.h"
#include "core/checksum.h"

namespace parapilot::policy {

template <class Archive>
void serialize(Archive& ar, RunningStats& s) {
  ar(cereal::make_nvp("count", s.count), cereal::make_nvp("mean", s.mean),
     cereal::make_nvp("m2", s.m2), cereal::make_nvp("min", s.min), cereal::make_nvp("max", s.max));
}

}  // namespace parapilot::policy

namespace parapilot::checkpoints {

namespace {

constexpr char kMagic[8] = {'P', 'P', 'L', 'T', 'C', 'K', 'P', 'T'};
constexpr size_t kHeaderBytes = 8 + 4 + 4 + 8 * 3;

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFFu));
}
void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFFu));
}
uint64_t get_le(const std::string& in, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(in[at + i])) << (8 * i);
  return v;
}

uint32_t checksum_of(const std::string& bytes, size_t n) {
  return crc32c(std::span(reinterpret_cast<const std::uint8_t*>(bytes.data()), n));
}

std::string metadata_json(const PolicyCheckpoint& c) {
  std::ostringstream out;
  {
    cereal::JSONOutputArchive ar(out);
    ar(cereal::make_nvp("feature_schema", c.feature_schema), cereal::make_nvp("env_id", c.env_id),
       cereal::make_nvp("config", c.config), cereal::make_nvp("step", c.step),
       cereal::make_nvp("update", c.update), cereal::make_nvp("metrics", c.metrics),
       cereal::make_nvp("state_stats", c.normalizer.state_stats()),
       cereal::make_nvp("candidate_stats", c.normalizer.candidate_stats()));
  }
  return out.str();
}

void parse_metadata(const std::string& json, PolicyCheckpoint& c) {
  std::istringstream in(json);
  cereal::JSONInputArchive ar(in);
  ar(cereal::make_nvp("feature_schema", c.feature_schema), cereal::make_nvp("env_id", c.env_id),
     cereal::make_nvp("config", c.config), cereal::make_nvp("step", c.step),
     cereal::make_nvp("update", c.update), cereal::make_nvp("metrics", c.metrics),
     cereal::make_nvp("state_stats", c.normalizer.state_stats()),
     cereal::make_nvp("candidate_stats", c.normalizer.candidate_stats()));
  auto sized = [](const policy::RunningStats& s, int dims) {
    return s.dims() == dims && static_cast<int>(s.m2.size()) == dims &&
           static_cast<int>(s.min.size()) == dims && static_cast<int>(s.max.size()) == dims;
  };
  if (!sized(c.normalizer.state_stats(), env::kStateDim) ||
      !sized(c.normalizer.candidate_stats(), env::kCandidateDim)) {
    throw std::runtime_error("normalisation statistics have the wrong size");
  }
}

}  // namespace

Status write_checkpoint(const std::string& path, const PolicyCheckpoint& checkpoint) {
  const std::string meta = metadata_json(checkpoint);
  std::string file;
  file.reserve(kHeaderBytes + meta.size() + checkpoint.model.size() + checkpoint.optimizer.size() +
               4);
  file.append(kMagic, sizeof kMagic);
  put_u32(file, kFormatVersion);
  put_u32(file, checkpoint.feature_schema);
  put_u64(file, meta.size());
  put_u64(file, checkpoint.model.size());
  put_u64(file, checkpoint.optimizer.size());
  file += meta;
  file += checkpoint.model;
  file += checkpoint.optimizer;
  put_u32(file, checksum_of(file, file.size()));

  const Status written =
      write_file_atomically(path, [&](std::ostream& out) { out.write(file.data(), std::ssize(file)); });
  if (!written.ok()) return Status::invalid_argument("checkpoint " + written.message());
  return {};
}

StatusOr<PolicyCheckpoint> read_checkpoint(const std::string& path) {
  const std::string where = "checkpoint " + path + ": ";
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const std::string why = where + "cannot open (" + std::strerror(errno) + ")";
    return errno == ENOENT ? Status::not_found(why) : Status::invalid_argument(why);
  }
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (file.size() < sizeof kMagic || std::memcmp(file.data(), kMagic, sizeof kMagic) != 0) {
    return Status::invalid_argument(where + "not a parapilot checkpoint (bad magic)");
  }
  if (file.size() < kHeaderBytes + 4) return Status::invalid_argument(where + "truncated (header incomplete)");
  const uint32_t format = static_cast<uint32_t>(get_le(file, 8, 4));
  if (format != kFormatVersion) {
    return Status::invalid_argument(where + "format version " + std::to_string(format) +
                     "; this build reads version " + std::to_string(kFormatVersion));
  }
  const uint64_t meta_len = get_le(file, 16, 8), model_len = get_le(file, 24, 8),
                 optim_len = get_le(file, 32, 8);
  const uint64_t body = file.size() - kHeaderBytes - 4;
  if (meta_len > body || model_len > body || optim_len > body ||
      meta_len + model_len + optim_len != body) {
    return Status::invalid_argument(
        where +
        (meta_len + model_len + optim_len > body
             ? "truncated (" + std::to_string(file.size()) + " bytes; the header announces " +
                   std::to_string(kHeaderBytes + 4 + meta_len + model_len + optim_len) + ")"
             : std::string("corrupted (section lengths do not match the file size)")));
  }
  const uint32_t stored = static_cast<uint32_t>(get_le(file, file.size() - 4, 4));
  if (checksum_of(file, file.size() - 4) != stored)
    return Status::invalid_argument(where + "corrupted (checksum mismatch)");
  const uint32_t schema = static_cast<uint32_t>(get_le(file, 12, 4));
  if (schema != policy::kFeatureSchemaVersion) {
    return Status::invalid_argument(where + "feature schema version " + std::to_string(schema) +
                     "; this build's policy reads version " +
                     std::to_string(policy::kFeatureSchemaVersion) + " (retrain the policy)");
  }
  PolicyCheckpoint c;
  try {
    parse_metadata(file.substr(kHeaderBytes, meta_len), c);
  } catch (const std::exception& e) {
    return Status::invalid_argument(where + "unreadable metadata (" + e.what() + ")");
  }
  if (c.feature_schema != schema) return Status::invalid_argument(where + "corrupted (schema versions disagree)");
  c.model = file.substr(kHeaderBytes + meta_len, model_len);
  c.optimizer = file.substr(kHeaderBytes + meta_len + model_len, optim_len);
  return c;
}

}  // namespace parapilot::checkpoints
