#include "env/live/nccl_comm.h"

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include <cuda_runtime.h>
#include <nccl.h>

namespace parapilot::live {

namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(r));
}

}  // namespace

StatusOr<int> cuda_device_count() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess)
    return Status::unavailable(std::string("no usable GPU: ") + cudaGetErrorString(e));
  if (n == 0) return Status::unavailable("no GPU visible (cudaGetDeviceCount = 0)");
  return n;
}

struct NcclComm::Impl {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  void* device_buffer = nullptr;
  std::size_t device_bytes = 0;
  double timeout_s = 30;
};

NcclComm::NcclComm(int rank, int world, int device, const std::string& key, const StoreSet& set,
                   const StoreGet& get, double timeout_s)
    : impl_(std::make_unique<Impl>()) {
  impl_->timeout_s = timeout_s;
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  ncclUniqueId id;
  if (rank == 0) {
    check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    std::vector<std::uint8_t> bytes(sizeof id.internal);
    std::memcpy(bytes.data(), id.internal, sizeof id.internal);
    set(key, bytes);
  } else {
    const std::vector<std::uint8_t> bytes = get(key);
    if (bytes.size() != sizeof id.internal) throw std::runtime_error("bad NCCL unique id in store");
    std::memcpy(id.internal, bytes.data(), sizeof id.internal);
  }
  check_cuda(cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking), "cudaStreamCreate");
  check_nccl(ncclCommInitRank(&impl_->comm, world, id, rank), "ncclCommInitRank");
}

NcclComm::~NcclComm() {
  if (impl_->comm) ncclCommDestroy(impl_->comm);
  if (impl_->device_buffer) cudaFree(impl_->device_buffer);
  if (impl_->stream) cudaStreamDestroy(impl_->stream);
}

void NcclComm::all_reduce(void* host, std::size_t count, Type type, bool max) {
  const std::size_t bytes = count * (type == Type::float16 ? 2 : type == Type::int64 ? 8 : 4);
  const ncclDataType_t wire = type == Type::float16 ? ncclFloat16
                              : type == Type::int64 ? ncclInt64
                                                    : ncclFloat32;
  if (bytes > impl_->device_bytes) {
    if (impl_->device_buffer) check_cuda(cudaFree(impl_->device_buffer), "cudaFree");
    check_cuda(cudaMalloc(&impl_->device_buffer, bytes), "cudaMalloc");
    impl_->device_bytes = bytes;
  }
  check_cuda(
      cudaMemcpyAsync(impl_->device_buffer, host, bytes, cudaMemcpyHostToDevice, impl_->stream),
      "cudaMemcpyAsync");
  check_nccl(ncclAllReduce(impl_->device_buffer, impl_->device_buffer, count,
                           wire, max ? ncclMax : ncclSum, impl_->comm,
                           impl_->stream),
             "ncclAllReduce");
  check_cuda(
      cudaMemcpyAsync(host, impl_->device_buffer, bytes, cudaMemcpyDeviceToHost, impl_->stream),
      "cudaMemcpyAsync");
  // Poll instead of blocking so that a dead peer fails the call after the timeout.
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(impl_->timeout_s);
  while (true) {
    const cudaError_t e = cudaStreamQuery(impl_->stream);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) check_cuda(e, "NCCL all-reduce");
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(impl_->comm, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      ncclCommAbort(impl_->comm);
      impl_->comm = nullptr;
      check_nccl(async, "NCCL all-reduce");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      ncclCommAbort(impl_->comm);
      impl_->comm = nullptr;
      throw std::runtime_error("NCCL all-reduce timed out (a peer died or hangs)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace parapilot::live
