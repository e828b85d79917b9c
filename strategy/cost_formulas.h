// The closed-form pieces that the cost model and the planner's bounds share: ring collective
// times and the bytes each parameter occupies. One definition, included by both, so that a
// bound can never drift from the model it bounds. Formulas and sources: docs/cost-model.md.
//
// Pure inline functions and constants; safe from any thread.
#pragma once

#include "strategy/model.h"

namespace parapilot {

// Ring all-reduce of `bytes` over n ranks: 2(n-1) steps of latency_s, each rank sending and
// receiving 2(n-1)/n of the buffer at bw_Bps (nccl-tests' busbw convention). 0 for n <= 1 or
// an empty buffer.
inline double ring_allreduce_s(int n, double bytes, double bw_Bps, double latency_s) {
  if (n <= 1 || bytes <= 0) return 0;
  return 2.0 * (n - 1) * latency_s + 2.0 * (n - 1) / n * bytes / bw_Bps;
}

// Ring all-gather or reduce-scatter where `bytes` is the full (gathered) size: half of an
// all-reduce.
inline double ring_gather_s(int n, double bytes, double bw_Bps, double latency_s) {
  if (n <= 1 || bytes <= 0) return 0;
  return (n - 1) * latency_s + static_cast<double>(n - 1) / n * bytes / bw_Bps;
}

// Exposed time of one tensor-parallel collective of collective_s seconds. Plain: all of it.
// Overlapped (Transformer Engine's userbuffers, Megatron's tp_comm_overlap): the collective is
// cut into tp chunks pipelined with the GEMM it feeds or drains (paired_gemm_s); the first
// chunk cannot hide, and the rest hides as far as the GEMM lasts.
inline double exposed_tp_collective_s(double collective_s, int tp, bool overlap,
                                      double paired_gemm_s) {
  if (!overlap || tp <= 1) return collective_s;
  const double first_chunk = collective_s / tp;
  const double beyond_gemm = collective_s - paired_gemm_s;
  return first_chunk > beyond_gemm ? first_chunk : beyond_gemm;
}

// Exposed ring-attention time of one transformer block and microbatch (context parallelism):
// each of the cp - 1 steps passes a key/value block to the next context rank, forward in
// fwd_step_s and, with its gradients, backward in bwd_step_s, under the attention kernel of
// the block that arrived before it (attention_*_s for the whole block at nominal speed, times
// `slow`, split cp ways); what the attention cannot hide is exposed. Full recompute repeats the
// forward ring. 0 for cp <= 1.
inline double exposed_cp_ring_s(int cp, double fwd_step_s, double bwd_step_s,
                                double attention_fwd_s, double attention_bwd_s, double slow,
                                bool full_recompute) {
  if (cp <= 1) return 0;
  const double steps = cp - 1;
  const double fwd_hidden = fwd_step_s - attention_fwd_s * slow / cp;
  const double bwd_hidden = bwd_step_s - attention_bwd_s * slow / cp;
  const double fwd = steps * (fwd_hidden > 0 ? fwd_hidden : 0.0);
  const double bwd = steps * (bwd_hidden > 0 ? bwd_hidden : 0.0);
  return (full_recompute ? 2.0 : 1.0) * fwd + bwd;
}

// Bytes per parameter held on a GPU (Megatron-LM's accounting): 16-bit weights; fp32 master
// weights and Adam's two moments; the gradient buffer, fp32 for bf16 models (accumulated and
// reduced in fp32) and fp16 for fp16 models.
inline constexpr double kWeightBytesPerParam = 2.0;
inline constexpr double kOptimizerBytesPerParam = 12.0;
inline double grad_bytes_per_param(const ModelSpec& model) {
  return model.dtype == DType::kBF16 ? 4.0 : 2.0;
}

}  // namespace parapilot
