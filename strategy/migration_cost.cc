#include "strategy/migration_cost.h"

#include <algorithm>

#include "strategy/cost_formulas.h"

namespace parapilot {
namespace planner_internal {

namespace {

// Calls visit(gpu, holding) for every holding of layout s, in (replica, stage, context rank,
// tp rank, virtual stage) order, the order in which a GPU's holdings are listed.
template <class Visit>
void visit_holdings(const Strategy& s, const ModelSpec& model, Visit&& visit) {
  const std::vector<int> chunks = s.layers_per_chunk(model.layers);
  std::vector<int> first(chunks.size());
  for (size_t c = 1; c < chunks.size(); ++c) first[c] = first[c - 1] + chunks[c - 1];
  // Context ranks hold the same tensor-parallel slice as their replica; ZeRO shards the
  // optimizer state over the dp x cp ranks that hold it.
  const int owners = s.dp * s.cp;
  // Slice bounds: tensor-parallel rank t holds [t / tp, (t + 1) / tp).
  thread_local std::vector<double> tp_bound;
  tp_bound.resize(static_cast<size_t>(s.tp) + 1);
  for (int t = 0; t <= s.tp; ++t) tp_bound[t] = static_cast<double>(t) / s.tp;
  for (int r = 0; r < s.dp; ++r) {
    for (int p = 0; p < s.pp; ++p) {
      for (int cpi = 0; cpi < s.cp; ++cpi) {
        const int owner = r * s.cp + cpi;
        const double olo = s.zero >= 1 ? static_cast<double>(owner) / owners : 0.0;
        const double ohi = s.zero >= 1 ? static_cast<double>(owner + 1) / owners : 1.0;
        for (int t = 0; t < s.tp; ++t) {
          const int gpu = s.gpu_of_rank(r, p, t, cpi);
          const double lo = tp_bound[t], hi = tp_bound[t + 1];
          for (int k = 0; k < s.virtual_stages; ++k) {
            const int c = k * s.pp + p;
            int a = first[c], b = first[c] + chunks[c] - 1;
            if (c == 0) a = -1;
            if (c == s.num_chunks() - 1) b = model.layers;
            visit(gpu, Holding{a, b, lo, hi, olo, ohi});
          }
        }
      }
    }
  }
}

}  // namespace

void holdings_of(const Strategy& s, const ModelSpec& model, int gpu_count, Holdings& out) {
  // Count per GPU, then fill in listing order.
  out.first.assign(static_cast<size_t>(gpu_count) + 1, 0);
  for (int r = 0; r < s.dp; ++r)
    for (int p = 0; p < s.pp; ++p)
      for (int c = 0; c < s.cp; ++c)
        for (int t = 0; t < s.tp; ++t) out.first[s.gpu_of_rank(r, p, t, c) + 1] += s.virtual_stages;
  for (int g = 0; g < gpu_count; ++g) out.first[g + 1] += out.first[g];
  out.items.resize(static_cast<size_t>(out.first[gpu_count]));
  thread_local std::vector<int> cursor;
  cursor.assign(out.first.begin(), out.first.end() - 1);
  visit_holdings(s, model, [&](int gpu, const Holding& h) {
    out.items[static_cast<size_t>(cursor[gpu]++)] = h;
  });
}

namespace {

double overlap(double a0, double a1, double b0, double b1) {
  return std::max(0.0, std::min(a1, b1) - std::max(a0, b0));
}

}  // namespace

Migration migration_from(const Holdings& before, const Strategy& from, const Strategy& to,
                         const Conditions& c, const ModelSpec& model, const ClusterTopology& topo,
                         double pause_s) {
  const int gpus = topo.num_gpus();
  const double weight_bytes = kWeightBytesPerParam;
  const double grad_bytes = grad_bytes_per_param(model);
  const double optimizer_bytes = kOptimizerBytesPerParam;
  // Parameters of the embedding, of one block and of the output layer.
  const double embedding_params = static_cast<double>(model.embedding_params());
  const double block_params = static_cast<double>(model.params_per_layer());
  const double output_params = model.tied_embeddings
                                   ? static_cast<double>(model.vocab) * model.hidden
                                   : static_cast<double>(model.output_params());
  // Bytes of layers [a, b] for a tp slice of the given width and an optimizer slice
  // of the given width (weights and gradients of the former, optimizer state of the latter).
  auto bytes_of = [&](int a, int b, double width, double opt_width) {
    double params = 0;
    if (a < 0) params += embedding_params;
    const int blocks = std::min(b, model.layers - 1) - std::max(a, 0) + 1;
    if (blocks > 0) params += blocks * block_params;
    // A tied output layer on the embedding's own GPU is the same tensor.
    if (b >= model.layers && !(a < 0 && model.tied_embeddings)) params += output_params;
    return params * (width * (weight_bytes + grad_bytes) + opt_width * optimizer_bytes);
  };
  // A holding's optimizer slice, within the layer's width.
  auto opt_lo = [](const Holding& x) { return x.tp_lo + (x.tp_hi - x.tp_lo) * x.opt_lo; };
  auto opt_hi = [](const Holding& x) { return x.tp_lo + (x.tp_hi - x.tp_lo) * x.opt_hi; };
  // What each GPU must receive: what it holds after, less what it already holds, summed in
  // the order its holdings after are listed (as holdings_of(to) would list them), as they come.
  // An old holding that shares no layer with a new one takes nothing off (subtracting zero is
  // skipped: it leaves the sum as it is).
  thread_local std::vector<double> needs;
  needs.assign(static_cast<size_t>(gpus), 0.0);
  visit_holdings(to, model, [&](int g, const Holding& h) {
    double& need = needs[static_cast<size_t>(g)];
    const double lo = opt_lo(h), hi = opt_hi(h);
    // A holding's own range may be empty only for a chunk of no layers between the first and
    // the last (a legal layout has none), where bytes_of finds no parameters either.
    need += bytes_of(h.first_layer, h.last_layer, h.tp_hi - h.tp_lo, hi - lo);
    for (int j = before.first[g]; j < before.first[g + 1]; ++j) {
      const Holding& o = before.items[static_cast<size_t>(j)];
      const int a = std::max(h.first_layer, o.first_layer);
      const int b = std::min(h.last_layer, o.last_layer);
      if (a > b) continue;
      need -= bytes_of(a, b, overlap(h.tp_lo, h.tp_hi, o.tp_lo, o.tp_hi),
                       overlap(lo, hi, opt_lo(o), opt_hi(o)));
    }
  });
  Migration m;
  double slowest = 0;
  for (int g = 0; g < gpus; ++g) {
    const double need = std::max(0.0, needs[static_cast<size_t>(g)]);
    if (need <= 0) continue;
    m.total_bytes += need;
    m.max_bytes = std::max(m.max_bytes, need);
    const int node = topo.node_of_gpu[g];
    const double bw = topo.nodes[node].inter_GBps * c.inter(node) * 1e9 * topo.inter_efficiency;
    slowest = std::max(slowest, need / bw);
  }
  if (m.total_bytes > 0 || !(from == to)) m.time_s = slowest + pause_s;
  return m;
}

}  // namespace planner_internal
}  // namespace parapilot
