// Live actions, fault specs and the compression selector (no processes).
#include <doctest/doctest.h>

#include "env/live/action.h"
#include "strategy/error.h"

using namespace parapilot::live;

TEST_CASE("live actions round-trip through their bus text") {
  LiveAction a;
  a.shares = {0.5, 0.25, 0.25};
  a.compression = {Compression::none, Compression::none, Compression::powersgd, Compression::fp16,
                   Compression::topk};
  a.topk_ratio = 0.01;
  a.powersgd_rank = 4;
  a.bucket_bytes = 65536;
  a.microbatch = 2;
  const std::string text = encode_action(a);
  CHECK(text == "s=0.5/0.25/0.25;c=2n1p1h1t;k=0.01;r=4;b=65536;m=2");
  CHECK(decode_action(text) == a);
  CHECK(decode_action("keep") == LiveAction{});
  CHECK(encode_action(LiveAction{}) == "keep");
  CHECK_THROWS_AS(decode_action("s=0.5/x"), parapilot::InputError);
  CHECK_THROWS_AS(decode_action("c=3q"), parapilot::InputError);
  CHECK_THROWS_AS(decode_action("z=1"), parapilot::InputError);
  LiveAction big;
  big.compression.resize(200);
  for (std::size_t i = 0; i < 200; ++i)
    big.compression[i] = i % 2 ? Compression::fp16 : Compression::none;
  CHECK_THROWS_AS(encode_action(big), parapilot::InputError);
}

TEST_CASE("microbatch counts follow shares and sum to the step's microbatches") {
  CHECK(microbatch_counts({0.75, 0.25}, 8) == std::vector<int>{6, 2});
  CHECK(microbatch_counts({1, 1, 1}, 8) == std::vector<int>{3, 3, 2});
  CHECK(microbatch_counts({3, 1, 1, 1}, 12) == std::vector<int>{6, 2, 2, 2});
  CHECK(microbatch_counts({1, 0}, 5) == std::vector<int>{5, 0});
  CHECK_THROWS_AS(microbatch_counts({0, 0}, 4), parapilot::InputError);
  CHECK(parse_shares("3,1") == std::vector<double>{0.75, 0.25});
}

TEST_CASE("fault specs parse as the issue writes them") {
  FaultSpec f = parse_fault("rank=2,slow=3x,at=100s,for=60s");
  CHECK(f.rank == 2);
  CHECK(f.kind == FaultSpec::Kind::slow);
  CHECK(f.factor == 3);
  CHECK(f.at_s == 100);
  CHECK(f.for_s == 60);
  f = parse_fault("rank=1,link-delay=20ms");
  CHECK(f.kind == FaultSpec::Kind::link_delay);
  CHECK(f.delay_ms == 20);
  f = parse_fault("rank=3,kill,at=50s");
  CHECK(f.kind == FaultSpec::Kind::kill);
  CHECK(f.at_s == 50);
  CHECK_THROWS_AS(parse_fault("slow=3x"), parapilot::InputError);
  CHECK_THROWS_AS(parse_fault("rank=1"), parapilot::InputError);
  CHECK_THROWS_AS(parse_fault("rank=1,slow=0.5x"), parapilot::InputError);
  CHECK_THROWS_AS(parse_fault("rank=1,fast=2x"), parapilot::InputError);
  CHECK_THROWS_AS(parse_fault("rank=1,kill,slow=2x"), parapilot::InputError);
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
