// The plan name: the text PlanPrepare::layout_name carries next to the structured Layout, typed.
// One encoder and one decoder (Python mirror: python/parapilot/plan_name.py; both replay
// tests/data/plan_name/). Two kinds of text ride in that field, and the codec tells them apart:
//
//  - a layout name, what `parapilot deploy` sends: a head "dp8-tp2-pp1-mb1[-sp][-vV]-zZ[-elastic]"
//    then optional fields ";sc=gpipe|1f1b|interleaved", ";rc=none|selective|full",
//    ";st=16,16" (stage boundaries), ";sh=33*7,29" (samples per replica, run-length coded) and
//    ";g=0-2,4-15,3" (device map as ranges), in that order when encoded;
//  - an action text, what `parapilot launch`'s builtin agent sends: "keep", or fields
//    "s=0.75/0.25" (shares), "c=2n1p27h" (per-layer compression runs: n none, h fp16, t top-k,
//    p PowerSGD), "k=0.01", "r=4", "b=1048576", "m=2", "l=dp=1,pp=4,stages=[1,3]" (layout).
//
// The kind tag is the text's first field, which every reader (old and new) reads the same way:
// "keep" or a one-letter key followed by '=' is an action text; "dp" and a digit a layout name;
// anything else (no ';', no '=') a label for logs that carries nothing (the structured Layout
// alone; "" or "scripted"). The texts are the ones the project has always sent; nothing on the
// wire changed with this codec.
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "core/status.h"
#include "transport/messages.h"

namespace parapilot::transport {

/// A planner layout by name: what the wire Layout lacks (deploy's plans).
struct LayoutPlanName {
  int dp = 1, tp = 1, pp = 1;            ///< degrees, >= 1.
  int microbatch = 1;                    ///< sequences per microbatch, >= 1.
  bool sp = false;                       ///< sequence parallelism ("-sp").
  int virtual_stages = 1;                ///< interleaved chunks per stage ("-vV" when > 1), >= 1.
  int zero = 0;                          ///< ZeRO stage ("-zZ"), 0..3.
  bool elastic = false;                  ///< "-elastic": the log form's mark of per-replica shares.
  std::optional<std::string> schedule;   ///< "sc": "gpipe", "1f1b" or "interleaved".
  std::optional<std::string> recompute;  ///< "rc": "none", "selective" or "full".
  std::vector<int> stage_layers;         ///< "st": layers per stage, each >= 0; empty: absent.
  std::vector<int> dp_shares;            ///< "sh": samples per replica, each >= 1; empty: absent.
  std::vector<int> gpus;  ///< "g": GPU of each replica/rank, each >= 0; empty: absent.

  bool operator==(const LayoutPlanName&) const = default;
};

/// A live action (launch's builtin agent). Empty vectors and zero values mean "keep".
struct ActionPlanName {
  std::vector<double> shares;  ///< "s": per-rank shares, each >= 0, normalised to sum 1.
  std::vector<CompressionMethod> compression;  ///< "c": per-layer method.
  double topk_ratio = 0;                       ///< "k": in (0, 1]; 0 keeps.
  int powersgd_rank = 0;                       ///< "r": in [1, 1024]; 0 keeps.
  std::int64_t bucket_bytes = -1;              ///< "b": >= 0; -1 keeps.
  int microbatch = 0;                          ///< "m": >= 1; 0 keeps.
  std::string layout;  ///< "l": a layout in --layout's form, without ';'; empty keeps.

  bool operator==(const ActionPlanName&) const = default;
};

/// A label for logs ("", "scripted"): the plan is its structured Layout alone. Holds no ';' or
/// '=', and is neither "keep" nor starts with "dp" and a digit.
struct LabelPlanName {
  std::string label;

  bool operator==(const LabelPlanName&) const = default;
};

using PlanName = std::variant<LabelPlanName, LayoutPlanName, ActionPlanName>;

/// Which kind `text` is read as (its first field; see the header comment). The rest is not
/// checked: decode_plan_name does that.
enum class PlanNameKind { label, layout, action };
PlanNameKind plan_name_kind(std::string_view text);

/// The text of `name`, at most kMaxNameBytes. kInvalidArgument when it would be longer (too
/// many ranks or too fragmented a plan) or a field cannot be written (an action layout holding
/// ';', a schedule or recompute not among those named, a label another kind would claim).
StatusOr<std::string> encode_plan_name(const PlanName& name);

/// Parses encode_plan_name's text. kInvalidArgument naming the field ("live action '...': k
/// must be in (0, 1]", "layout name '...': sh: ...") on malformed text.
StatusOr<PlanName> decode_plan_name(std::string_view text);

}  // namespace parapilot::transport
