// The NCCL backend's groups (collective_backends.h): host tensors reduced through NcclComm
// (nccl_comm.h). Built only with CUDA and NCCL; nccl_missing.cc stands in otherwise.
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "env/live/collectives.h"
#include "env/live/nccl_comm.h"

namespace parapilot::live {

namespace {

class NcclCollectives final : public Collectives {
 public:
  NcclCollectives(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, int device,
                  double timeout_s)
      : rank_(rank), size_(size) {
    auto set = [store](const std::string& k, const std::vector<std::uint8_t>& v) {
      store->set(k, v);
    };
    auto get = [store](const std::string& k) { return store->get(k); };
    comm_ =
        std::make_unique<NcclComm>(rank, size, device, "parapilot/nccl_id", set, get, timeout_s);
  }
  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  Status all_reduce_sum(std::vector<at::Tensor>& tensors) override {
    for (auto& t : tensors)
      if (Status st = reduce(t, false); !st.ok()) return st;
    return {};
  }
  Status all_reduce_max(at::Tensor& tensor) override { return reduce(tensor, true); }
  StatusOr<std::vector<at::Tensor>> all_gather(const at::Tensor& input) override {
    // All-gather as a sum all-reduce of a zero-padded [world, n] buffer (small top-k payloads).
    at::Tensor buf = at::zeros({size_, input.numel()}, input.options().dtype(at::kFloat));
    buf[rank_].copy_(input.reshape({-1}).to(at::kFloat));
    if (Status st = reduce(buf, false); !st.ok()) return st;
    std::vector<at::Tensor> out;
    for (int r = 0; r < size_; ++r)
      out.push_back(buf[r].to(input.scalar_type()).view(input.sizes()));
    return out;
  }
  Status broadcast(std::vector<at::Tensor>& tensors) override {
    for (auto& t : tensors) {
      if (rank_ != 0) t.zero_();
      if (Status st = reduce(t, false); !st.ok()) return st;
    }
    return {};
  }
  std::string backend() const override { return "nccl"; }

 private:
  // float16 and int64 are reduced in their own type; everything else through float32.
  Status reduce(at::Tensor& t, bool max) {
    const at::ScalarType type = t.scalar_type();
    const NcclComm::Type wire = type == at::kHalf   ? NcclComm::Type::float16
                                : type == at::kLong ? NcclComm::Type::int64
                                                    : NcclComm::Type::float32;
    at::Tensor c = wire == NcclComm::Type::float32 ? t.to(at::kFloat).contiguous() : t.contiguous();
    try {
      comm_->all_reduce(c.data_ptr(), static_cast<std::size_t>(c.numel()), wire, max);
    } catch (const std::exception& e) {
      return Status::collective_failed(e.what());
    }
    if (!c.is_same(t)) t.copy_(c);
    return {};
  }
  int rank_, size_;
  std::unique_ptr<NcclComm> comm_;
};

}  // namespace

StatusOr<std::unique_ptr<Collectives>> make_nccl_collectives(c10::intrusive_ptr<c10d::Store> store,
                                                             int rank, int size, int device,
                                                             double timeout_s) {
  try {
    return std::unique_ptr<Collectives>(
        std::make_unique<NcclCollectives>(store, rank, size, device, timeout_s));
  } catch (const c10::Error& e) {
    return Status::collective_failed(std::string("nccl setup failed: ") +
                                     e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Status::collective_failed(std::string("nccl setup failed: ") + e.what());
  }
}

}  // namespace parapilot::live
