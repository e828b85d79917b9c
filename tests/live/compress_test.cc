// Error-feedback compressors and the bucketed gradient reduction (single process).
#include <ATen/ATen.h>

#include "env/live/grad_sync.h"

// ATen's headers bring glog, whose CHECK would replace doctest's: doctest comes last.
#undef CHECK
#include <doctest/doctest.h>

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
  // A plan for another number of layers is refused, and changes nothing.
  const parapilot::Status refused = sync.configure({Compression::fp16}, 0.1, 2, 1024);
  CHECK(refused.code() == parapilot::StatusCode::kInvalidArgument);
  CHECK(refused.message() == "compression plan has 1 layers; the model has 4");
  REQUIRE(sync.configure({Compression::none, Compression::fp16, Compression::powersgd,
                          Compression::topk},
                         0.1, 2, 1024)
              .ok());
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

TEST_CASE("GradientSync: what a layer owes outlives a change of its compression") {
  at::manual_seed(6);
  auto local = make_local_collectives();
  std::vector<LayerShape> layers{{"a", {40, 30}}, {"b", {500}}};
  GradientSync sync(layers, 1);
  REQUIRE(sync.configure({Compression::topk, Compression::topk}, 0.05, 2, 0).ok());
  CHECK(!sync.owed(0).defined());  // no step yet: nothing owed
  std::vector<at::Tensor> grads{at::randn({40, 30}), at::randn({500})};
  REQUIRE(sync.sync(grads, *local).ok());
  const at::Tensor owed_a = sync.owed(0).clone(), owed_b = sync.owed(1).clone();
  REQUIRE(owed_a.sizes() == at::IntArrayRef({40, 30}));
  CHECK(owed_a.abs().sum().item<float>() > 0);

  // a: top-k -> PowerSGD: the compressor starts from the residual (what it sends plus its new
  // residual is the new gradient plus what was owed). b: top-k -> none: the next dense sync
  // adds what was owed to the gradient, once.
  REQUIRE(sync.configure({Compression::powersgd, Compression::none}, 0.05, 2, 0).ok());
  CHECK(at::equal(sync.owed(0), owed_a));
  CHECK(at::equal(sync.owed(1), owed_b));
  std::vector<at::Tensor> next{at::randn({40, 30}), at::randn({500})};
  const std::vector<at::Tensor> given{next[0].clone(), next[1].clone()};
  REQUIRE(sync.sync(next, *local).ok());
  CHECK(at::allclose(next[0] + sync.owed(0), given[0] + owed_a, 1e-5, 1e-5));
  CHECK(at::equal(next[1], given[1] + owed_b));
  CHECK(!sync.owed(1).defined());  // paid
  std::vector<at::Tensor> third{at::randn({40, 30}), at::randn({500})};
  const at::Tensor third_b = third[1].clone();
  REQUIRE(sync.sync(third, *local).ok());
  CHECK(at::equal(third[1], third_b));  // only once
}

TEST_CASE("GradientSync: owed and PowerSGD's basis set from outside, kept or made afresh") {
  at::manual_seed(7);
  auto local = make_local_collectives();
  std::vector<LayerShape> layers{{"a", {24, 16}}};
  GradientSync sync(layers, 3);
  REQUIRE(sync.configure({Compression::powersgd}, 0.05, 2, 0).ok());
  const at::Tensor owed = at::randn({24, 16}), q = at::randn({16, 2});
  sync.set_owed(0, owed);
  sync.set_basis(0, q);
  CHECK(at::equal(sync.owed(0), owed));
  std::vector<at::Tensor> g{at::randn({24, 16})};
  const at::Tensor given = g[0].clone();
  REQUIRE(sync.sync(g, *local).ok());
  // The compressor took both: its output is the rank-2 projection of (g + owed) onto the
  // basis the given Q starts, and output + residual is g + owed.
  at::Tensor p = (given + owed).mm(q);
  for (std::int64_t i = 0; i < p.size(1); ++i) {
    at::Tensor col = p.narrow(1, i, 1);
    col.div_(col.norm().clamp_min(1e-8));
    if (i + 1 < p.size(1)) {
      at::Tensor rest = p.narrow(1, i + 1, p.size(1) - i - 1);
      rest.sub_(col * (col.t().mm(rest)));
    }
  }
  CHECK(at::allclose(g[0], p.mm((given + owed).t().mm(p).t()), 1e-4, 1e-4));
  CHECK(at::allclose(g[0] + sync.owed(0), given + owed, 1e-5, 1e-5));
  const at::Tensor kept = sync.basis(0).clone();
  // A top-k ratio change keeps the basis (its shape n x rank is the same) ...
  REQUIRE(sync.configure({Compression::powersgd}, 0.2, 2, 0).ok());
  CHECK(at::equal(sync.basis(0), kept));
  std::vector<at::Tensor> g2{at::randn({24, 16})};
  REQUIRE(sync.sync(g2, *local).ok());
  // ... a rank change cannot: the new compressor makes its own, n x 3.
  REQUIRE(sync.configure({Compression::powersgd}, 0.2, 3, 0).ok());
  std::vector<at::Tensor> g3{at::randn({24, 16})};
  REQUIRE(sync.sync(g3, *local).ok());
  CHECK(sync.basis(0).sizes() == at::IntArrayRef({16, 3}));
  // A basis of the wrong shape is not taken.
  GradientSync other(layers, 3);
  REQUIRE(other.configure({Compression::powersgd}, 0.05, 2, 0).ok());
  other.set_basis(0, at::randn({16, 5}));
  std::vector<at::Tensor> g4{at::randn({24, 16})};
  REQUIRE(other.sync(g4, *local).ok());
  CHECK(other.basis(0).sizes() == at::IntArrayRef({16, 2}));
}
