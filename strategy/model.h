// ModelSpec: a decoder-only transformer described by its hyper-parameters, and the per-layer
// quantities the cost and memory model derive from them (FLOPs, parameters, activation bytes).
//
// All functions are pure and cheap; ModelSpec is a plain value type, safe to share read-only
// between threads.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace parapilot {

enum class DType { kBF16, kFP16 };
enum class Activation { kGelu, kSwiGLU };

struct ModelSpec {
  std::string name;
  int layers = 0;
  int hidden = 0;
  int heads = 0;
  int kv_heads = 0;    // == heads unless grouped-query attention
  int ffn_hidden = 0;  // == 4 * hidden unless set
  int seq_len = 0;
  int vocab = 0;
  DType dtype = DType::kBF16;
  Activation activation = Activation::kGelu;  // kSwiGLU: gated MLP with three matrices
  bool tied_embeddings = true;                // output layer shares the input embedding

  int head_dim() const { return hidden / heads; }
  // Width of the K and V projections together: 2 * kv_heads * head_dim.
  int64_t kv_width() const { return 2LL * kv_heads * head_dim(); }

  // Parameters of one transformer block (attention + MLP + norms), all tensor-parallel ranks.
  int64_t params_per_layer() const;
  // Parameters of the input embedding (vocab * hidden, plus learned positions for GPT-style).
  int64_t embedding_params() const;
  // Parameters of the output projection when not tied (0 when tied).
  int64_t output_params() const;
  int64_t total_params() const;

  // Forward FLOPs per token of one transformer block at sequence length seq (matmuls only).
  double block_forward_flops_per_token(int seq) const;
  // Forward FLOPs per token of the output logits projection.
  double logits_forward_flops_per_token() const;
};

// Model FLOPs of one training iteration over global_batch sequences, counting a forward pass
// and a backward pass (2x forward), plus one extra forward of every block when recompute_full.
// With recompute_full and a GPT model this is the SC'21 formula
//   96 B s l h^2 (1 + s/(6h) + V/(16 l h)).
double iteration_model_flops(const ModelSpec& model, int global_batch, bool recompute_full);

// Named presets: gpt3-1.3b, gpt3-175b, llama2-7b, llama2-70b, llama3-8b, llama3-70b.
std::optional<ModelSpec> model_preset(const std::string& name);
std::vector<std::string> model_preset_names();

const char* to_string(DType dtype);
const char* to_string(Activation activation);

}  // namespace parapilot
