// The names of Telemetry's entries and what each one holds: the one place that knows them (its
// Python mirror is python/parapilot/telemetry_keys.py; both replay the vectors in
// tests/data/telemetry_keys/).
//
// Two kinds of entry:
//  - timings, in Telemetry::collectives: a collective or a phase of the step; ms, bytes and
//    calls mean what they say. Their keys are the constants below ("all_reduce/dp", "wait/dp",
//    "phase/optimizer", ...); a writer fills the CollectiveStat itself.
//  - facts ("info/..."): one number about the step, not a collective. Whole numbers live in
//    Telemetry::counts, real numbers (the loss, a pipeline block's compute) in
//    Telemetry::measures; the accessors below read and write them.
//
// Thread-safety: constants and pure functions on the Telemetry passed in.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "transport/messages.h"

namespace parapilot::transport::telemetry_keys {

// Timings of collectives: "<collective>/<group>".
inline constexpr char kAllReduceDp[] = "all_reduce/dp";  ///< gradient all-reduce.
inline constexpr char kAllGatherDp[] = "all_gather/dp";  ///< gradient all-gather (top-k).
inline constexpr char kAllReduceDpInter[] = "all_reduce/dp/inter";  ///< its inter-node part.
inline constexpr char kAllReduceTp[] = "all_reduce/tp";            ///< tensor-parallel all-reduces.
inline constexpr char kP2pPp[] = "p2p/pp";                         ///< pipeline sends and receives.
inline constexpr char kAllReduceControl[] = "all_reduce/control";  ///< control and loss.
/// Cycle start to the last gradient bucket ready (the Python client's hooks).
inline constexpr char kArriveDp[] = "arrive/dp";
inline constexpr char kBroadcastBuffers[] = "broadcast/buffers";  ///< DDP's buffer broadcast.
// Waits: time the rank was blocked for its peers.
inline constexpr char kWaitDp[] = "wait/dp";        ///< in the gradient collectives.
inline constexpr char kWaitOther[] = "wait/other";  ///< in the step's other collectives.
// Phases of the step (ms; calls = 1).
inline constexpr char kPhaseForward[] = "phase/forward";
inline constexpr char kPhaseBackward[] = "phase/backward";
inline constexpr char kPhaseCommWait[] = "phase/comm_wait";
/// The optimizer step: the part of the step not scaling with samples.
inline constexpr char kPhaseOptimizer[] = "phase/optimizer";
/// The step that switched layouts: its pause (ms) and the bytes this rank sent for it (calls 1).
inline constexpr char kSwitchLayout[] = "switch/layout";

// Facts about the step.
inline constexpr char kPlan[] = "info/plan";                  ///< plan id the step ran.
inline constexpr char kSamples[] = "info/samples";            ///< samples this rank processed.
inline constexpr char kMicrobatches[] = "info/microbatches";  ///< microbatches this rank ran.
inline constexpr char kMicrobatchesTotal[] = "info/microbatches_total";  ///< ... all ranks ran.
inline constexpr char kLoss[] = "info/loss";        ///< global loss (a measure).
inline constexpr char kReplica[] = "info/replica";  ///< data-parallel replica (hybrid layouts).
inline constexpr char kStage[] = "info/stage";      ///< pipeline stage (hybrid layouts).
/// A pipeline stage's first block and how many blocks it holds (a pipeline job's blocks are
/// numbered 0..B-1 in the JobInfo's layers order; the stage holds [first, first + blocks)).
inline constexpr char kFirstBlock[] = "info/first_block";
inline constexpr char kBlocks[] = "info/blocks";
/// Prefix of a block's compute (a measure, ms): "info/block_ms/<i>" for block i.
inline constexpr char kBlockMsPrefix[] = "info/block_ms/";

/// True for a fact's key ("info/..."), whose entry is no collective.
bool is_info(std::string_view key);

/// Sets the whole-number fact `key` (one of the info constants above except kLoss) to `value`.
void set_info(Telemetry& t, const char* key, std::uint64_t value);
/// The whole-number fact `key` of `t`; nullopt when `t` does not report it.
std::optional<std::uint64_t> info(const Telemetry& t, const char* key);

/// The global loss of the step, exactly; a non-finite loss (a diverged step) is not reported.
void set_loss(Telemetry& t, double loss);
/// The loss set_loss sent; nullopt when `t` does not report it.
std::optional<double> loss(const Telemetry& t);

/// The key of block `block`'s compute in the step: "info/block_ms/<block>".
std::string block_ms_key(std::size_t block);
/// Block `block`'s compute in the step (forward and backward over all micro-batches), in ms; a
/// non-finite or negative value is not reported.
void set_block_ms(Telemetry& t, std::size_t block, double ms);
/// The compute set_block_ms sent for `block`; nullopt when `t` does not report it.
std::optional<double> block_ms(const Telemetry& t, std::size_t block);

/// Where a rank sits in a hybrid layout: its data-parallel replica and pipeline stage.
void set_replica_and_stage(Telemetry& t, std::uint64_t replica, std::uint64_t stage);

/// The timing entry `key` of `t`; nullptr when absent. The pointer lives as long as the entry.
const CollectiveStat* timing(const Telemetry& t, const char* key);

}  // namespace parapilot::transport::telemetry_keys
