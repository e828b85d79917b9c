// Hybrid layouts without processes: the --layout parser, the rank mapping and its groups, which
// part of every tensor a rank holds, and the 1F1B schedule.
#include <doctest/doctest.h>

#include "tests/live/live_test_util.h"

#include <algorithm>
#include <map>
#include <set>

#include "env/live/layout.h"
#include "env/live/schedule.h"

using namespace parapilot::live;

namespace {

using parapilot::live::testing::four_blocks;

std::string error_of(std::string_view text, int world, const ModelConfig& m = four_blocks()) {
  const auto r = parse_layout(text, world, m);
  if (r.ok()) return "";
  CHECK(r.status().code() == parapilot::StatusCode::kInvalidArgument);
  return r.status().message();
}

}  // namespace

TEST_CASE("--layout: the strategy language's inline keys, with defaults for what is omitted") {
  const ModelConfig m = four_blocks();
  auto l = parse_layout("dp=2,tp=1,pp=2,stages=[1,3]", 4, m);
  REQUIRE_MESSAGE(l.ok(), l.status().message());
  CHECK(l->dp == 2);
  CHECK(l->tp == 1);
  CHECK(l->pp == 2);
  CHECK(l->stages == std::vector<int>{1, 3});
  CHECK(layout_text(*l) == "dp=2,tp=1,pp=2,stages=[1,3]");
  // Round trip.
  CHECK(*parse_layout(layout_text(*l), 4, m) == *l);
  // dp defaults to what tp and pp leave; stages to balanced.
  l = parse_layout("pp=2", 4, m);
  REQUIRE(l.ok());
  CHECK(l->dp == 2);
  CHECK(l->stages == std::vector<int>{2, 2});
  l = parse_layout("tp=2", 2, m);
  REQUIRE(l.ok());
  CHECK(l->dp == 1);
  CHECK(l->stages == std::vector<int>{4});
  // Empty: pure data parallel over the world.
  l = parse_layout("", 3, m);
  REQUIRE(l.ok());
  CHECK(*l == data_parallel_layout(3, m));
  CHECK(l->dp == 3);
  CHECK(l->pure_data_parallel());
  CHECK(l->stages == std::vector<int>{4});
}

TEST_CASE("--layout: malformed or impossible layouts are refused naming the key") {
  // Product != world size.
  CHECK(error_of("dp=3", 4).find("--layout: dp:") == 0);
  CHECK(error_of("dp=3", 4).find("the job has 4 ranks") != std::string::npos);
  CHECK(error_of("pp=3", 4).find("--layout: pp:") == 0);
  // Stages: count and sum.
  CHECK(error_of("pp=2,stages=[1,1,2]", 2).find("--layout: stages:") == 0);
  CHECK(error_of("pp=2,stages=[1,2]", 2).find("--layout: stages: covers 3 layers") == 0);
  CHECK(error_of("pp=2,stages=[4,0]", 2).find("--layout: stages:") == 0);
  // TP must divide the heads (and so 4 * d_model).
  CHECK(error_of("tp=4", 4).find("--layout: tp: tp = 4 does not divide the model's 2 attention "
                                 "heads") == 0);
  // More stages than blocks.
  CHECK(error_of("pp=5", 5).find("--layout: pp:") == 0);
  // Keys the workers do not run, and text that is not key=value.
  CHECK(error_of("sp=true", 2).find("--layout: unknown key 'sp'") == 0);
  CHECK(error_of("global_batch=8", 2).find("--layout: unknown key 'global_batch'") == 0);
  CHECK(error_of("tp", 2).find("--layout: \"tp\" is not key=value") == 0);
  CHECK(error_of("dp=2,", 2).find("is not key=value") != std::string::npos);
  // Values that do not parse name their key.
  CHECK(error_of("pp=2,stages=[1,x]", 2).find("--layout: stages: '[1,x]' is not a value") == 0);
  CHECK(error_of("pp=2,stages=[1,3", 2).find("--layout: stages:") == 0);
  CHECK(error_of("tp=two", 2).find("--layout: tp:") == 0);
  CHECK(error_of("dp=0", 2).find("--layout: dp:") == 0);
  // The MLP model runs data parallel only.
  ModelConfig mlp = four_blocks();
  mlp.kind = "mlp";
  CHECK(error_of("pp=2", 2, mlp).find("--layout: tp and pp need --model transformer") == 0);
  CHECK(error_of("dp=2", 2, mlp) == "");
}

TEST_CASE("rank mapping: tp fastest, then stage, then replica; groups partition the world") {
  LiveLayout l;
  l.dp = 2;
  l.tp = 2;
  l.pp = 3;
  l.stages = {1, 2, 1};
  CHECK(coords_of(l, 0) == RankCoords{0, 0, 0});
  CHECK(coords_of(l, 1) == RankCoords{0, 1, 0});
  CHECK(coords_of(l, 2) == RankCoords{0, 0, 1});
  CHECK(coords_of(l, 5) == RankCoords{0, 1, 2});
  CHECK(coords_of(l, 6) == RankCoords{1, 0, 0});
  CHECK(coords_of(l, 11) == RankCoords{1, 1, 2});
  for (int r = 0; r < l.world_size(); ++r) CHECK(rank_of(l, coords_of(l, r)) == r);
  CHECK(tp_group(l, 3) == std::vector<int>{2, 3});
  CHECK(pipeline_group(l, 3) == std::vector<int>{1, 3, 5});
  CHECK(dp_group(l, 3) == std::vector<int>{3, 9});
  // Every rank is in exactly one group of each kind; a group lists its members in group order.
  std::map<std::string, std::multiset<int>> seen;
  std::set<std::string> names;
  for (const GroupSpec& g : layout_groups(l)) {
    CHECK(names.insert(g.name).second);
    const std::string kind = g.name.substr(0, 2);
    for (std::size_t i = 0; i < g.ranks.size(); ++i) {
      seen[kind].insert(g.ranks[i]);
      const std::vector<int> expect = kind == "dp"   ? dp_group(l, g.ranks[i])
                                      : kind == "tp" ? tp_group(l, g.ranks[i])
                                                     : pipeline_group(l, g.ranks[i]);
      CHECK(expect == g.ranks);
    }
  }
  for (const std::string kind : {"dp", "tp", "pp"}) {
    CHECK(seen[kind].size() == 12);
    for (int r = 0; r < 12; ++r) CHECK(seen[kind].count(r) == 1);
  }
  CHECK(layout_groups(l).size() == 6 + 6 + 4);
  // A degree of 1 has no groups; pure data parallel has the one DP group.
  const LiveLayout dp4 = data_parallel_layout(4, ModelConfig{});
  REQUIRE(layout_groups(dp4).size() == 1);
  CHECK(layout_groups(dp4)[0].ranks == std::vector<int>{0, 1, 2, 3});
  CHECK(first_block(l, 0) == 0);
  CHECK(first_block(l, 2) == 3);
  CHECK(end_block(l, 2) == 4);
}

TEST_CASE("shards: every element of the model is written exactly once in the gather") {
  const ModelConfig m = four_blocks();
  for (const std::string text : {"tp=2,pp=2,stages=[1,3]", "dp=2,tp=2", "pp=4", "dp=2,pp=2"}) {
    CAPTURE(text);
    const LiveLayout l = *parse_layout(text, 4, m);
    const std::vector<LayerShape> full = model_layers(m);
    // Count, per full tensor, the elements the writing ranks hold; shapes must divide evenly.
    std::vector<std::int64_t> written(full.size(), 0);
    for (int r = 0; r < l.world_size(); ++r) {
      for (const ParamShard& s : rank_shards(l, m, r)) {
        const LayerShape& f = full[static_cast<std::size_t>(s.layer)];
        std::int64_t n = 1;
        for (std::int64_t d : s.shape) n *= d;
        if (s.kind == ShardKind::replicated)
          CHECK(s.shape == f.shape);
        else
          CHECK(n * l.tp == f.numel());
        if (writes_in_gather(l, r, s)) written[static_cast<std::size_t>(s.layer)] += n;
      }
    }
    for (std::size_t i = 0; i < full.size(); ++i) {
      INFO(full[i].name);
      CHECK(written[i] == full[i].numel());
    }
  }
  // The stage's tensors: embedding with the first, head with the last, qkv split by heads.
  const LiveLayout l = *parse_layout("tp=2,pp=2,stages=[1,3]", 4, m);
  const std::vector<ParamShard> first = rank_shards(l, m, 1);  // tp 1 of stage 0
  REQUIRE(first.size() == 2 + 12);
  CHECK(first[0].layer == 0);  // pos
  CHECK(first[1].layer == 1);  // tok.weight
  CHECK(first[4].layer == 4);  // blocks.0.qkv.weight
  CHECK(first[4].kind == ShardKind::rows);
  CHECK(first[4].parts == 3);
  CHECK(first[4].piece == 1);
  CHECK(first[4].shape == std::vector<std::int64_t>{48, 32});
  CHECK(first[6].kind == ShardKind::columns);  // proj.weight
  CHECK(first[6].shape == std::vector<std::int64_t>{32, 16});
  CHECK(first[7].kind == ShardKind::replicated);              // proj.bias
  const std::vector<ParamShard> last = rank_shards(l, m, 2);  // tp 0 of stage 1
  REQUIRE(last.size() == 3 * 12 + 4);
  CHECK(last.front().layer == 2 + 12);
  CHECK(last.back().layer == static_cast<int>(model_layers(m).size()) - 1);
}

TEST_CASE("1F1B: warm-up forwards, one forward one backward, cool-down backwards") {
  using K = PipeOp::Kind;
  // Stage 0 of 2 over 3 microbatches: F0 | F1 B0 F2 B1 | B2.
  CHECK(one_f_one_b(0, 2, 3) == std::vector<PipeOp>{{K::forward, 0},
                                                    {K::forward, 1},
                                                    {K::backward, 0},
                                                    {K::forward, 2},
                                                    {K::backward, 1},
                                                    {K::backward, 2}});
  // The last stage alternates from the start.
  CHECK(one_f_one_b(1, 2, 2) ==
        std::vector<PipeOp>{{K::forward, 0}, {K::backward, 0}, {K::forward, 1}, {K::backward, 1}});
  // Fewer microbatches than the warm-up: all forwards, then all backwards.
  CHECK(one_f_one_b(0, 4, 2) ==
        std::vector<PipeOp>{{K::forward, 0}, {K::forward, 1}, {K::backward, 0}, {K::backward, 1}});
  CHECK(one_f_one_b(0, 3, 0).empty());
  for (int stages = 1; stages <= 4; ++stages)
    for (int stage = 0; stage < stages; ++stage)
      for (int mb = 0; mb <= 6; ++mb) {
        CAPTURE(stages);
        CAPTURE(stage);
        CAPTURE(mb);
        const std::vector<PipeOp> ops = one_f_one_b(stage, stages, mb);
        CHECK(ops.size() == static_cast<std::size_t>(2 * mb));
        int next_f = 0, next_b = 0, alive = 0, peak = 0;
        for (const PipeOp& op : ops) {
          if (op.kind == K::forward) {
            CHECK(op.microbatch == next_f++);
            peak = std::max(peak, ++alive);
          } else {
            CHECK(op.microbatch == next_b++);
            CHECK(op.microbatch < next_f);  // a backward after its forward
            --alive;
          }
        }
        CHECK(peak <= std::max(1, std::min(mb, stages - stage)));
      }
}
