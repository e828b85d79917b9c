// Live actions, fault specs and the compression selector (no processes).
#include <doctest/doctest.h>

#include "core/error.h"
#include "env/live/action.h"
#include "env/live/fault_spec.h"
#include "env/live/local_cluster.h"
#include "tests/test_util.h"

using namespace parapilot::live;
using parapilot::testing::failure_of;
using parapilot::testing::ok;

TEST_CASE("live actions round-trip through their bus text") {
  LiveAction a;
  a.shares = {0.5, 0.25, 0.25};
  a.compression = {Compression::none, Compression::none, Compression::powersgd, Compression::fp16,
                   Compression::topk};
  a.topk_ratio = 0.01;
  a.powersgd_rank = 4;
  a.bucket_bytes = 65536;
  a.microbatch = 2;
  const std::string text = ok(encode_action(a));
  CHECK(text == "s=0.5/0.25/0.25;c=2n1p1h1t;k=0.01;r=4;b=65536;m=2");
  CHECK(ok(decode_action(text)) == a);
  CHECK(ok(decode_action("keep")) == LiveAction{});
  CHECK(ok(encode_action(LiveAction{})) == "keep");
  CHECK(failure_of(decode_action("s=0.5/x")) != "");
  CHECK(failure_of(decode_action("c=3q")) != "");
  CHECK(failure_of(decode_action("z=1")) != "");
  LiveAction big;
  big.compression.resize(200);
  for (std::size_t i = 0; i < 200; ++i)
    big.compression[i] = i % 2 ? Compression::fp16 : Compression::none;
  CHECK(failure_of(encode_action(big)) != "");
}

TEST_CASE("microbatch counts follow shares and sum to the step's microbatches") {
  CHECK(microbatch_counts({0.75, 0.25}, 8) == std::vector<int>{6, 2});
  CHECK(microbatch_counts({1, 1, 1}, 8) == std::vector<int>{3, 3, 2});
  CHECK(microbatch_counts({3, 1, 1, 1}, 12) == std::vector<int>{6, 2, 2, 2});
  CHECK(microbatch_counts({1, 0}, 5) == std::vector<int>{5, 0});
  CHECK(ok(parse_shares("3,1")) == std::vector<double>{0.75, 0.25});
  // What microbatch_counts may not be given is refused where shares are read.
  CHECK(failure_of(parse_shares("0,0")).find("sum to zero") != std::string::npos);
  CHECK(failure_of(parse_shares("1,-1")).find("negative") != std::string::npos);
}

TEST_CASE("fault specs parse as launch --inject documents them") {
  FaultSpec f = ok(parse_fault("rank=2,slow=3x,at=100s,for=60s"));
  CHECK(f.rank == 2);
  CHECK(f.kind == FaultSpec::Kind::slow);
  CHECK(f.factor == 3);
  CHECK(f.at_s == 100);
  CHECK(f.for_s == 60);
  f = ok(parse_fault("rank=1,link-delay=20ms"));
  CHECK(f.kind == FaultSpec::Kind::link_delay);
  CHECK(f.delay_ms == 20);
  f = ok(parse_fault("rank=3,kill,at=50s"));
  CHECK(f.kind == FaultSpec::Kind::kill);
  CHECK(f.at_s == 50);
  // In training steps: the same fault whatever the host's speed.
  f = ok(parse_fault("rank=2,slow=3x,at=20steps,for=10steps"));
  CHECK(f.at_step == 20);
  CHECK(f.for_steps == 10);
  CHECK(f.at_s == 0);
  f = ok(parse_fault("rank=1,link-delay=20ms,at=1step"));
  CHECK(f.at_step == 1);
  CHECK(f.for_steps == -1);
  CHECK(ok(parse_fault("rank=1,slow=2x,for=5steps")).at_step == 0);
  CHECK(failure_of(parse_fault("rank=1,slow=2x,at=20steps,for=60s")).find("both in steps") !=
        std::string::npos);
  f = ok(parse_fault("rank=1,link-cut,at=30steps"));
  CHECK(f.kind == FaultSpec::Kind::link_cut);
  CHECK(f.rank == 1);
  CHECK(f.at_step == 30);
  CHECK(fault_flags(f) == std::vector<std::string>{"--link-cut-at-step", "30"});
  CHECK(failure_of(parse_fault("rank=1,link-cut")).find("at=Nsteps") != std::string::npos);
  CHECK(failure_of(parse_fault("rank=1,link-cut,at=3s")).find("at=Nsteps") != std::string::npos);
  CHECK(failure_of(parse_fault("rank=1,link-cut,at=3steps,for=2steps")).find("no for") !=
        std::string::npos);
  CHECK(failure_of(parse_fault("rank=1,link-cut=2,at=3steps")).find("no value") !=
        std::string::npos);
  CHECK(failure_of(parse_fault("rank=3,kill,at=20steps")).find("in seconds") !=
        std::string::npos);
  CHECK(failure_of(parse_fault("rank=1,slow=2x,at=-3steps")) != "");
  CHECK(failure_of(parse_fault("rank=1,slow=2x,at=xsteps")) != "");
  CHECK(failure_of(parse_fault("slow=3x")) != "");
  CHECK(failure_of(parse_fault("rank=1")) != "");
  CHECK(failure_of(parse_fault("rank=1,slow=0.5x")) != "");
  CHECK(failure_of(parse_fault("rank=1,fast=2x")) != "");
  CHECK(failure_of(parse_fault("rank=1,kill,slow=2x")) != "");
}

TEST_CASE("the compression selector keeps small and non-finite layers uncompressed") {
  ModelConfig m;
  const auto layers = model_layers(m);
  CHECK(layers.size() == 2 + 12 * 2 + 4);
  std::vector<LayerGradSummary> g(layers.size(), LayerGradSummary{0.1, 0.01, 0});
  g[1].nonfinite = 3;  // tok.weight
  SelectorOptions aggressive;
  aggressive.powersgd_min_saving = 4;
  const auto c = select_compression(layers, g, aggressive);
  for (std::size_t i = 0; i < layers.size(); ++i) {
    if (layers[i].numel() < 4096 || i == 1) CHECK(c[i] == Compression::none);
  }
  CHECK(c[4] == Compression::powersgd);  // blocks.0.qkv.weight 192 x 64 saves 12x at r = 4
  CHECK(select_compression(layers, g)[4] == Compression::fp16);  // default: PowerSGD from 32x
  SelectorOptions strict;
  strict.powersgd_min_saving = 100;  // no matrix saves that much: large layers go fp16
  g[4].max_abs = 1e6;                // too large for fp16
  const auto s = select_compression(layers, g, strict);
  CHECK(s[0] == Compression::fp16);
  CHECK(s[4] == Compression::none);
}

TEST_CASE("a deploy plan (structured layout) becomes the live action of a data-parallel job") {
  parapilot::transport::PlanPrepare p;
  p.layout.dp = 4;
  p.layout.dp_shares = {30, 30, 10, 30};
  p.layout_name = "dp4-tp1-pp1-mb1-z1;sc=1f1b;rc=selective;sh=30*2,10,30";
  LiveAction a = ok(action_from_plan(p, 4, 6));
  CHECK(a.shares == std::vector<double>{0.3, 0.3, 0.1, 0.3});
  CHECK(a.compression.empty());
  // Replicas placed on other devices: replica i runs on rank g[i], which takes its share.
  p.layout_name = "dp4-tp1-pp1-mb1-z1;sc=1f1b;sh=30*2,10,30;g=2,0-1,3";
  a = ok(action_from_plan(p, 4, 6));
  CHECK(a.shares == std::vector<double>{0.3, 0.1, 0.3, 0.3});  // replica 2 (10) on rank 1
  // No shares: equal.
  p.layout.dp_shares.clear();
  p.layout_name = "dp4-tp1-pp1-mb1-z1";
  CHECK(ok(action_from_plan(p, 4, 6)).shares == std::vector<double>(4, 0.25));
  // Compression ranges index parameter tensors; later ranges override; past the end ignored.
  using parapilot::transport::CompressionMethod;
  p.layout.compression = {{0, 5, CompressionMethod::fp16, 0},
                          {2, 3, CompressionMethod::powersgd, 4},
                          {5, 9, CompressionMethod::topk, 0.01f}};
  a = ok(action_from_plan(p, 4, 6));
  CHECK(a.compression == std::vector<Compression>{Compression::fp16, Compression::fp16,
                                                  Compression::powersgd, Compression::powersgd,
                                                  Compression::fp16, Compression::topk});
  CHECK(a.powersgd_rank == 4);
  CHECK(a.topk_ratio == doctest::Approx(0.01));
  // An action text in the name (the live env's form) wins over the structured layout.
  p.layout_name = "s=0.75/0.25";
  CHECK(ok(action_from_plan(p, 2, 6)).shares == std::vector<double>{0.75, 0.25});
  // What this job cannot run, with the reason.
  p.layout_name = "dp2-tp2-pp1-mb1-z1";
  p.layout.dp = 2;
  p.layout.tp = 2;
  CHECK(ok(action_from_plan(p, 4, 6)).layout == "dp=2,tp=2,pp=1");  // a layout switch
  p.layout.tp = 1;
  CHECK(failure_of(action_from_plan(p, 4, 6)).find("job has 4 ranks") != std::string::npos);
  p.layout.dp = 4;
  p.layout.compression.clear();
  p.layout_name = "dp4-tp1-pp1-mb1-z1;g=0-2,2";
  CHECK(failure_of(action_from_plan(p, 4, 6)).find("permutation") != std::string::npos);
  p.layout_name = "dp4-tp1-pp1-mb1-z1;g=0-4";
  CHECK(action_from_plan(p, 4, 6).status().code() == parapilot::StatusCode::kRejected);
  CHECK(is_action_text("keep"));
  CHECK(is_action_text("c=3n"));
  CHECK_FALSE(is_action_text("dp4-tp1-pp1-mb1-z1"));
}
