// Error-feedback compressors and the bucketed gradient reduction (single process).
#include <doctest/doctest.h>

#include <ATen/ATen.h>

#include "env/live/grad_sync.h"

using namespace parapilot::live;
using parapilot::StatusOr;

TEST_CASE("top-k: what is sent plus the residual is exactly the gradient plus the old residual") {
  at::manual_seed(3);
  TopKCompressor c(1000, 0.05);
  CHECK(c.k() == 50);
  at::Tensor old_residual = at::zeros({1000});
  for (int step = 0; step < 3; ++step) {
    at::Tensor g = at::randn({1000});
    auto [values, idx] = c.compress(g);
    at::Tensor sent = at::zeros({1000}).index_add_(0, idx, values);
    CHECK(at::allclose(sent + c.residual(), g + old_residual, 0, 0));
    // The residual is zero exactly where elements were sent.
    CHECK(c.residual().index_select(0, idx).abs().max().item<float>() == 0.0f);
    // What is sent are the largest |g + old residual|.
    const float smallest_sent = values.abs().min().item<float>();
    CHECK(c.residual().abs().max().item<float>() <= smallest_sent);
    old_residual = c.residual().clone();
  }
}

TEST_CASE("PowerSGD: the approximation plus the residual is the gradient plus the old residual") {
  at::manual_seed(4);
  auto local = make_local_collectives();
  PowerSgdCompressor c(32, 48, 4, 7);
  at::Tensor old_residual = at::zeros({32, 48});
  for (int step = 0; step < 3; ++step) {
    at::Tensor g = at::randn({32, 48});
    at::Tensor out = g.clone();
    const StatusOr<std::uint64_t> reduced = c.reduce(out, *local);
    REQUIRE(reduced.ok());
    const std::uint64_t bytes = *reduced;
    CHECK(bytes == (32 + 48) * 4 * 4);
    CHECK(at::allclose(out + c.residual(), g + old_residual, 1e-5, 1e-5));
    old_residual = c.residual().clone();
  }
  // A rank-4 matrix is captured fully after warm start (the residual vanishes).
  PowerSgdCompressor exact(32, 48, 4, 9);
  at::Tensor low = at::randn({32, 4}).mm(at::randn({4, 48}));
  for (int step = 0; step < 3; ++step) {
    at::Tensor out = low.clone();
    REQUIRE(exact.reduce(out, *local).ok());
  }
  CHECK(exact.residual().abs().max().item<float>() < 1e-3f);
}

TEST_CASE("GradientSync on one rank: dense layers unchanged, fp16 rounded, bytes counted") {
  at::manual_seed(5);
  std::vector<LayerShape> layers{{"a", {64, 32}}, {"b", {32}}, {"c", {16, 16}}, {"d", {200}}};
  GradientSync sync(layers, 1);
  sync.configure({Compression::none, Compression::fp16, Compression::powersgd, Compression::topk},
                 0.1, 2, 1024);
  std::vector<at::Tensor> grads;
  for (const auto& l : layers) grads.push_back(at::randn(l.shape));
  std::vector<at::Tensor> before;
  for (const auto& g : grads) before.push_back(g.clone());
  auto local = make_local_collectives();
  const StatusOr<SyncStats> synced = sync.sync(grads, *local);
  REQUIRE(synced.ok());
  const SyncStats& s = *synced;
  CHECK(at::equal(grads[0], before[0]));
  CHECK(at::allclose(grads[1], before[1], 1e-3, 1e-3));
  CHECK(s.all_reduce_bytes == 0);  // one rank sends nothing
  CHECK(s.payload_bytes == 64 * 32 * 4 + 32 * 2 + (16 + 16) * 2 * 4 + 20 * (4 + 8));
  CHECK(s.buckets == 1);  // one float32 bucket (layer a) and one float16 bucket (layer b)
  CHECK(ring_all_reduce_bytes(1000, 4) == 1500);
  CHECK(ring_all_gather_bytes(1000, 4) == 3000);
}
