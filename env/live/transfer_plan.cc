#include "env/live/transfer_plan.h"

#include <algorithm>
#include <cassert>

namespace parapilot::live {

ShardRange shard_range(const ParamShard& s, const ModelConfig& model) {
  const LayerShape full = model_layers(model)[static_cast<std::size_t>(s.layer)];
  ShardRange r;
  if (s.kind == ShardKind::replicated) {
    r.end = full.numel();
    return r;
  }
  r.dim = s.kind == ShardKind::rows ? 0 : 1;
  r.parts = s.parts;
  const std::int64_t block = full.shape[static_cast<std::size_t>(r.dim)] / s.parts;
  const std::int64_t piece = block / s.pieces;
  r.begin = piece * s.piece;
  r.end = r.begin + piece;
  return r;
}

std::int64_t piece_numel(const TransferPiece& p, const ModelConfig& model) {
  const LayerShape full = model_layers(model)[static_cast<std::size_t>(p.layer)];
  if (p.dim < 0) return p.end - p.begin;
  const std::int64_t across = full.numel() / full.shape[static_cast<std::size_t>(p.dim)];
  return (p.end - p.begin) * p.parts * across;
}

std::vector<TransferPiece> transfer_plan(const LiveLayout& from, const LiveLayout& to,
                                         const ModelConfig& model) {
  assert(from.world_size() == to.world_size());
  const int world = from.world_size();
  const std::size_t n_layers = model_layers(model).size();
  // Who holds what under the old layout: per tensor, (rank, range), by rank.
  struct Held {
    int rank;
    ShardRange range;
  };
  std::vector<std::vector<Held>> holders(n_layers);
  for (int r = 0; r < world; ++r)
    for (const ParamShard& s : rank_shards(from, model, r))
      holders[static_cast<std::size_t>(s.layer)].push_back({r, shard_range(s, model)});

  std::vector<TransferPiece> out;
  std::vector<std::int64_t> sent(static_cast<std::size_t>(world), 0);  // elements, so far
  for (int t = 0; t < world; ++t) {
    for (const ParamShard& s : rank_shards(to, model, t)) {
      const ShardRange want = shard_range(s, model);
      const std::vector<Held>& have = holders[static_cast<std::size_t>(s.layer)];
      // Cover [begin, end) left to right: at each position the target itself when it holds
      // the element, else the holder of that position that has sent the least so far (the
      // lowest rank on a tie), so that the sending spreads over the holders.
      std::int64_t pos = want.begin;
      while (pos < want.end) {
        std::vector<const Held*> covering;
        const Held* self = nullptr;
        for (const Held& h : have) {
          if (h.range.begin <= pos && pos < h.range.end) {
            covering.push_back(&h);
            if (h.rank == t) self = &h;
          }
        }
        assert(!covering.empty());  // every element of the model is held by some rank
        const Held* pick = self;
        if (!pick)
          for (const Held* h : covering)
            if (!pick || sent[static_cast<std::size_t>(h->rank)] <
                             sent[static_cast<std::size_t>(pick->rank)])
              pick = h;
        TransferPiece p;
        p.layer = s.layer;
        p.dim = want.dim;
        p.parts = want.parts;
        p.begin = pos;
        p.end = std::min(want.end, pick->range.end);
        // A piece stops where the target's own range starts, so that it copies what it has.
        if (!self)
          for (const Held& h : have)
            if (h.rank == t && h.range.begin > pos) p.end = std::min(p.end, h.range.begin);
        p.source = pick->rank;
        p.target = t;
        if (p.source != t) sent[static_cast<std::size_t>(p.source)] += piece_numel(p, model);
        out.push_back(p);
        pos = p.end;
      }
    }
  }
  std::sort(out.begin(), out.end(), [](const TransferPiece& a, const TransferPiece& b) {
    if (a.target != b.target) return a.target < b.target;
    if (a.layer != b.layer) return a.layer < b.layer;
    return a.begin < b.begin;
  });
  return out;
}

TransferVolume transfer_volume(const std::vector<TransferPiece>& plan, int rank,
                               const ModelConfig& model) {
  TransferVolume v;
  for (const TransferPiece& p : plan) {
    const std::int64_t n = piece_numel(p, model);
    if (p.source == rank && p.target == rank)
      v.local += n;
    else if (p.source == rank)
      v.sent += n;
    else if (p.target == rank)
      v.received += n;
  }
  return v;
}

}  // namespace parapilot::live
