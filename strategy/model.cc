#include "strategy/model.h"

namespace parapilot {

int64_t ModelSpec::params_per_layer() const {
  const int64_t h = hidden;
  const int64_t f = ffn_hidden;
  const int64_t attention = h * (h + kv_width()) + h * h;  // QKV and output projection
  const int64_t mlp = (activation == Activation::kSwiGLU ? 3 : 2) * h * f;
  const bool gpt_style = activation == Activation::kGelu;
  // GPT-style blocks carry biases and two LayerNorms (scale + bias); llama-style two RMSNorms.
  const int64_t biases = gpt_style ? (h + kv_width()) + h + f + h : 0;
  const int64_t norms = gpt_style ? 4 * h : 2 * h;
  return attention + mlp + biases + norms;
}

int64_t ModelSpec::embedding_params() const {
  const int64_t positions = activation == Activation::kGelu ? int64_t{seq_len} * hidden : 0;
  return int64_t{vocab} * hidden + positions;
}

int64_t ModelSpec::output_params() const { return tied_embeddings ? 0 : int64_t{vocab} * hidden; }

int64_t ModelSpec::total_params() const {
  return int64_t{layers} * params_per_layer() + embedding_params() + output_params();
}

double ModelSpec::block_forward_flops_per_token(int seq) const {
  const double h = hidden;
  const double f = ffn_hidden;
  const double qkv = 2.0 * h * (h + static_cast<double>(kv_width()));
  const double projection = 2.0 * h * h;
  const double mlp = (activation == Activation::kSwiGLU ? 3.0 : 2.0) * 2.0 * h * f;
  const double attention_core = 2.0 * 2.0 * seq * h;  // QK^T and scores x V
  return qkv + projection + mlp + attention_core;
}

double ModelSpec::logits_forward_flops_per_token() const {
  return 2.0 * hidden * static_cast<double>(vocab);
}

double iteration_model_flops(const ModelSpec& model, int global_batch, bool recompute_full) {
  const double tokens = static_cast<double>(global_batch) * model.seq_len;
  const double block_passes = recompute_full ? 4.0 : 3.0;
  return tokens *
         (block_passes * model.layers * model.block_forward_flops_per_token(model.seq_len) +
          3.0 * model.logits_forward_flops_per_token());
}

namespace {

ModelSpec gpt(std::string name, int layers, int hidden, int heads) {
  ModelSpec m;
  m.name = std::move(name);
  m.layers = layers;
  m.hidden = hidden;
  m.heads = heads;
  m.kv_heads = heads;
  m.ffn_hidden = 4 * hidden;
  m.seq_len = 2048;
  m.vocab = 50257;
  m.dtype = DType::kBF16;
  m.activation = Activation::kGelu;
  m.tied_embeddings = true;
  return m;
}

ModelSpec llama(std::string name, int layers, int hidden, int heads, int kv_heads, int ffn, int seq,
                int vocab) {
  ModelSpec m;
  m.name = std::move(name);
  m.layers = layers;
  m.hidden = hidden;
  m.heads = heads;
  m.kv_heads = kv_heads;
  m.ffn_hidden = ffn;
  m.seq_len = seq;
  m.vocab = vocab;
  m.dtype = DType::kBF16;
  m.activation = Activation::kSwiGLU;
  m.tied_embeddings = false;
  return m;
}

std::vector<ModelSpec> presets() {
  // Hyper-parameters as published: GPT-3 (Brown et al. 2020, Table 2.1; 1.3B uses 16 heads of
  // 128 so that heads divide hidden), Llama 2 (Touvron et al. 2023), Llama 3 (Meta 2024).
  return {
      gpt("gpt3-125m", 12, 768, 12),
      gpt("gpt3-350m", 24, 1024, 16),
      gpt("gpt3-1.3b", 24, 2048, 16),
      gpt("gpt3-175b", 96, 12288, 96),
      llama("llama2-7b", 32, 4096, 32, 32, 11008, 4096, 32000),
      llama("llama2-70b", 80, 8192, 64, 8, 28672, 4096, 32000),
      llama("llama3-8b", 32, 4096, 32, 8, 14336, 8192, 128256),
      llama("llama3-70b", 80, 8192, 64, 8, 28672, 8192, 128256),
  };
}

}  // namespace

std::optional<ModelSpec> model_preset(const std::string& name) {
  for (auto& m : presets()) {
    if (m.name == name) return m;
  }
  return std::nullopt;
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const auto& m : presets()) names.push_back(m.name);
  return names;
}

const char* to_string(DType dtype) { return dtype == DType::kBF16 ? "bf16" : "fp16"; }
const char* to_string(Activation activation) {
  return activation == Activation::kGelu ? "gelu" : "swiglu";
}

}  // namespace parapilot
