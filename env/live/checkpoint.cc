#include "env/live/checkpoint.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "strategy/atomic_file.h"
#include "strategy/error.h"

namespace parapilot::live {

namespace {

constexpr const char* kMagic = "parapilot-state 1";

std::uint64_t fnv1a64(const char* data, std::size_t n, std::uint64_t h = 0xcbf29ce484222325ull) {
  for (std::size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(data[i]);
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::ostringstream out;
  out << '[';
  for (std::size_t i = 0; i < shape.size(); ++i) out << (i ? "," : "") << shape[i];
  out << ']';
  return out.str();
}

// The tensor kinds `c` holds (parameters, and Adam's moments when it has them), in payload
// order.
std::vector<const std::vector<std::vector<float>>*> payload_of(const Checkpoint& c) {
  std::vector<const std::vector<std::vector<float>>*> out{&c.params};
  if (!c.exp_avg.empty()) {
    out.push_back(&c.exp_avg);
    out.push_back(&c.exp_avg_sq);
  }
  return out;
}

void read_or_throw(const std::string& dir, const ModelConfig& model, const std::string& optimizer,
                   bool header_only, Checkpoint& c) {
  const std::string what = "--load-state " + dir + ": ";
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw InputError(what + "no such folder");
  const std::string path = checkpoint_path(dir);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(what + "no checkpoint in it (" + path + " is missing or unreadable)");
  const std::uintmax_t file_bytes = fs::file_size(path, ec);
  std::string magic, header_line;
  if (!std::getline(in, magic) || magic != kMagic)
    throw InputError(what + path + " is not a parapilot checkpoint (its first line is not '" +
                     kMagic + "')");
  if (!std::getline(in, header_line)) throw InputError(what + path + " is truncated (no header)");
  const nlohmann::json h = nlohmann::json::parse(header_line, nullptr, false);
  if (!h.is_object() || !h.contains("tensors") || !h["tensors"].is_array() ||
      !h.contains("payload_bytes") || !h.contains("fnv1a64") || !h.contains("next_step") ||
      !h.contains("optimizer") || !h.contains("adam_step") || !h.contains("model"))
    throw InputError(what + path + " has a malformed header");
  try {
    const nlohmann::json& m = h["model"];
    c.model.kind = m.at("kind").get<std::string>();
    c.model.layers = m.at("layers").get<int>();
    c.model.d_model = m.at("d_model").get<int>();
    c.model.heads = m.at("heads").get<int>();
    c.model.seq_len = m.at("seq_len").get<int>();
    c.model.context = m.at("context").get<int>();
    c.optimizer = h["optimizer"].get<std::string>();
    c.next_step = h["next_step"].get<std::uint64_t>();
    c.adam_step = h["adam_step"].get<std::int64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw InputError(what + path + " has a malformed header (" + e.what() + ")");
  }
  const std::string saved_model = c.model.kind + " with " + std::to_string(c.model.layers) +
                                  " layers, d_model " + std::to_string(c.model.d_model) + ", " +
                                  std::to_string(c.model.heads) + " heads, seq_len " +
                                  std::to_string(c.model.seq_len);
  const std::vector<LayerShape> want = model_layers(model);
  const nlohmann::json& tensors = h["tensors"];
  if (tensors.size() != want.size())
    throw InputError(what + "the checkpoint's model (" + saved_model + ") has " +
                     std::to_string(tensors.size()) + " tensors; this job's has " +
                     std::to_string(want.size()) + " (check --model, --layers, --d-model, ...)");
  for (std::size_t i = 0; i < want.size(); ++i) {
    std::string name;
    std::vector<std::int64_t> shape;
    try {
      name = tensors[i].at("name").get<std::string>();
      shape = tensors[i].at("shape").get<std::vector<std::int64_t>>();
    } catch (const nlohmann::json::exception& e) {
      throw InputError(what + path + " has a malformed header (" + e.what() + ")");
    }
    if (name != want[i].name || shape != want[i].shape)
      throw InputError(what + "the checkpoint's model (" + saved_model + ") has tensor " +
                       std::to_string(i) + " '" + name + "' of shape " + shape_text(shape) +
                       "; this job's is '" + want[i].name + "' of shape " +
                       shape_text(want[i].shape) + " (check --model, --layers, --d-model, ...)");
  }
  if (c.optimizer != optimizer)
    throw InputError(what + "the checkpoint holds " + c.optimizer +
                     " state; this job trains with " + optimizer + " (--optimizer)");
  const bool adam_state = c.adam_step > 0;
  std::uint64_t elements = 0;
  for (const LayerShape& l : want) elements += static_cast<std::uint64_t>(l.numel());
  const std::uint64_t expected = elements * 4 * (adam_state ? 3 : 1);
  std::uint64_t payload_bytes = 0;
  try {
    payload_bytes = h["payload_bytes"].get<std::uint64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw InputError(what + path + " has a malformed header (" + e.what() + ")");
  }
  if (payload_bytes != expected)
    throw InputError(what + path + " has a malformed header (payload of " +
                     std::to_string(payload_bytes) + " bytes; the model's state is " +
                     std::to_string(expected) + ")");
  const auto header_bytes = static_cast<std::uintmax_t>(in.tellg());
  if (ec || file_bytes != header_bytes + payload_bytes)
    throw InputError(what + path + " is " +
                     (file_bytes < header_bytes + payload_bytes ? "truncated" : "too long") + " (" +
                     std::to_string(file_bytes) + " bytes; its header says " +
                     std::to_string(header_bytes + payload_bytes) + ")");
  if (header_only) return;
  std::uint64_t checksum = 0xcbf29ce484222325ull;
  auto read_kind = [&](std::vector<std::vector<float>>& out) {
    out.clear();
    for (const LayerShape& l : want) {
      std::vector<float> t(static_cast<std::size_t>(l.numel()));
      in.read(reinterpret_cast<char*>(t.data()), static_cast<std::streamsize>(t.size() * 4));
      if (!in) throw InputError(what + path + " is truncated");
      checksum = fnv1a64(reinterpret_cast<const char*>(t.data()), t.size() * 4, checksum);
      out.push_back(std::move(t));
    }
  };
  read_kind(c.params);
  if (adam_state) {
    read_kind(c.exp_avg);
    read_kind(c.exp_avg_sq);
  }
  std::ostringstream hex;
  hex << std::hex << checksum;
  if (h["fnv1a64"] != hex.str())
    throw InputError(what + path + " is corrupt (its payload's checksum does not match)");
}

}  // namespace

std::string checkpoint_path(const std::string& dir) {
  return (std::filesystem::path(dir) / "parapilot-state.bin").string();
}

Status write_checkpoint(const std::string& dir, const Checkpoint& c) {
  const std::string what = "--save-state " + dir + ": ";
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::invalid_argument(what + "cannot create the folder (" + ec.message() + ")");
  std::uint64_t checksum = 0xcbf29ce484222325ull, bytes = 0;
  for (const auto* kind : payload_of(c))
    for (const std::vector<float>& t : *kind) {
      checksum = fnv1a64(reinterpret_cast<const char*>(t.data()), t.size() * 4, checksum);
      bytes += t.size() * 4;
    }
  std::ostringstream hex;
  hex << std::hex << checksum;
  nlohmann::json h;
  h["model"] = {{"kind", c.model.kind},       {"layers", c.model.layers},
                {"d_model", c.model.d_model}, {"heads", c.model.heads},
                {"seq_len", c.model.seq_len}, {"context", c.model.context}};
  nlohmann::json tensors = nlohmann::json::array();
  for (const LayerShape& l : model_layers(c.model))
    tensors.push_back({{"name", l.name}, {"shape", l.shape}});
  h["tensors"] = std::move(tensors);
  h["optimizer"] = c.optimizer;
  h["adam_step"] = c.exp_avg.empty() ? 0 : c.adam_step;
  h["next_step"] = c.next_step;
  h["payload_bytes"] = bytes;
  h["fnv1a64"] = hex.str();

  const std::string head = std::string(kMagic) + "\n" + h.dump() + "\n";
  const Status written = catch_input_error([&] {
    write_file_atomically(checkpoint_path(dir), [&](std::ostream& out) {
      out << head;
      for (const auto* kind : payload_of(c))
        for (const std::vector<float>& t : *kind)
          out.write(reinterpret_cast<const char*>(t.data()),
                    static_cast<std::streamsize>(t.size() * 4));
    });
  });
  if (!written.ok()) return Status::invalid_argument(what + written.message());
  return {};
}

StatusOr<Checkpoint> read_checkpoint(const std::string& dir, const ModelConfig& model,
                                     const std::string& optimizer, bool header_only) {
  return catch_input_error([&] {
    Checkpoint c;
    read_or_throw(dir, model, optimizer, header_only, c);
    return c;
  });
}

}  // namespace parapilot::live
