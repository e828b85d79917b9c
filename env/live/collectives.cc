#include "env/live/collectives.h"

#include <algorithm>
#include <cassert>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "env/live/nccl_comm.h"

namespace parapilot::live {

namespace {

std::chrono::milliseconds to_ms(double s) {
  return std::chrono::milliseconds(static_cast<std::int64_t>(s * 1000));
}

// Gloo reports a failed or timed-out operation by throwing; here it becomes a Status.
template <class F>
Status gloo_status(F&& f) {
  try {
    f();
    return {};
  } catch (const c10::Error& e) {
    return Status::collective_failed(std::string("gloo collective failed: ") +
                                     e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Status::collective_failed(std::string("gloo collective failed: ") + e.what());
  }
}

StatusOr<c10::intrusive_ptr<c10d::ProcessGroupGloo>> make_gloo_group(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size, const GroupOptions& o) {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
  const Status st = gloo_status([&] {
    auto opts = c10d::ProcessGroupGloo::Options::create(to_ms(o.timeout_s));
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    else if (o.master_addr == "127.0.0.1" || o.master_addr == "localhost")
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    else
      opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    opts->threads = 1;
    pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  });
  if (!st.ok()) return Status::collective_failed("gloo setup failed: " + st.message());
  return pg;
}

class GlooCollectives final : public Collectives {
 public:
  GlooCollectives(c10::intrusive_ptr<c10d::ProcessGroupGloo> pg, int rank, int size)
      : rank_(rank), size_(size), pg_(std::move(pg)) {}
  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  Status all_reduce_sum(std::vector<at::Tensor>& tensors) override {
    return gloo_status([&] {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (auto& t : tensors) {
        std::vector<at::Tensor> one{t};
        works.push_back(pg_->allreduce(one));
      }
      for (auto& w : works) w->wait();
    });
  }
  Status all_reduce_max(at::Tensor& tensor) override {
    return gloo_status([&] {
      std::vector<at::Tensor> one{tensor};
      c10d::AllreduceOptions o;
      o.reduceOp = c10d::ReduceOp::MAX;
      pg_->allreduce(one, o)->wait();
    });
  }
  StatusOr<std::vector<at::Tensor>> all_gather(const at::Tensor& input) override {
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < size_; ++r) out[0].push_back(at::empty_like(input));
    std::vector<at::Tensor> in{input.contiguous()};
    if (Status st = gloo_status([&] { pg_->allgather(out, in)->wait(); }); !st.ok()) return st;
    return out[0];
  }
  Status broadcast(std::vector<at::Tensor>& tensors) override {
    return gloo_status([&] {
      for (auto& t : tensors) {
        std::vector<at::Tensor> one{t};
        pg_->broadcast(one)->wait();
      }
    });
  }
  std::string backend() const override { return "gloo"; }

 private:
  int rank_, size_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};

class GlooPointToPoint final : public PointToPoint {
 public:
  GlooPointToPoint(c10::intrusive_ptr<c10d::ProcessGroupGloo> pg, int rank, int size,
                   double timeout_s)
      : rank_(rank), size_(size), timeout_(to_ms(timeout_s)), pg_(std::move(pg)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Status send(const at::Tensor& t, int peer, std::uint32_t tag) override {
    assert(t.is_contiguous());
    return gloo_status([&] {
      // Sends that completed are let go (a stream of them is started every step while a
      // switch stages); a failed one stays for wait_sends to report.
      std::erase_if(sends_, [](const c10::intrusive_ptr<c10d::Work>& w) {
        return w->isCompleted() && !w->exception();
      });
      std::vector<at::Tensor> one{t};
      sends_.push_back(pg_->send(one, peer, static_cast<int>(tag)));
    });
  }
  Status recv(at::Tensor& t, int peer, std::uint32_t tag) override {
    assert(t.is_contiguous());
    return gloo_status([&] {
      std::vector<at::Tensor> one{t};
      pg_->recv(one, peer, static_cast<int>(tag))->wait(timeout_);
    });
  }
  Status wait_sends() override {
    const Status st = gloo_status([&] {
      for (auto& w : sends_) w->wait(timeout_);
    });
    sends_.clear();
    return st;
  }

 private:
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  std::vector<c10::intrusive_ptr<c10d::Work>> sends_;
};


}  // namespace

StatusOr<std::unique_ptr<Collectives>> make_gloo_collectives(c10::intrusive_ptr<c10d::Store> store,
                                                             int rank, int size,
                                                             const GroupOptions& options) {
  auto pg = make_gloo_group(std::move(store), rank, size, options);
  if (!pg.ok()) return pg.status();
  return std::unique_ptr<Collectives>(std::make_unique<GlooCollectives>(*pg, rank, size));
}

StatusOr<std::unique_ptr<Collectives>> make_collectives(const BackendInfo& backend,
                                                        c10::intrusive_ptr<c10d::Store> store,
                                                        int rank, int size,
                                                        const GroupOptions& options, int device) {
  if (!backend.built) return collective_backends().find_built(backend.name).status();
  switch (backend.kind) {
    case BackendKind::gloo:
      return make_gloo_collectives(std::move(store), rank, size, options);
    case BackendKind::nccl:
      return make_nccl_collectives(std::move(store), rank, size, device, options.timeout_s);
    case BackendKind::local:
      if (size != 1)
        return Status::invalid_argument("collective backend 'local' holds one rank, not " +
                                        std::to_string(size));
      return make_local_collectives();
  }
  return Status::internal("collective backend '" + backend.name + "' has no factory");
}

StatusOr<int> backend_device(const BackendInfo& backend, int local_rank) {
  if (!backend.needs_cuda) return 0;
  const StatusOr<int> gpus = cuda_device_count();
  if (!gpus.ok()) return gpus.status();
  return local_rank % *gpus;
}

StatusOr<std::unique_ptr<PointToPoint>> make_gloo_point_to_point(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size, const GroupOptions& options) {
  auto pg = make_gloo_group(std::move(store), rank, size, options);
  if (!pg.ok()) return pg.status();
  return std::unique_ptr<PointToPoint>(
      std::make_unique<GlooPointToPoint>(*pg, rank, size, options.timeout_s));
}

c10::intrusive_ptr<c10d::Store> group_store(c10::intrusive_ptr<c10d::Store> store,
                                            const std::string& name) {
  return c10::make_intrusive<c10d::PrefixStore>("parapilot/group/" + name, std::move(store));
}

FailureCensus take_failure_census(c10d::Store& store, int rank, int world_size,
                                  const std::string& note, std::chrono::milliseconds wait) {
  auto key = [](int r) { return "parapilot/alive/" + std::to_string(r); };
  FailureCensus out;
  std::vector<int> missing;
  try {
    // The mark: "1" and the note.
    const std::string mark = "1" + note;
    store.set(key(rank), std::vector<std::uint8_t>(mark.begin(), mark.end()));
    const auto until = std::chrono::steady_clock::now() + wait;
    for (;;) {
      missing.clear();
      for (int r = 0; r < world_size; ++r)
        if (r != rank && !store.check({key(r)})) missing.push_back(r);
      if (missing.empty() || std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    for (int r = 0; r < world_size; ++r) {
      if (r == rank || std::find(missing.begin(), missing.end(), r) != missing.end()) continue;
      const std::vector<std::uint8_t> got = store.get(key(r));
      if (got.size() <= 1) continue;
      out.notes += (out.notes.empty() ? "rank " : "; rank ") + std::to_string(r) + ": " +
                   std::string(got.begin() + 1, got.end());
    }
    // Rank 0 hosts the store: it stays until every rank that answered has read it.
    const auto answered = static_cast<std::int64_t>(world_size - missing.size());
    std::int64_t read = store.add("parapilot/census_read", 1);
    while (rank == 0 && read < answered && std::chrono::steady_clock::now() < until + wait) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      read = store.add("parapilot/census_read", 0);
    }
  } catch (const std::exception&) {
    out.lost = "rank 0 (the job's store is unreachable)";
    return out;
  }
  std::string ranks;
  for (int r : missing) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  if (!missing.empty()) out.lost = (missing.size() == 1 ? "rank " : "ranks ") + ranks;
  return out;
}

StatusOr<BoundaryDecision> agree_at_boundary(Collectives& world, std::uint64_t plan_id, bool stop) {
  assert(plan_id <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()));
  at::Tensor control = at::zeros({2}, at::kLong);
  control[0] = static_cast<std::int64_t>(plan_id);
  control[1] = stop ? 1 : 0;
  if (Status st = world.all_reduce_max(control); !st.ok()) return st;
  BoundaryDecision d;
  d.plan_id = static_cast<std::uint64_t>(control[0].item<std::int64_t>());
  d.stop = control[1].item<std::int64_t>() > 0;
  return d;
}

}  // namespace parapilot::live
