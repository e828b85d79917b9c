// Actions of the live cluster: what the agent can change in a running data-parallel job at an
// iteration boundary, the model's layer layout that per-layer choices refer to, and the
// compression selector. No libtorch here. (The model is model_config.h, injected faults
// fault_spec.h.)
//
// An action travels on the bus inside PlanPrepare.layout_name as a compact text (encode_action /
// decode_action, at most 128 bytes: "s=0.75/0.25;c=2n1p27h;k=0.01;r=4;b=1048576;m=2", a layout
// change as "l=dp=1,tp=1,pp=4,stages=[1,1,1,1]"), because the
// wire format has no richer field yet (docs/live.md, "Actions on the bus"). The text's one
// codec is transport/plan_name.h; these functions map it to and from LiveAction.
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "env/live/model_config.h"
#include "transport/messages.h"

namespace parapilot::live {

/// How one layer's gradient is reduced across data-parallel ranks.
enum class Compression : std::uint8_t {
  none,      ///< float32 all-reduce.
  fp16,      ///< float16 all-reduce (half the bytes, no error feedback needed in practice).
  topk,      ///< top-k magnitudes with error feedback: all-gather of k (value, index) pairs.
  powersgd,  ///< PowerSGD of rank r with error feedback: all-reduce of P (m x r) and Q (n x r).
};
/// "none", "fp16", "topk", "powersgd".
std::string_view compression_name(Compression c);

/// One repartition action of the live data-parallel job. Empty vectors and zero values mean
/// "keep what the worker runs now".
struct LiveAction {
  /// Per-rank batch shares (elastic data parallel), one per rank, each >= 0, summing to 1. Rank r
  /// processes microbatch_counts(shares, microbatches)[r] of the step's microbatches.
  std::vector<double> shares;
  /// Per-layer (per parameter tensor, model order) gradient compression.
  std::vector<Compression> compression;
  double topk_ratio = 0;  ///< fraction of a layer's elements sent by top-k, in (0, 1]; 0 keeps.
  int powersgd_rank = 0;  ///< PowerSGD rank r >= 1; 0 keeps.
  std::int64_t bucket_bytes = -1;  ///< all-reduce bucket size; 0 = one call per layer; -1 keeps.
  int microbatch = 0;              ///< sequences per microbatch (gradient accumulation); 0 keeps.
  /// The layout to switch to, in --layout's form (layout.h parse_layout: "dp=1,pp=4",
  /// "dp=2,tp=1,pp=2,stages=[1,3]"); empty keeps. The worker checks it against its world size
  /// and model. With a new layout, `shares` are per replica of the new layout (empty: equal).
  std::string layout;

  bool operator==(const LiveAction&) const = default;
};

/// Largest text encode_action may produce (PlanPrepare.layout_name limit).
inline constexpr std::size_t kMaxActionTextBytes = 128;

/// Compact text of `a` (see the header comment). kInvalidArgument when it would exceed
/// kMaxActionTextBytes (too many ranks or too fragmented a compression plan).
StatusOr<std::string> encode_action(const LiveAction& a);
/// Parses encode_action's text. kInvalidArgument naming the field on malformed text, or
/// saying so for a text of another kind (a layout name, a label).
StatusOr<LiveAction> decode_action(std::string_view text);

/// True when `name` is read as an action text (encode_action's form, "keep" included) rather
/// than a layout name such as parapilot deploy's "dp8-tp1-pp1-mb1-z1;sc=1f1b;..." or a label:
/// the codec's kind (transport::plan_name_kind), for a command line that takes either.
bool is_action_text(std::string_view name);

/// The action a PlanPrepare asks of this pure data-parallel job of `world_size` ranks whose
/// model has `layers` parameter tensors (docs/live.md, "Plans on the bus"):
///  - layout_name is an action text (launch's builtin agent): that action;
///  - otherwise (parapilot deploy) the structured Layout: dp x tp x pp must be world_size; the
///    action's layout is "dp=D,tp=T,pp=P" plus the stage list of the name's ";st=" field
///    (blocks per stage, agent/deploy/job.cc wire_name) when it has one (the worker checks
///    the rest: tp dividing the heads, stages summing to the blocks). Refused: an interleaved
///    schedule (a "-vN" name with N > 1), or a device map (";g=") other than the rank order
///    when tp or pp > 1. Its dp_shares (samples per replica; empty = equal) become the shares;
///    for pure data parallel, when the name maps replicas to devices (";g=3,0-2": replica i
///    runs on rank g[i]) each rank keeps its device and takes the share of the replica placed
///    there. Compression ranges index the
///    parameter tensors (a top-k fraction or PowerSGD rank applies to the whole job). The
///    Layout's micro_batches count is the agent's model's and is not used.
/// kRejected saying why this job cannot run the plan.
StatusOr<LiveAction> action_from_plan(const transport::PlanPrepare& plan, int world_size,
                                      std::size_t layers);

/// Splits `microbatches` among ranks in proportion to `shares` (largest remainder; ties to the
/// lower rank). Sums to `microbatches`. Preconditions: shares non-empty, finite, >= 0, with a
/// positive sum (what parse_shares and action_from_plan give).
std::vector<int> microbatch_counts(const std::vector<double>& shares, int microbatches);

/// Parses "0.5,0.25,0.25" (or '/'-separated) into shares normalised to sum 1; kInvalidArgument
/// naming the flag.
StatusOr<std::vector<double>> parse_shares(std::string_view text);
/// Parses "none", "fp16", "topk", "powersgd" (or a per-layer comma list); kInvalidArgument.
StatusOr<std::vector<Compression>> parse_compression_list(std::string_view text);

/// One parameter tensor of the model, in the order the worker's model registers them.
struct LayerShape {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t numel() const;
};
/// The model's parameter tensors (the "layers" of per-layer actions and telemetry).
std::vector<LayerShape> model_layers(const ModelConfig& m);

/// What the compression selector looks at for one layer (from telemetry).
struct LayerGradSummary {
  double norm = 0;
  double max_abs = 0;
  std::uint64_t nonfinite = 0;
};
struct SelectorOptions {
  std::int64_t min_elements = 4096;  ///< smaller layers stay uncompressed (cheap, sensitive).
  int powersgd_rank = 4;
  /// PowerSGD where m*n / ((m+n)*r) >= this. The default keeps PowerSGD to large matrices
  /// (a 4096 x 4096 layer at r = 4 saves 512x); on small models (bench_live: 64-wide, savings
  /// ~12x at r = 4) rank-4 factors cost more loss than the 1% budget, and fp16 is chosen.
  double powersgd_min_saving = 32;
  double fp16_max_abs = 1e4;  ///< fp16 only where every |g| is far below 65504.
};
/// Adaptive per-layer compression: small layers none; matrices where rank-r PowerSGD saves at
/// least powersgd_min_saving times the bytes powersgd; other large layers fp16 when their
/// gradients fit fp16 comfortably, else none. A layer with non-finite gradients stays none.
/// `grads` may be empty (no telemetry yet) or have one entry per layer.
std::vector<Compression> select_compression(const std::vector<LayerShape>& layers,
                                            const std::vector<LayerGradSummary>& grads,
                                            const SelectorOptions& options = {});

}  // namespace parapilot::live
