// Cost and memory model: properties that must hold for any sane model, and hand-computed
// memory examples.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "strategy/cost_model.h"
#include "strategy/spec_io.h"

using namespace parapilot;

namespace {

ModelSpec small_gpt() {
  ModelSpec m;
  m.name = "gpt-small";
  m.layers = 4;
  m.hidden = 1024;
  m.heads = 16;
  m.kv_heads = 16;
  m.ffn_hidden = 4096;
  m.seq_len = 1024;
  m.vocab = 32000;
  return m;
}

Strategy layout(int dp, int tp, int pp, int mb, int gb) {
  Strategy s;
  s.dp = dp;
  s.tp = tp;
  s.pp = pp;
  s.microbatch_size = mb;
  s.global_batch = gb;
  return s;
}

double iteration(const ModelSpec& m, const ClusterSpec& c, const Strategy& s,
                 const Conditions& cond = {}) {
  REQUIRE_FALSE(find_problem(s, m, c));
  return CostModel(m, c).evaluate(s, cond).iteration_time_s;
}

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

}  // namespace

TEST_CASE("breakdown parts add up to the iteration time") {
  const ModelSpec m = *model_preset("llama2-7b");
  const ClusterSpec c = *cluster_preset("4x8xa100-80g");
  for (Strategy s : {layout(4, 8, 1, 1, 64), layout(2, 4, 4, 1, 64), layout(32, 1, 1, 1, 64)}) {
    s.recompute = Recompute::kSelective;
    const CostBreakdown b = CostModel(m, c).evaluate(s);
    REQUIRE(b.feasible);
    const double sum = b.compute_s + b.recompute_s + b.tp_comm_s + b.pp_comm_s + b.bubble_s +
                       b.dp_comm_s + b.optimizer_s;
    CHECK(sum == doctest::Approx(b.iteration_time_s).epsilon(1e-9));
    CHECK(b.tokens_per_s == doctest::Approx(64.0 * m.seq_len / b.iteration_time_s));
    CHECK(b.mfu > 0.1);
    CHECK(b.mfu < 0.8);
  }
}

TEST_CASE("more bandwidth or faster GPUs is never slower") {
  const ModelSpec m = *model_preset("llama2-7b");
  const ClusterSpec base = *cluster_preset("4x8xa100-80g");
  const Strategy layouts[] = {layout(4, 8, 1, 1, 64), layout(2, 4, 4, 1, 64),
                              layout(32, 1, 1, 2, 64), layout(1, 8, 4, 1, 32)};
  for (const Strategy& s : layouts) {
    const double t0 = iteration(m, base, s);
    for (double factor : {1.5, 2.0, 8.0}) {
      ClusterSpec faster_net = base;
      for (auto& g : faster_net.groups) g.inter_node_Gbps *= factor;
      CHECK(iteration(m, faster_net, s) <= t0);
      ClusterSpec faster_nvlink = base;
      for (auto& g : faster_nvlink.groups) g.intra_node_GBps *= factor;
      CHECK(iteration(m, faster_nvlink, s) <= t0);
      Conditions quicker;
      quicker.gpu_speed.assign(base.num_gpus(), 1.0);
      for (int g = 0; g < base.num_gpus(); g += 3) quicker.gpu_speed[g] = factor;
      CHECK(iteration(m, base, s, quicker) <= t0);
      Conditions congested;
      congested.node_inter_bw.assign(base.num_nodes(), 1.0);
      congested.node_inter_bw[1] = 1.0 / factor;
      CHECK(iteration(m, base, s, congested) >= t0);
    }
    ClusterSpec hopper = base;
    for (auto& g : hopper.groups) g.gpu = *gpu_type("h100");
    CHECK(iteration(m, hopper, s) < t0);
  }
}

TEST_CASE("a slowed GPU slows its replica, and elastic shares win part of it back") {
  const ModelSpec m = *model_preset("llama2-7b");
  const ClusterSpec c = *cluster_preset("4x8xa100-80g");
  Strategy s = layout(4, 8, 1, 1, 64);
  Conditions slow;
  slow.gpu_speed.assign(32, 1.0);
  slow.gpu_speed[9] = 0.5;  // replica 1
  const double nominal = iteration(m, c, s);
  const double slowed = iteration(m, c, s, slow);
  CHECK(slowed > 1.5 * nominal);
  s.dp_shares = {18, 10, 18, 18};
  const double elastic = iteration(m, c, s, slow);
  CHECK(elastic < slowed);
  CHECK(elastic > nominal);
}

TEST_CASE("failed GPUs make a layout infeasible unless the placement avoids them") {
  const ModelSpec m = *model_preset("llama2-7b");
  const ClusterSpec c = *cluster_preset("2x8xa100-80g");
  Conditions failed;
  failed.gpu_failed.assign(16, false);
  failed.gpu_failed[5] = true;
  const CostModel cost(m, c);
  const CostBreakdown b = cost.evaluate(layout(16, 1, 1, 1, 64), failed);
  CHECK_FALSE(b.feasible);
  CHECK(std::isinf(b.iteration_time_s));
  CHECK(b.reason.find("failed") != std::string::npos);
  Strategy shrunk = layout(1, 8, 1, 1, 64);
  shrunk.gpus = {8, 9, 10, 11, 12, 13, 14, 15};
  REQUIRE_FALSE(find_problem(shrunk, m, c));
  CHECK(cost.evaluate(shrunk, failed).feasible);
}

TEST_CASE("more microbatches never increase the bubble fraction") {
  const ModelSpec m = *model_preset("gpt3-175b");
  const ClusterSpec c = *cluster_preset("8x8xa100-80g");
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved}) {
    double previous = 1.0;
    for (int microbatches = 8; microbatches <= 256; microbatches *= 2) {
      Strategy s = layout(1, 8, 8, 1, microbatches);
      s.recompute = Recompute::kFull;
      s.schedule = schedule;
      if (schedule == Schedule::kInterleaved) s.virtual_stages = 2;
      REQUIRE_FALSE(find_problem(s, m, c));
      const CostBreakdown b = CostModel(m, c).evaluate(s);
      const double fraction = b.bubble_s / b.iteration_time_s;
      CHECK(fraction <= previous);
      CHECK(fraction > 0);
      previous = fraction;
    }
  }
  // Interleaving shrinks the bubble.
  Strategy plain = layout(1, 8, 8, 1, 64);
  plain.recompute = Recompute::kFull;
  Strategy interleaved = plain;
  interleaved.schedule = Schedule::kInterleaved;
  interleaved.virtual_stages = 4;
  CHECK(CostModel(m, c).evaluate(interleaved).bubble_s < CostModel(m, c).evaluate(plain).bubble_s);
}

TEST_CASE("memory grows with microbatch size and shrinks with recompute, sp and ZeRO") {
  const ModelSpec m = *model_preset("llama2-7b");
  const ClusterSpec c = *cluster_preset("2x8xa100-80g");
  const CostModel cost(m, c);
  double previous = 0;
  for (int mb : {1, 2, 4, 8}) {
    const double gib = cost.evaluate(layout(2, 8, 1, mb, 64)).memory_gib;
    CHECK(gib > previous);
    previous = gib;
  }
  Strategy s = layout(2, 8, 1, 4, 64);
  const double none = cost.evaluate(s).memory_gib;
  s.recompute = Recompute::kSelective;
  const double selective = cost.evaluate(s).memory_gib;
  s.recompute = Recompute::kFull;
  const double full = cost.evaluate(s).memory_gib;
  CHECK(selective < none);
  CHECK(full < selective);
  s.recompute = Recompute::kSelective;
  s.sp = true;
  CHECK(cost.evaluate(s).memory_gib < selective);
  Strategy z = layout(16, 1, 1, 1, 64);
  double previous_zero = 1e30;
  for (int zero = 0; zero <= 3; ++zero) {
    z.zero = zero;
    const double gib = cost.evaluate(z).memory_gib;
    CHECK(gib < previous_zero);
    previous_zero = gib;
  }
  // Recompute costs time.
  Strategy r = layout(2, 8, 1, 1, 64);
  const double t_none = cost.evaluate(r).iteration_time_s;
  r.recompute = Recompute::kSelective;
  const double t_selective = cost.evaluate(r).iteration_time_s;
  r.recompute = Recompute::kFull;
  const double t_full = cost.evaluate(r).iteration_time_s;
  CHECK(t_none < t_selective);
  CHECK(t_selective < t_full);
}

TEST_CASE("memory matches a hand computation (GPT block, tp=2, pp=2, 1F1B, no recompute)") {
  // 4 blocks of hidden h=1024, 16 heads, seq s=1024, vocab 32000, microbatch b=2, global 8.
  const ModelSpec m = small_gpt();
  const ClusterSpec c = *cluster_preset("1x8xa100-80g");
  Strategy s = layout(2, 2, 2, 2, 8);
  s.attention = Attention::kUnfused;  // Korthikanti et al. count the stored attention scores
  REQUIRE_FALSE(find_problem(s, m, c));
  const CostModel cost(m, c);

  const double h = 1024, seq = 1024, b = 2, a = 16, t = 2, V = 32000;
  // Parameters: a GPT block has 12h^2 + 13h; the embedding V*h + positions s*h.
  const double block = 12 * h * h + 13 * h;
  const double embedding = V * h + seq * h;
  const double first_params = (2 * block + embedding) / t;  // stage 0: 2 blocks + embedding
  const double last_params = (2 * block + V * h) / t;       // stage 1: 2 blocks + tied copy
  // Korthikanti et al. 2022: per block sbh(10 + 24/t + 5as/(ht)) bytes without recompute.
  const double per_block = seq * b * h * (10 + 24 / t + 5 * a * seq / (h * t));
  // 1F1B: stage 0 holds pp = 2 microbatches of its 2 blocks, stage 1 holds 1.
  const double first_act = 2 * 2 * per_block + 2 * 3 * seq * b * h;  // + embedding output
  const double last_act = 1 * 2 * per_block + 6 * seq * b * V / t;   // + logits and softmax

  const MemoryBreakdown m0 = cost.memory(s, 0, 0);
  CHECK(m0.weights_gib * kGiB == doctest::Approx(2 * first_params));
  CHECK(m0.gradients_gib * kGiB == doctest::Approx(4 * first_params));  // fp32 grads (bf16)
  CHECK(m0.optimizer_gib * kGiB == doctest::Approx(12 * first_params));
  CHECK(m0.activations_gib * kGiB == doctest::Approx(first_act));
  CHECK(m0.reserved_gib == 1.0);
  const MemoryBreakdown m1 = cost.memory(s, 0, 1);
  CHECK(m1.weights_gib * kGiB == doctest::Approx(2 * last_params));
  CHECK(m1.activations_gib * kGiB == doctest::Approx(last_act));

  // ZeRO-1 divides optimizer states by dp; full recompute keeps one 2sbh input per block.
  Strategy z = s;
  z.zero = 1;
  z.recompute = Recompute::kFull;
  const MemoryBreakdown mz = cost.memory(z, 0, 0);
  CHECK(mz.optimizer_gib * kGiB == doctest::Approx(12 * first_params / 2));
  const double full_act = 2 * 2 * (2 * seq * b * h) + per_block + 2 * 3 * seq * b * h;
  CHECK(mz.activations_gib * kGiB == doctest::Approx(full_act));
}

TEST_CASE("on GPUs of different memory sizes the breakdown's footprint and capacity are one "
          "GPU's, the one with the least headroom") {
  // Two stages, the first (the larger footprint: it holds pp microbatches' activations) on a
  // 141 GB h200 node, the second on a 40 GB a100 node.
  const ModelSpec m = *model_preset("llama3-8b");
  const ClusterSpec c = *cluster_preset("1x8xa100-40g+1x8xh200");
  const CostModel cost(m, c);
  Strategy s = layout(1, 8, 2, 4, 64);
  s.zero = 0;
  for (int g = 8; g < 16; ++g) s.gpus.push_back(g);
  for (int g = 0; g < 8; ++g) s.gpus.push_back(g);
  Strategy a100_first = s;
  a100_first.gpus.clear();
  const double h200_stage = cost.evaluate(a100_first).memory_gib;  // that stage on the a100
  const CostBreakdown b = cost.evaluate(s);
  REQUIRE(h200_stage > 40);  // it would not fit on the a100 ...
  CHECK(b.fits_in_memory);   // ... and fits on the h200
  CHECK(b.memory_gib < h200_stage);
  CHECK(b.memory_capacity_gib == 40);
  CHECK(b.memory_gib <= b.memory_capacity_gib);
  // Too large for the a100's stage: the message names that GPU's footprint and capacity.
  s.microbatch_size = 8;
  const CostBreakdown over = cost.evaluate(s);
  CHECK_FALSE(over.fits_in_memory);
  CHECK(over.memory_capacity_gib == 40);
  CHECK(over.memory_gib > 40);
  CHECK(over.memory_gib < cost.evaluate([&] {
    Strategy t = s;
    t.gpus.clear();
    return t;
  }()).memory_gib);
}

TEST_CASE("model FLOPs follow the SC'21 formula") {
  ModelSpec m = small_gpt();
  m.vocab = 51200;
  const double B = 16, s = m.seq_len, l = m.layers, h = m.hidden, V = m.vocab;
  const double expected = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
  CHECK(iteration_model_flops(m, 16, true) == doctest::Approx(expected));
  const double without = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h));
  CHECK(iteration_model_flops(m, 16, false) == doctest::Approx(without));
}

TEST_CASE("mixed GPUs: a stage runs at its slowest member's pace, shares follow speed") {
  const ModelSpec m = *model_preset("llama2-7b");
  const ClusterSpec mixed = *cluster_preset("1x8xa100-80g+1x8xh800");
  const CostModel cost(m, mixed);
  Strategy uniform = layout(2, 8, 1, 1, 64);  // replica 0 on A100s, replica 1 on H800s
  Strategy elastic = uniform;
  elastic.dp_shares = {16, 48};
  CHECK(cost.evaluate(elastic).iteration_time_s < cost.evaluate(uniform).iteration_time_s);
  // A pipeline stage spanning both node types: the A100 stage sets the pace.
  Strategy pipeline = layout(1, 8, 2, 1, 64);
  const ClusterSpec a100 = *cluster_preset("2x8xa100-80g");
  const ClusterSpec h800 = *cluster_preset("2x8xh800");
  const double t_mixed = cost.evaluate(pipeline).iteration_time_s;
  CHECK(t_mixed <= CostModel(m, a100).evaluate(pipeline).iteration_time_s * 1.0001);
  CHECK(t_mixed > CostModel(m, h800).evaluate(pipeline).iteration_time_s);
}

TEST_CASE("compression reduces exposed data-parallel time on a slow network") {
  const ModelSpec m = *model_preset("llama2-7b");
  ClusterSpec c = *cluster_preset("4x8xa100-80g");
  for (auto& g : c.groups) g.inter_node_Gbps = 25;  // a congested fabric
  Strategy s = layout(32, 1, 1, 1, 32);
  s.zero = 1;
  const CostModel cost(m, c);
  const double none = cost.evaluate(s).dp_comm_s;
  s.compression = *parse_compression("fp16");
  const double fp16 = cost.evaluate(s).dp_comm_s;
  s.compression = *parse_compression("powersgd:4");
  const double powersgd = cost.evaluate(s).dp_comm_s;
  CHECK(none > 0);
  CHECK(fp16 < none);
  CHECK(powersgd < fp16);
}

TEST_CASE("balanced stages: every layer placed once, remainder in the middle, as the cost model counts") {
  for (int layers = 1; layers <= 40; ++layers) {
    for (int chunks = 1; chunks <= std::min(layers, 12); ++chunks) {
      Strategy s;
      s.pp = chunks;
      const std::vector<int> counts = s.layers_per_chunk(layers);
      REQUIRE(static_cast<int>(counts.size()) == chunks);
      CHECK(std::accumulate(counts.begin(), counts.end(), 0) == layers);
      const auto [lo, hi] = std::minmax_element(counts.begin(), counts.end());
      CHECK(*hi - *lo <= 1);
    }
  }
}

TEST_CASE("replicas whose context rings cross nodes of different NVLink speeds time apart") {
  // Two replicas, each a stage of two tensor-parallel groups on two nodes (cp = 2): both
  // rings leave node class A, whose network is the slowest they touch, but replica 1's other
  // end has slow NVLink. Its tensor-parallel collectives run at that NVLink, so it must not
  // be timed as replica 0's copy.
  const GpuType h100 = *gpu_type("h100");
  ClusterSpec cluster;
  cluster.name = "rings";
  const double nvlink = h100.nvlink_GBps_bidir / 2;
  cluster.groups.push_back({2, 2, h100, nvlink, 100});  // A: the slowest network
  cluster.groups.push_back({1, 2, h100, nvlink, 400});  // C: fast network, usual NVLink
  cluster.groups.push_back({1, 2, h100, nvlink / 1000, 400});  // B: fast network, slow NVLink
  ModelSpec m = small_gpt();
  m.layers = 8;
  const CostModel cost(m, cluster);
  Strategy s;
  s.tp = 2;
  s.cp = 2;
  s.dp = 2;
  s.microbatch_size = 1;
  s.global_batch = 4;
  s.gpus = {0, 1, 4, 5, 2, 3, 6, 7};  // replica 0 on A and C, replica 1 on A and B
  REQUIRE_FALSE(find_problem(s, m, cluster));
  const CostBreakdown fast = cost.evaluate(s, Conditions{});
  const CostBreakdown ref = cost.evaluate_exhaustive(s, Conditions{});
  CHECK(fast.iteration_time_s == ref.iteration_time_s);
  CHECK(fast.tp_comm_s == ref.tp_comm_s);
  Strategy one = s;
  one.dp = 1;
  one.global_batch = 2;
  one.gpus = {0, 1, 4, 5};
  REQUIRE_FALSE(find_problem(one, m, cluster));
  // The slow NVLink makes a difference: replica 1 is the critical one.
  CHECK(cost.evaluate(one).tp_comm_s < ref.tp_comm_s);
}

TEST_CASE("evaluate() equals the replica-by-replica reference on random layouts and conditions") {
  // evaluate() times one replica per class of identical replicas; evaluate_exhaustive() times
  // every replica and rank. They must agree bit for bit.
  ModelSpec m = small_gpt();
  m.layers = 24;
  const char* clusters[] = {"16x8xa100-80g", "4x8xa100-80g+4x8xh100+4x8xa100-40g",
                            "6x4xv100+2x8xh200+3x8xa100-80g",
                            "3x4xh100+3x4xa100-80g+3x4xh100+3x4xv100",
                            "3x8xh100+4x4xh200"};  // Hopper only: FP8 layouts
  std::mt19937_64 rng(20261129);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  int compared = 0, infeasible = 0, conditioned = 0, context_parallel = 0, fp8 = 0;
  int variants = 0, moved = 0;
  const Compression kinds[] = {{},
                               {Compression::Kind::kFP16, 0, 0},
                               {Compression::Kind::kTopK, 0.01, 0},
                               {Compression::Kind::kPowerSGD, 0, 4}};
  for (const char* name : clusters) {
    const ClusterSpec cluster = *cluster_preset(name);
    const CostModel cost(m, cluster);
    const int gpus = cluster.num_gpus();
    // Every field of the breakdown, bit for bit; true when the layout is feasible.
    auto same_as_reference = [&](const Strategy& s, const Conditions& c, int shape) {
      const CostBreakdown fast = cost.evaluate(s, c);
      const CostBreakdown ref = cost.evaluate_exhaustive(s, c);
      INFO(name, " shape ", shape, "\n", strategy_to_toml(s));
      REQUIRE(fast.feasible == ref.feasible);
      CHECK(fast.reason == ref.reason);
      CHECK(fast.iteration_time_s == ref.iteration_time_s);
      if (!ref.feasible) return false;
      CHECK(fast.compute_s == ref.compute_s);
      CHECK(fast.recompute_s == ref.recompute_s);
      CHECK(fast.tp_comm_s == ref.tp_comm_s);
      CHECK(fast.cp_comm_s == ref.cp_comm_s);
      CHECK(fast.pp_comm_s == ref.pp_comm_s);
      CHECK(fast.bubble_s == ref.bubble_s);
      CHECK(fast.dp_comm_s == ref.dp_comm_s);
      CHECK(fast.optimizer_s == ref.optimizer_s);
      CHECK(fast.memory_gib == ref.memory_gib);
      CHECK(fast.memory_capacity_gib == ref.memory_capacity_gib);
      CHECK(fast.fits_in_memory == ref.fits_in_memory);
      CHECK(fast.model_flops == ref.model_flops);
      CHECK(fast.tflops_per_gpu == ref.tflops_per_gpu);
      CHECK(fast.mfu == ref.mfu);
      CHECK(fast.tokens_per_s == ref.tokens_per_s);
      return true;
    };
    for (int attempt = 0; attempt < 4000; ++attempt) {
      Strategy s;
      s.tp = 1 << pick(4);
      s.pp = std::vector<int>{1, 2, 3, 4, 6, 8}[pick(6)];
      s.cp = chance(0.3) ? 1 << (1 + pick(2)) : 1;
      const int max_dp = gpus / (s.tp * s.pp * s.cp);
      if (max_dp < 1) continue;
      s.dp = 1 + pick(max_dp);
      s.sp = s.tp > 1 && chance(0.5);
      s.microbatch_size = 1 << pick(2);
      s.global_batch = s.dp * s.microbatch_size * (1 + pick(8));
      s.recompute = static_cast<Recompute>(pick(3));
      s.zero = pick(4);
      s.overlap_grad_reduce = chance(0.7);
      s.overlap_param_gather = chance(0.7);
      s.tp_comm_overlap = chance(0.3);
      s.fp8 = chance(0.2);  // refused by find_problem where a GPU lacks FP8
      if (s.cp == 1 && chance(0.3)) s.attention = Attention::kUnfused;
      s.placement = chance(0.5) ? PlacementOrder::kTpPpDp : PlacementOrder::kTpDpPp;
      if (s.pp > 1 && chance(0.3)) {
        s.schedule = Schedule::kInterleaved;
        s.virtual_stages = 2;
      } else if (chance(0.2)) {
        s.schedule = Schedule::kGPipe;
      }
      if (s.pp > 1 && chance(0.3)) {
        // Uneven stages: move one block between two chunks.
        s.stage_layers = s.layers_per_chunk(m.layers);
        const int from = pick(s.num_chunks()), to = pick(s.num_chunks());
        if (s.stage_layers[from] > 1) --s.stage_layers[from], ++s.stage_layers[to];
      }
      if (s.dp > 1 && chance(0.4)) {
        // Elastic shares in a few distinct sizes.
        const int unit = s.microbatch_size;
        s.dp_shares.assign(s.dp, 0);
        int total = 0;
        for (int& share : s.dp_shares) total += share = unit * (1 + pick(3));
        s.global_batch = total;
      }
      s.compression = kinds[pick(4)];
      if (chance(0.2)) s.compression_overrides.push_back({0, 3, kinds[pick(4)]});
      if (chance(0.15)) {
        // An explicit placement: a random choice of GPUs, whole tp groups kept in one node
        // (a stage's cp groups land anywhere).
        std::vector<int> groups(gpus / s.tp);
        std::iota(groups.begin(), groups.end(), 0);
        std::shuffle(groups.begin(), groups.end(), rng);
        for (int i = 0; i < s.dp * s.pp * s.cp; ++i)
          for (int j = 0; j < s.tp; ++j) s.gpus.push_back(groups[i] * s.tp + j);
      }
      if (find_problem(s, m, cluster)) continue;

      Conditions c;
      const int shape = pick(5);  // nominal, slowed, congested, failed, everything at once
      if (shape == 1 || shape == 4 || chance(0.1)) {
        c.gpu_speed.assign(gpus, 1.0);
        for (int k = pick(4); k > 0; --k) c.gpu_speed[pick(gpus)] = 0.3 + 0.6 * chance(0.5);
      }
      if (shape == 2 || shape == 4) {
        c.node_inter_bw.assign(cluster.num_nodes(), 1.0);
        c.node_intra_bw.assign(cluster.num_nodes(), 1.0);
        // Mostly slower links, sometimes faster ones (a node that then no longer sets its
        // group's pace).
        for (int k = pick(3); k > 0; --k)
          c.node_inter_bw[pick(cluster.num_nodes())] = chance(0.7) ? 0.25 : 4.0;
        if (chance(0.5)) c.node_intra_bw[pick(cluster.num_nodes())] = chance(0.7) ? 0.5 : 2.0;
      }
      if (shape == 3 || (shape == 4 && chance(0.3))) {
        c.gpu_failed.assign(gpus, false);
        c.gpu_failed[pick(gpus)] = true;
      }
      conditioned += shape != 0;

      const bool feasible = same_as_reference(s, c, shape);
      infeasible += !feasible;
      context_parallel += s.cp > 1;
      fp8 += s.fp8;
      ++compared;

      // evaluate() keeps the timings of the last strategies and conditions, for the planner's
      // variants of one layout that differ only in ZeRO stage, overlap flags or compression:
      // such a variant, evaluated next, must come out as the reference has it...
      Strategy variant = s;
      variant.zero = pick(4);
      variant.overlap_grad_reduce = chance(0.5);
      variant.overlap_param_gather = chance(0.5);
      variant.compression = kinds[pick(4)];
      variant.compression_overrides.clear();
      if (chance(0.5)) variant.compression_overrides.push_back({1, 2, kinds[pick(4)]});
      // Sometimes a field the timing does read changes too: no kept timing may serve it.
      if (chance(0.2)) variant.tp_comm_overlap = !variant.tp_comm_overlap;
      if (chance(0.2)) variant.recompute = static_cast<Recompute>(pick(3));
      if (!find_problem(variant, m, cluster)) {
        same_as_reference(variant, c, shape);
        ++variants;
      }
      // ... and conditions that differ only in the value of an entry already off nominal must
      // not be served the kept timing.
      Conditions changed = c;
      bool differs = false;
      for (std::vector<double>* factors : {&changed.gpu_speed, &changed.node_inter_bw}) {
        for (double& x : *factors) {
          if (x == 1.0) continue;
          x *= 0.5;
          differs = true;
        }
      }
      if (differs) {
        same_as_reference(s, changed, shape);
        ++moved;
      }
    }
  }
  CHECK(compared > 1000);
  CHECK(infeasible > 20);
  CHECK(conditioned > 500);
  CHECK(context_parallel > 200);
  CHECK(fp8 > 30);
  CHECK(variants > 1000);
  CHECK(moved > 300);
}

TEST_CASE("find_off_nominal lists exactly the GPUs and nodes whose conditions are not nominal") {
  std::mt19937_64 rng(7);
  parapilot::OffNominal found;
  for (int trial = 0; trial < 300; ++trial) {
    // Vectors of unrelated sizes (empty included), mostly nominal, a few entries off.
    parapilot::Conditions c;
    auto size = [&] { return rng() % 4 == 0 ? size_t{0} : static_cast<size_t>(rng() % 200); };
    auto factor = [&] {
      return rng() % 8 == 0 ? 0.25 + 0.25 * static_cast<double>(rng() % 5) : 1.0;
    };
    c.gpu_speed.resize(size());
    for (double& x : c.gpu_speed) x = factor();
    c.gpu_failed.resize(size());
    for (size_t g = 0; g < c.gpu_failed.size(); ++g) c.gpu_failed[g] = rng() % 16 == 0;
    c.node_inter_bw.resize(size());
    for (double& x : c.node_inter_bw) x = factor();
    c.node_intra_bw.resize(size());
    for (double& x : c.node_intra_bw) x = factor();
    parapilot::find_off_nominal(c, found);
    // The definition: every index any vector covers, ascending, off when any entry is.
    std::vector<int> gpus, nodes;
    const size_t gpu_count = std::max(c.gpu_speed.size(), c.gpu_failed.size());
    for (size_t g = 0; g < gpu_count; ++g) {
      const bool slowed = g < c.gpu_speed.size() && c.gpu_speed[g] != 1.0;
      const bool lost = g < c.gpu_failed.size() && c.gpu_failed[g];
      if (slowed || lost) gpus.push_back(static_cast<int>(g));
    }
    const size_t node_count = std::max(c.node_inter_bw.size(), c.node_intra_bw.size());
    for (size_t n = 0; n < node_count; ++n) {
      const bool inter = n < c.node_inter_bw.size() && c.node_inter_bw[n] != 1.0;
      const bool intra = n < c.node_intra_bw.size() && c.node_intra_bw[n] != 1.0;
      if (inter || intra) nodes.push_back(static_cast<int>(n));
    }
    CHECK(found.gpus == gpus);
    CHECK(found.nodes == nodes);
  }
}
