// Flash attention, context parallelism and FP8 in the cost and memory model.
#include <doctest/doctest.h>

#include "strategy/cost_model.h"
#include "strategy/planner.h"
#include "strategy/spec_io.h"
#include "tests/test_util.h"

using namespace parapilot;
using parapilot::testing::ok;

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

Strategy parse(const std::string& text, const ModelSpec& m, const ClusterSpec& c) {
  return ok(load_strategy(text, m, c));
}

}  // namespace

TEST_CASE("flash attention stores no s^2 scores: llama3-8b at 8192 tokens fits on 8 h100 at tp 2") {
  const ModelSpec m = *model_preset("llama3-8b");  // seq_len 8192
  const ClusterSpec c = *cluster_preset("8xh100");
  const CostModel cost(m, c);
  const Strategy flash = parse("tp=2,sp=true,global_batch=8,zero=1", m, c);
  Strategy unfused = flash;
  unfused.attention = Attention::kUnfused;
  const MemoryBreakdown mf = cost.memory(flash, 0, 0);
  const MemoryBreakdown mu = cost.memory(unfused, 0, 0);
  // Per block and microbatch the scores cost 5 a s^2 b / t bytes unfused; flash keeps
  // 4 a s b / t bytes of softmax statistics instead. Rank 0 of a 1F1B pipeline of depth 1 holds one
  // microbatch of all 32 blocks.
  const double a = m.heads, s = m.seq_len, t = 2;
  const double per_block_difference = (5 * a * s * s - 4 * a * s) / t;
  CHECK((mu.activations_gib - mf.activations_gib) * kGiB ==
        doctest::Approx(m.layers * per_block_difference));
  CHECK(cost.evaluate(flash).fits_in_memory);
  CHECK_FALSE(cost.evaluate(unfused).fits_in_memory);
  // No s^2 HBM traffic: the flash block is faster at this length.
  CHECK(cost.evaluate(flash).compute_s < cost.evaluate(unfused).compute_s);
}

TEST_CASE("context parallelism halves activations and shards the optimizer over dp x cp") {
  const ModelSpec m = *model_preset("llama3-70b");
  const ClusterSpec c = *cluster_preset("2x8xh100");
  const CostModel cost(m, c);
  const Strategy cp1 = parse("tp=4,pp=2,global_batch=16,zero=1,sp=true", m, c);
  const Strategy cp2 = parse("tp=4,pp=2,cp=2,global_batch=16,zero=1,sp=true", m, c);
  REQUIRE(cp1.dp == 2);
  REQUIRE(cp2.dp == 1);
  for (int p = 0; p < 2; ++p) {
    const MemoryBreakdown m1 = cost.memory(cp1, 0, p);
    const MemoryBreakdown m2 = cost.memory(cp2, 0, p);
    // Every activation term is linear in the tokens a rank holds (no s^2 term with flash).
    CHECK(m2.activations_gib == doctest::Approx(m1.activations_gib / 2));
    // The distributed optimizer shards over the dp x cp ranks that hold the same weights.
    CHECK(m2.optimizer_gib == doctest::Approx(m1.optimizer_gib));
    CHECK(m2.weights_gib == doctest::Approx(m1.weights_gib));
  }
  // A rank computes half of the sequence: its per-microbatch compute roughly halves, and
  // with dp*cp fixed the iteration takes about as long.
  const CostBreakdown b1 = cost.evaluate(cp1), b2 = cost.evaluate(cp2);
  CHECK(b2.iteration_time_s == doctest::Approx(b1.iteration_time_s).epsilon(0.25));
}

TEST_CASE("ring attention hides inside a node and shows across a congested network") {
  const ModelSpec m = *model_preset("llama3-8b");
  const ClusterSpec c = *cluster_preset("2x8xh100");
  const CostModel cost(m, c);
  const Strategy inside = parse("tp=4,cp=2,global_batch=8", m, c);  // cp pairs in one node
  const Strategy across = parse("tp=8,cp=2,global_batch=8", m, c);  // cp pairs span nodes
  CHECK(inside.gpu_of_rank(0, 0, 0, 1) == 4);
  CHECK(across.gpu_of_rank(0, 0, 0, 1) == 8);
  // Nominal links: NVLink hides entirely under the attention, the network nearly.
  CHECK(cost.evaluate(inside).cp_comm_s == 0);
  const CostBreakdown nominal = cost.evaluate(across);
  CHECK(nominal.cp_comm_s < 0.01 * nominal.iteration_time_s);
  Conditions congested;
  congested.node_inter_bw = {0.01, 0.01};
  const CostBreakdown in_b = cost.evaluate(inside, congested);
  const CostBreakdown across_b = cost.evaluate(across, congested);
  CHECK(in_b.cp_comm_s == 0);
  CHECK(across_b.cp_comm_s > 10 * nominal.cp_comm_s);
  CHECK(across_b.cp_comm_s < across_b.iteration_time_s);
  // The parts still add up.
  CHECK(across_b.iteration_time_s ==
        doctest::Approx(across_b.compute_s + across_b.recompute_s + across_b.tp_comm_s +
                        across_b.cp_comm_s + across_b.pp_comm_s + across_b.bubble_s +
                        across_b.dp_comm_s + across_b.optimizer_s));
  // The class-sharing evaluation agrees with the replica-by-replica reference.
  CHECK(cost.evaluate_exhaustive(across, congested).iteration_time_s == across_b.iteration_time_s);
}

TEST_CASE("fp8 runs GEMMs at the FP8 peak, keeps FP8 weight copies, and needs Hopper") {
  const ModelSpec m = *model_preset("llama2-70b");
  const ClusterSpec h100 = *cluster_preset("2x8xh100");
  CHECK(gpu_type("h100")->fp8_tflops == 1979);
  CHECK(gpu_type("h800")->fp8_tflops == 1979);
  CHECK(gpu_type("h200")->fp8_tflops == 1979);
  CHECK(gpu_type("a100-80g")->fp8_tflops == 0);
  const CostModel cost(m, h100);
  const Strategy bf16 = parse("tp=8,pp=2,global_batch=64,zero=1,sp=true", m, h100);
  Strategy fp8 = bf16;
  fp8.fp8 = true;
  REQUIRE_FALSE(find_problem(fp8, m, h100));
  const CostBreakdown b = cost.evaluate(bf16), f = cost.evaluate(fp8);
  // Faster, but less than twice: attention, norms, casts and the logits stay as they were.
  CHECK(f.compute_s < 0.8 * b.compute_s);
  CHECK(f.compute_s > 0.5 * b.compute_s);
  // bf16 parameters, fp32 master weights and gradients, plus the FP8 copy and transpose.
  const MemoryBreakdown mb = cost.memory(bf16, 0, 0), mf = cost.memory(fp8, 0, 0);
  CHECK(mf.gradients_gib == mb.gradients_gib);
  CHECK(mf.optimizer_gib == mb.optimizer_gib);
  CHECK((mf.weights_gib - mb.weights_gib) * kGiB ==
        doctest::Approx(40.0 * static_cast<double>(m.params_per_layer()) / 8 * 2.0));

  const ClusterSpec a100 = *cluster_preset("2x8xa100-80g");
  Strategy on_a100 = parse("tp=8,pp=2,global_batch=64", m, a100);
  on_a100.fp8 = true;
  const auto problem = find_problem(on_a100, m, a100);
  REQUIRE(problem);
  CHECK(problem->key == "fp8");
  CHECK(problem->reason.find("a100-80g") != std::string::npos);
}

TEST_CASE("the planner searches cp, and a space restricted to cp = 1 gets none") {
  // llama3-8b at 32k tokens on 2 nodes of 8 h100: long sequences are what cp is for.
  ModelSpec m = *model_preset("llama3-8b");
  m.seq_len = 32768;
  const ClusterSpec c = *cluster_preset("2x8xh100");
  const Planner planner(m, c);
  PlanRequest open;
  open.space.global_batch = 16;
  open.top_k = 5;
  const PlanResult any = planner.plan(open);
  REQUIRE_FALSE(any.candidates.empty());
  bool some_cp = false;
  for (const Candidate& cand : any.candidates) {
    some_cp = some_cp || cand.strategy.cp > 1;
    CHECK_FALSE(find_problem(cand.strategy, m, c));
    CHECK(cand.cost.fits_in_memory);
    CHECK(cand.cost.iteration_time_s ==
          doctest::Approx(planner.cost_model().evaluate(cand.strategy).iteration_time_s));
  }
  CHECK(some_cp);
  PlanRequest no_cp = open;
  no_cp.space.cp = {1};
  const PlanResult without = planner.plan(no_cp);
  for (const Candidate& cand : without.candidates) CHECK(cand.strategy.cp == 1);
  // The unrestricted search can only do as well or better.
  if (!without.candidates.empty()) {
    CHECK(any.candidates[0].cost.tokens_per_s >=
          without.candidates[0].cost.tokens_per_s * (1 - 1e-9));
  }
}

TEST_CASE("the planner runs context-parallel rings across nodes, each tensor-parallel group in one") {
  // llama3-8b at 128k tokens on 4 nodes of 8 h100: a sequence that long needs more context
  // ranks than a node holds next to its tensor-parallel group.
  ModelSpec m = *model_preset("llama3-8b");
  m.seq_len = 131072;
  const ClusterSpec c = *cluster_preset("4x8xh100");
  const Planner planner(m, c);
  const ClusterTopology& topo = planner.cost_model().topology();
  PlanRequest req;
  req.space.global_batch = 4;
  req.space.tp = {4, 8};
  req.top_k = 5;
  const PlanResult r = planner.plan(req);
  REQUIRE_FALSE(r.candidates.empty());
  bool across = false;
  for (const Candidate& cand : r.candidates) {
    const Strategy& s = cand.strategy;
    CAPTURE(s.tp);
    CAPTURE(s.cp);
    CHECK_FALSE(find_problem(s, m, c));
    CHECK(cand.cost.fits_in_memory);
    CHECK(cand.cost.iteration_time_s ==
          doctest::Approx(planner.cost_model().evaluate(s).iteration_time_s));
    for (int d = 0; d < s.dp; ++d)
      for (int p = 0; p < s.pp; ++p)
        for (int k = 0; k < s.cp; ++k) {
          const int node = topo.node_of_gpu[s.gpu_of_rank(d, p, 0, k)];
          for (int t = 1; t < s.tp; ++t) CHECK(topo.node_of_gpu[s.gpu_of_rank(d, p, t, k)] == node);
          across = across || node != topo.node_of_gpu[s.gpu_of_rank(d, p, 0, 0)];
        }
  }
  auto shape = [](const Candidate& cand) {
    const Strategy& s = cand.strategy;
    return "tp " + std::to_string(s.tp) + " cp " + std::to_string(s.cp) + " pp " +
           std::to_string(s.pp) + " dp " + std::to_string(s.dp) + ": " +
           std::to_string(cand.cost.tokens_per_s) + " tokens/s";
  };
  MESSAGE("best: " << shape(r.candidates[0]));
  CHECK(across);
  // Keeping each stage inside a node (tp x cp <= 8) costs throughput at this length: the
  // context ranks a node holds leave too little memory for a microbatch, or too little room to
  // hide the ring behind attention.
  double inside = 0;
  for (const auto& [tp, cps] : {std::pair{4, std::vector<int>{1, 2}}, {8, std::vector<int>{1}}}) {
    PlanRequest in_node = req;
    in_node.space.tp = {tp};
    in_node.space.cp = cps;
    const PlanResult p = planner.plan(in_node);
    if (p.candidates.empty()) continue;
    MESSAGE("best with tp " << tp << " inside a node: " << shape(p.candidates[0]));
    inside = std::max(inside, p.candidates[0].cost.tokens_per_s);
  }
  CHECK(r.candidates[0].cost.tokens_per_s > inside);
}
