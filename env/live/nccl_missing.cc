// The NCCL backend in a build without CUDA and NCCL (collective_backends.h registers it as not
// built): every entry point says so by name.
#include "env/live/collective_backends.h"
#include "env/live/collectives.h"
#include "env/live/nccl_comm.h"

namespace parapilot::live {

StatusOr<int> cuda_device_count() {
  return Status::unavailable("this build has no CUDA (CMake found no CUDA/NCCL)");
}

StatusOr<std::unique_ptr<Collectives>> make_nccl_collectives(c10::intrusive_ptr<c10d::Store>, int,
                                                             int, int, double) {
  return collective_backends().find_built("nccl").status();
}

}  // namespace parapilot::live
