#include "env/live/checkpoint.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/checksum.h"
#include "core/error.h"

namespace parapilot::live {

namespace {

constexpr const char* kMagic = "parapilot-state 2";
constexpr const char* kMagicV1 = "parapilot-state 1";  // no error feedback

std::uint32_t continue_checksum(const std::vector<float>& t, std::uint32_t crc) {
  return crc32c(std::span(reinterpret_cast<const std::uint8_t*>(t.data()), t.size() * 4), crc);
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::ostringstream out;
  out << '[';
  for (std::size_t i = 0; i < shape.size(); ++i) out << (i ? "," : "") << shape[i];
  out << ']';
  return out.str();
}

// Every array of `c`'s payload in file order: parameters, Adam's moments when it has them, then
// the feedback table's residuals and bases.
template <class C, class F>
void for_each_payload(C& c, F&& f) {
  for (auto& t : c.params) f(t);
  for (auto& t : c.exp_avg) f(t);
  for (auto& t : c.exp_avg_sq) f(t);
  for (auto& fb : c.feedback) {
    if (!fb.residual.empty()) f(fb.residual);
    if (!fb.basis.empty()) f(fb.basis);
  }
}

std::int64_t product(const std::vector<std::int64_t>& v) {
  std::int64_t n = 1;
  for (std::int64_t x : v) n *= x;
  return n;
}

// Reads the header's error-feedback table into c.feedback (arrays left empty) and `sizes`
// (per entry: the residual's and the basis's elements). Throws InputError naming the entry and
// what is wrong.
void read_feedback_table(const nlohmann::json& h, const std::vector<LayerShape>& want,
                         const std::string& where, TrainingState& c,
                         std::vector<std::pair<std::int64_t, std::int64_t>>& sizes) {
  const std::string bad = where + " has a malformed error-feedback table (";
  const nlohmann::json& f = h["feedback"];
  if (!f.is_object() || !f.contains("replicas") || !f.contains("tensors") ||
      !f["replicas"].is_number_integer() || !f["tensors"].is_array())
    throw InputError(bad + "it needs integer 'replicas' and a 'tensors' list)");
  const std::int64_t replicas = f["replicas"].get<std::int64_t>();
  const nlohmann::json& tensors = f["tensors"];
  if (!tensors.empty() && (replicas < 1 || replicas > 65536))
    throw InputError(bad + "'replicas' is " + std::to_string(replicas) +
                     "; it must be 1 to 65536)");
  c.feedback_replicas = tensors.empty() ? 0 : static_cast<int>(replicas);
  int previous = -1;
  for (std::size_t e = 0; e < tensors.size(); ++e) {
    const std::string entry = bad + "entry " + std::to_string(e) + ": ";
    const nlohmann::json& t = tensors[e];
    if (!t.is_object() || !t.contains("layer") || !t["layer"].is_number_integer() ||
        !t.contains("residual") || !t["residual"].is_boolean() || !t.contains("basis") ||
        !t["basis"].is_array())
      throw InputError(entry +
                       "it needs an integer 'layer', a boolean 'residual' and a 'basis' "
                       "shape list)");
    const std::int64_t layer = t["layer"].get<std::int64_t>();
    if (layer < 0 || layer >= static_cast<std::int64_t>(want.size()))
      throw InputError(entry + "layer " + std::to_string(layer) + " is not a tensor of the " +
                       std::to_string(want.size()) + "-tensor model)");
    if (layer <= previous)
      throw InputError(entry + "layer " + std::to_string(layer) + " comes after layer " +
                       std::to_string(previous) + "; the layers must increase)");
    previous = static_cast<int>(layer);
    const LayerShape& l = want[static_cast<std::size_t>(layer)];
    TrainingState::TensorFeedback fb;
    fb.layer = static_cast<int>(layer);
    sizes.push_back({t["residual"].get<bool>() ? replicas * l.numel() : 0, 0});
    for (const nlohmann::json& d : t["basis"]) {
      if (!d.is_number_integer())
        throw InputError(entry + "the basis shape of " + l.name + " is not a list of integers)");
      fb.basis_shape.push_back(d.get<std::int64_t>());
    }
    if (!fb.basis_shape.empty()) {
      const auto& b = fb.basis_shape;
      // A shard's Q: pieces x n is at most the tensor's elements, and so is the rank.
      const std::int64_t n = l.numel();
      if (l.shape.size() < 2 || b.size() != 3 || b[0] < 1 || b[1] < 1 || b[2] < 1 || b[0] > n ||
          b[1] > n || b[2] > n || b[0] * b[1] > n)
        throw InputError(entry + "the basis shape " + shape_text(b) + " of " + l.name +
                         " is not {pieces, n, rank} of positive sizes within its shape " +
                         shape_text(l.shape) + ")");
      sizes.back().second = product(b);
    }
    if (sizes.back().first == 0 && sizes.back().second == 0)
      throw InputError(entry + l.name + " has neither a residual nor a basis)");
    c.feedback.push_back(std::move(fb));
  }
}

void read_or_throw(const std::string& dir, const ModelConfig& model, const std::string& optimizer,
                   bool header_only, TrainingState& c) {
  const std::string what = "--load-state " + dir + ": ";
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw InputError(what + "no such folder");
  const std::string path = checkpoint_path(dir);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(what + "no checkpoint in it (" + path + " is missing or unreadable)");
  const std::uintmax_t file_bytes = fs::file_size(path, ec);
  std::string magic, header_line;
  if (!std::getline(in, magic) || (magic != kMagic && magic != kMagicV1))
    throw InputError(what + path + " is not a parapilot checkpoint (its first line is not '" +
                     kMagic + "')");
  if (!std::getline(in, header_line)) throw InputError(what + path + " is truncated (no header)");
  const nlohmann::json h = nlohmann::json::parse(header_line, nullptr, false);
  if (h.is_object() && h.contains("fnv1a64") && !h.contains("crc32c"))
    throw InputError(what + path +
                     " was written by an older parapilot (an FNV-1a checksum); this build reads "
                     "CRC32C checkpoints: save it again with this build");
  if (!h.is_object() || !h.contains("tensors") || !h["tensors"].is_array() ||
      !h.contains("payload_bytes") || !h.contains("crc32c") || !h.contains("next_step") ||
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
  std::vector<std::pair<std::int64_t, std::int64_t>> feedback_sizes;
  if (h.contains("feedback")) {
    if (magic == kMagicV1)
      throw InputError(what + path + " has a malformed header (a '" + kMagicV1 +
                       "' file has no error-feedback table)");
    read_feedback_table(h, want, what + path, c, feedback_sizes);
  }
  std::uint64_t elements = 0;
  for (const LayerShape& l : want) elements += static_cast<std::uint64_t>(l.numel());
  std::uint64_t expected = elements * 4 * (adam_state ? 3 : 1);
  for (const auto& [residual, basis] : feedback_sizes)
    expected += static_cast<std::uint64_t>(residual + basis) * 4;
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
  std::uint32_t checksum = 0;
  auto sized = [&](std::vector<std::vector<float>>& out) {
    out.clear();
    for (const LayerShape& l : want) out.emplace_back(static_cast<std::size_t>(l.numel()));
  };
  sized(c.params);
  if (adam_state) {
    sized(c.exp_avg);
    sized(c.exp_avg_sq);
  }
  for (std::size_t e = 0; e < c.feedback.size(); ++e) {
    c.feedback[e].residual.resize(static_cast<std::size_t>(feedback_sizes[e].first));
    c.feedback[e].basis.resize(static_cast<std::size_t>(feedback_sizes[e].second));
  }
  for_each_payload(c, [&](std::vector<float>& t) {
    in.read(reinterpret_cast<char*>(t.data()), static_cast<std::streamsize>(t.size() * 4));
    if (!in) throw InputError(what + path + " is truncated");
    checksum = continue_checksum(t, checksum);
  });
  if (!h["crc32c"].is_number_unsigned() || h["crc32c"].get<std::uint64_t>() != checksum)
    throw InputError(what + path + " is corrupt (its payload's checksum does not match)");
}

}  // namespace

std::string checkpoint_path(const std::string& dir) {
  return (std::filesystem::path(dir) / "parapilot-state.bin").string();
}

Status write_checkpoint(const std::string& dir, const TrainingState& c) {
  const std::string what = "--save-state " + dir + ": ";
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::invalid_argument(what + "cannot create the folder (" + ec.message() + ")");
  std::uint32_t checksum = 0;
  std::uint64_t bytes = 0;
  for_each_payload(c, [&](const std::vector<float>& t) {
    checksum = continue_checksum(t, checksum);
    bytes += t.size() * 4;
  });
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
  nlohmann::json feedback = nlohmann::json::array();
  for (const auto& fb : c.feedback)
    feedback.push_back(
        {{"layer", fb.layer}, {"residual", !fb.residual.empty()}, {"basis", fb.basis_shape}});
  h["feedback"] = {{"replicas", c.feedback_replicas}, {"tensors", std::move(feedback)}};
  h["payload_bytes"] = bytes;
  h["crc32c"] = checksum;

  const std::string head = std::string(kMagic) + "\n" + h.dump() + "\n";
  const Status written = write_file_atomically(checkpoint_path(dir), [&](std::ostream& out) {
    out << head;
    for_each_payload(c, [&](const std::vector<float>& t) {
      out.write(reinterpret_cast<const char*>(t.data()),
                static_cast<std::streamsize>(t.size() * 4));
    });
  });
  if (!written.ok()) return Status::invalid_argument(what + written.message());
  return {};
}

StatusOr<TrainingState> read_checkpoint(const std::string& dir, const ModelConfig& model,
                                     const std::string& optimizer, bool header_only) {
  return catch_input_error([&] {
    TrainingState c;
    read_or_throw(dir, model, optimizer, header_only, c);
    return c;
  });
}

}  // namespace parapilot::live
