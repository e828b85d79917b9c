// A thin NCCL layer for the live worker on GPUs: one communicator per process over the NCCL C
// API and the CUDA runtime, its unique id exchanged through a key-value store (the worker passes
// c10d's TCPStore), sum and max all-reduces of float32, float16 and int64 buffers that live in
// host memory (the Debian libtorch is CPU-only: the model computes on the CPU and only the
// reduction runs on the GPU, through device buffers; int64 carries the control tensor, so plan
// ids are reduced exactly). Compiled only when CMake finds CUDA and NCCL (PARAPILOT_HAVE_NCCL).
// No libtorch and no CUDA headers here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace parapilot::live {

/// Number of visible CUDA devices (at least 1). kUnavailable saying why when none is usable (no
/// driver, none visible; in a build without CUDA, nccl_missing.cc says that).
StatusOr<int> cuda_device_count();

class NcclComm {
 public:
  using StoreSet = std::function<void(const std::string&, const std::vector<std::uint8_t>&)>;
  using StoreGet = std::function<std::vector<std::uint8_t>(const std::string&)>;
  /// Rank 0 creates the unique id and publishes it under `key`; the others read it. Binds
  /// device `device`. Throws std::runtime_error with NCCL's/CUDA's message on failure.
  NcclComm(int rank, int world, int device, const std::string& key, const StoreSet& set,
           const StoreGet& get, double timeout_s);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  /// Element types a reduction runs in.
  enum class Type { float32, float16, int64 };
  /// In place sum (or max) over ranks of `count` elements of `type` at `host`. Throws
  /// std::runtime_error on failure or after the timeout (the communicator is aborted then).
  void all_reduce(void* host, std::size_t count, Type type, bool max = false);
  /// The same for float32 or, with half = true, float16.
  void all_reduce(void* host, std::size_t count, bool half, bool max = false) {
    all_reduce(host, count, half ? Type::float16 : Type::float32, max);
  }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace parapilot::live
