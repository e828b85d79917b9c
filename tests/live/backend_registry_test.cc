// The collective backend registry (env/live/collective_backends.h): what is registered, and
// the errors for an unknown backend and one not built here (no processes).
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "env/live/collective_backends.h"
#include "tests/test_util.h"

using namespace parapilot::live;
using parapilot::StatusCode;
using parapilot::testing::failure_of;
using parapilot::testing::ok;

TEST_CASE("collective backends: the registry holds gloo, nccl and local with their capabilities") {
  const BackendRegistry& r = collective_backends();
  std::vector<std::string> names;
  for (const BackendInfo& b : r.all()) names.push_back(b.name);
  CHECK(names == std::vector<std::string>{"gloo", "nccl", "local"});
  CHECK(r.selectable_names() == std::vector<std::string>{"gloo", "nccl"});

  const BackendInfo gloo = ok(r.find_built("gloo"));
  CHECK(gloo.kind == BackendKind::gloo);
  CHECK(gloo.device == BackendDevice::cpu);
  CHECK_FALSE(gloo.needs_cuda);
  CHECK(gloo.switches_layouts);
  CHECK(gloo.alone_in_process);
  CHECK(gloo.collectives ==
        std::vector<std::string>{"all_reduce_sum", "all_reduce_max", "all_gather", "broadcast"});

  const BackendInfo nccl = ok(r.find("nccl"));
  CHECK(nccl.kind == BackendKind::nccl);
  CHECK(nccl.device == BackendDevice::cuda);
  CHECK(nccl.needs_cuda);
  CHECK_FALSE(nccl.switches_layouts);
  CHECK_FALSE(nccl.alone_in_process);
  CHECK(nccl.built == nccl.not_built.empty());

  const BackendInfo local = ok(r.find_built("local"));
  CHECK(local.kind == BackendKind::local);
  CHECK_FALSE(local.multi_process);
  CHECK_FALSE(local.selectable);
}

TEST_CASE("collective backends: unknown, unbuilt and unselectable names are errors by name") {
  const BackendRegistry& r = collective_backends();
  const auto unknown = r.find("mpi");
  CHECK(unknown.status().code() == StatusCode::kInvalidArgument);
  CHECK(failure_of(unknown) == "'mpi' is not a collective backend (known: gloo, nccl, local)");
  CHECK(r.find_built("mpi").status().code() == StatusCode::kInvalidArgument);
  CHECK(failure_of(r.find_selectable("local")) ==
        "collective backend 'local' is not chosen by name (choose one of: gloo, nccl)");

  // A backend registered as not built says so by name (nccl in a build without CUDA/NCCL).
  BackendRegistry own;
  BackendInfo missing;
  missing.name = "nccl";
  missing.built = false;
  missing.not_built = "this build has no NCCL (CMake found no CUDA/NCCL)";
  REQUIRE(own.add(missing).ok());
  CHECK(ok(own.find("nccl")).name == "nccl");
  const auto unbuilt = own.find_built("nccl");
  CHECK(unbuilt.status().code() == StatusCode::kRejected);
  CHECK(failure_of(unbuilt) ==
        "collective backend 'nccl' is not built here: this build has no NCCL (CMake found no "
        "CUDA/NCCL)");
  // The process's own nccl entry agrees with the build.
  const BackendInfo nccl = ok(r.find("nccl"));
  if (nccl.built) {
    CHECK(r.find_built("nccl").ok());
  } else {
    CHECK(failure_of(r.find_built("nccl")) ==
          "collective backend 'nccl' is not built here: " + nccl.not_built);
  }

  // Names are unique, and a backend needs one.
  CHECK(own.add(missing).code() == StatusCode::kInvalidArgument);
  CHECK(own.add(BackendInfo{}).code() == StatusCode::kInvalidArgument);
}
