// The worker's process groups (libtorch, c10d): c10d ProcessGroupGloo groups (the world or a
// subgroup over a c10d::PrefixStore of the job's store), the same on our NCCL layer, the
// pipeline's point-to-point transfers, and the boundary's control reduction.
//
// Building a group is a rendezvous of its members in the store: every member must build it, and
// members must build their groups in one common order (layout_groups() gives it) or two ranks
// can wait for each other in different groups. Ranks outside a group skip it.
//
// Thread-safety: a group is used by one thread at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "core/status.h"
#include "env/live/collective_backends.h"
#include "env/live/grad_sync.h"

namespace parapilot::live {

/// Where Gloo binds and how long a collective may take.
struct GroupOptions {
  double timeout_s = 30;                  ///< a collective or transfer taking longer fails.
  std::string master_addr = "127.0.0.1";  ///< loopback here binds Gloo to 127.0.0.1.
};

/// A ProcessGroupGloo of `size` ranks over `store` (the job's store for the world group, a
/// PrefixStore of it for a subgroup); this process is group rank `rank`. Gloo binds to
/// GLOO_SOCKET_IFNAME when set, to 127.0.0.1 when the master is loopback, else to the host's
/// address. kCollectiveFailed with Gloo's reason when the rendezvous fails or times out.
StatusOr<std::unique_ptr<Collectives>> make_gloo_collectives(c10::intrusive_ptr<c10d::Store> store,
                                                             int rank, int size,
                                                             const GroupOptions& options);

/// An NCCL communicator of `size` ranks on CUDA device `device`; its unique id travels through
/// `store`. Reductions copy host tensors through the device: float32, float16 and int64 (the
/// control tensor) are reduced in their own type. kCollectiveFailed on NCCL's or CUDA's error;
/// kRejected naming the backend in a build without NCCL.
StatusOr<std::unique_ptr<Collectives>> make_nccl_collectives(c10::intrusive_ptr<c10d::Store> store,
                                                             int rank, int size, int device,
                                                             double timeout_s);

/// A group of `size` ranks on `backend` (collective_backends.h), as the backend's own factory
/// above makes it; `device` is the CUDA device of a backend that needs CUDA (backend_device).
/// kRejected naming the backend when it is not built here; kInvalidArgument for a local
/// group of more than one rank; else the backend's failure.
StatusOr<std::unique_ptr<Collectives>> make_collectives(const BackendInfo& backend,
                                                        c10::intrusive_ptr<c10d::Store> store,
                                                        int rank, int size,
                                                        const GroupOptions& options, int device);

/// The CUDA device a rank with LOCAL_RANK `local_rank` binds on `backend`: 0 when the backend
/// needs no CUDA, else local_rank modulo the visible devices. kUnavailable with the reason when
/// no device is visible (or the build has no CUDA).
StatusOr<int> backend_device(const BackendInfo& backend, int local_rank);

/// Point-to-point transfers between the ranks of a group (a replica's pipeline stages).
/// Sends do not wait for the receiver, so two neighbours that send to each other before either
/// receives do not deadlock; a step ends with wait_sends(). Messages between two ranks with one
/// tag arrive in the order they were sent.
class PointToPoint {
 public:
  virtual ~PointToPoint() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Starts sending `t` (contiguous; kept alive until it is sent) to group rank `peer`. Sends
  /// of one group are started by one thread at a time; receives may run on another.
  virtual Status send(const at::Tensor& t, int peer, std::uint32_t tag) = 0;
  /// Receives into `t` (contiguous, the sent shape and type) from group rank `peer`; waits at
  /// most the group's timeout. kCollectiveFailed when the peer is gone or the time is up.
  virtual Status recv(at::Tensor& t, int peer, std::uint32_t tag) = 0;
  /// Waits until every started send is done (at most the timeout each).
  virtual Status wait_sends() = 0;
};

/// A Gloo group of `size` ranks used for point-to-point transfers (as make_gloo_collectives).
StatusOr<std::unique_ptr<PointToPoint>> make_gloo_point_to_point(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size, const GroupOptions& options);

/// A subgroup's store: `store` with every key under "parapilot/group/NAME/".
c10::intrusive_ptr<c10d::Store> group_store(c10::intrusive_ptr<c10d::Store> store,
                                            const std::string& name);

/// What all ranks agreed at an iteration boundary.
struct BoundaryDecision {
  std::uint64_t plan_id = 0;  ///< the newest plan any rank saw committed for this step.
  bool stop = false;          ///< some rank asked to stop.
};
/// The boundary's control reduction over the whole world: the maximum of every rank's
/// committed plan id and stop flag, as int64 (plan ids up to 2^63 - 1 survive exactly on every
/// backend). Precondition: plan_id < 2^63. The backend's failure as it came.
StatusOr<BoundaryDecision> agree_at_boundary(Collectives& world, std::uint64_t plan_id, bool stop);

/// What the ranks of the world report after a failed collective.
struct FailureCensus {
  /// The ranks whose mark did not come, as text ("rank 1", "ranks 1, 3"; empty when all
  /// answered), or "rank 0 (the job's store is unreachable)" when the store, which rank 0
  /// hosts, cannot be reached.
  std::string lost;
  /// The notes of the other ranks that answered with one, "rank 1: NOTE; rank 2: NOTE" (empty
  /// when none did).
  std::string notes;
};
/// After a failed collective, which ranks of the world are gone and what the others know: the
/// caller marks itself alive in `store` (key parapilot/alive/<rank>) with `note` (what it knows
/// of the failure, e.g. that its own links were cut; may be empty), then waits up to `wait` for
/// every other rank's mark (each survivor calls this once its own collective fails, which a
/// closed connection makes prompt). When every rank answered, no process is gone: a link
/// between ranks broke or a collective timed out. Rank 0, which hosts the store, returns only
/// once every rank that answered has read the census (or `wait` more has passed), so that its
/// exit does not cut the others' reads short.
FailureCensus take_failure_census(c10d::Store& store, int rank, int world_size,
                                  const std::string& note, std::chrono::milliseconds wait);

}  // namespace parapilot::live
