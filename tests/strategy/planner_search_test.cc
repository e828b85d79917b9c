// The planner's internal fast paths against the plain computations they stand for (kept below
// as references), on random and adversarial inputs: results must be identical, not merely as
// good.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "strategy/cost_formulas.h"
#include "strategy/migration_cost.h"
#include "strategy/planner_search.h"

using namespace parapilot;
using parapilot::planner_internal::Holding;
using parapilot::planner_internal::Holdings;
using parapilot::planner_internal::holdings_of;
using parapilot::planner_internal::migration_from;
using parapilot::planner_internal::speed_order;

namespace {

// The order make_groups used to sort groups into, kept as the reference.
std::vector<int> reference_speed_order(const std::vector<double>& speed) {
  std::vector<int> order(speed.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return speed[a] > speed[b] * (1 + 1e-12); });
  return order;
}

// migration_from as it was: both layouts' holdings listed per GPU, then GPU by GPU.
Migration reference_migration(const Holdings& before, const Strategy& from, const Strategy& to,
                              const Conditions& c, const ModelSpec& model,
                              const ClusterTopology& topo) {
  const int gpus = topo.num_gpus();
  Holdings after;
  holdings_of(to, model, gpus, after);
  const double embedding_params = static_cast<double>(model.embedding_params());
  const double block_params = static_cast<double>(model.params_per_layer());
  const double output_params = model.tied_embeddings
                                   ? static_cast<double>(model.vocab) * model.hidden
                                   : static_cast<double>(model.output_params());
  auto overlap = [](double a0, double a1, double b0, double b1) {
    return std::max(0.0, std::min(a1, b1) - std::max(a0, b0));
  };
  auto bytes_of = [&](const Holding& h, const Holding* other) {
    const int a = other ? std::max(h.first_layer, other->first_layer) : h.first_layer;
    const int b = other ? std::min(h.last_layer, other->last_layer) : h.last_layer;
    if (a > b) return 0.0;
    double params = 0;
    if (a < 0) params += embedding_params;
    const int blocks = std::min(b, model.layers - 1) - std::max(a, 0) + 1;
    if (blocks > 0) params += blocks * block_params;
    if (b >= model.layers && !(a < 0 && model.tied_embeddings)) params += output_params;
    const double width =
        other ? overlap(h.tp_lo, h.tp_hi, other->tp_lo, other->tp_hi) : h.tp_hi - h.tp_lo;
    auto opt_lo = [](const Holding& x) { return x.tp_lo + (x.tp_hi - x.tp_lo) * x.opt_lo; };
    auto opt_hi = [](const Holding& x) { return x.tp_lo + (x.tp_hi - x.tp_lo) * x.opt_hi; };
    const double opt_width = other ? overlap(opt_lo(h), opt_hi(h), opt_lo(*other), opt_hi(*other))
                                   : opt_hi(h) - opt_lo(h);
    return params * (width * (kWeightBytesPerParam + grad_bytes_per_param(model)) +
                     opt_width * kOptimizerBytesPerParam);
  };
  Migration m;
  double slowest = 0;
  for (int g = 0; g < gpus; ++g) {
    double need = 0;
    for (int i = after.first[g]; i < after.first[g + 1]; ++i) {
      const Holding& h = after.items[static_cast<size_t>(i)];
      need += bytes_of(h, nullptr);
      for (int j = before.first[g]; j < before.first[g + 1]; ++j)
        need -= bytes_of(h, &before.items[static_cast<size_t>(j)]);
    }
    need = std::max(0.0, need);
    if (need <= 0) continue;
    m.total_bytes += need;
    m.max_bytes = std::max(m.max_bytes, need);
    const int node = topo.node_of_gpu[g];
    const double bw = topo.nodes[node].inter_GBps * c.inter(node) * 1e9 * topo.inter_efficiency;
    slowest = std::max(slowest, need / bw);
  }
  if (m.total_bytes > 0 || !(from == to)) m.time_s = slowest + kSwitchPauseS;
  return m;
}

// A random legal-looking layout of up to `gpus` GPUs: degrees, ZeRO, virtual stages, stage
// boundaries and, half the time, a shuffled GPU list.
Strategy random_layout(std::mt19937_64& rng, int gpus, int layers) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Strategy s;
  do {
    s.tp = 1 << pick(0, 3);
    s.cp = 1 << pick(0, 1);
    s.pp = pick(1, 4);
    s.dp = pick(1, 8);
  } while (s.tp * s.cp * s.pp * s.dp > gpus);
  s.zero = pick(0, 3);
  s.virtual_stages = s.pp > 1 && pick(0, 1) ? pick(2, 3) : 1;
  if (s.virtual_stages > 1) s.schedule = Schedule::kInterleaved;
  if (pick(0, 1)) {  // uneven boundaries, at least one block per chunk
    const int chunks = s.num_chunks();
    s.stage_layers.assign(chunks, 1);
    for (int extra = layers - chunks; extra > 0; --extra) ++s.stage_layers[pick(0, chunks - 1)];
  }
  if (pick(0, 1)) {
    std::vector<int> all(gpus);
    for (int g = 0; g < gpus; ++g) all[g] = g;
    std::shuffle(all.begin(), all.end(), rng);
    s.gpus.assign(all.begin(), all.begin() + s.tp * s.cp * s.pp * s.dp);
  }
  return s;
}

}  // namespace

TEST_CASE("planner: migration_from equals the per-GPU listing of both layouts' holdings") {
  const ModelSpec model = *model_preset("llama2-7b");
  const ClusterSpec cluster = *cluster_preset("4x8xa100-80g");
  const CostModel cost(model, cluster);
  const ClusterTopology& topo = cost.topology();
  std::mt19937_64 rng(7);
  Conditions c;
  c.node_inter_bw = {1.0, 0.5, 0.8, 1.0};
  Holdings before;
  int moved = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const Strategy from = random_layout(rng, topo.num_gpus(), model.layers);
    Strategy to = trial % 7 == 0 ? from : random_layout(rng, topo.num_gpus(), model.layers);
    if (trial % 7 == 1) to.microbatch_size = 2;  // the same holdings, another layout
    holdings_of(from, model, topo.num_gpus(), before);
    const Migration got = migration_from(before, from, to, c, model, topo, kSwitchPauseS);
    const Migration want = reference_migration(before, from, to, c, model, topo);
    REQUIRE(got.max_bytes == want.max_bytes);
    REQUIRE(got.total_bytes == want.total_bytes);
    REQUIRE(got.time_s == want.time_s);
    moved += want.max_bytes > 0 ? 1 : 0;
  }
  CHECK(moved > 200);  // most pairs move state
}

TEST_CASE("planner: speed_order equals the stable sort by speed with its tolerance") {
  std::mt19937_64 rng(20240611);
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<int> order;
  for (int trial = 0; trial < 20000; ++trial) {
    const int n = std::uniform_int_distribution<int>(0, trial % 10 == 0 ? 1100 : 40)(rng);
    // A few base speeds; groups take them in stretches, some nudged within or just beyond the
    // tolerance, some zero, infinite, negative or NaN.
    std::vector<double> base(std::uniform_int_distribution<int>(1, 6)(rng));
    for (double& b : base) b = std::uniform_real_distribution<double>(0.1, 10.0)(rng);
    const int kind = trial % 5;
    std::vector<double> speed;
    while (static_cast<int>(speed.size()) < n) {
      double x = base[std::uniform_int_distribution<size_t>(0, base.size() - 1)(rng)];
      const int twist = std::uniform_int_distribution<int>(0, 99)(rng);
      if (kind == 1 && twist < 20)
        x *= 1 + 1e-13 * std::uniform_int_distribution<int>(-20, 20)(rng);
      if (kind == 2 && twist < 20) x *= 1 + 1e-12 * std::uniform_int_distribution<int>(-3, 3)(rng);
      if (kind == 3 && twist < 5) x = std::uniform_real_distribution<double>(0.1, 10.0)(rng);
      if (kind == 4 && twist < 3) x = 0;
      if (kind == 4 && twist == 3) x = inf;
      if (kind == 4 && twist == 4) x = -x;
      if (kind == 4 && twist == 5) x = std::nan("");
      const int length = std::uniform_int_distribution<int>(1, 16)(rng);
      for (int i = 0; i < length && static_cast<int>(speed.size()) < n; ++i) speed.push_back(x);
    }
    speed_order(speed, order);
    REQUIRE(order == reference_speed_order(speed));
  }
}
