// Spec files: presets, TOML parsing, and every validation error path with its location.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "strategy/spec_io.h"
#include "tests/test_util.h"

using namespace parapilot;
using parapilot::testing::failure_of;
using parapilot::testing::ok;
using parapilot::testing::TempFile;

namespace {

const ModelSpec kLlama7b = *model_preset("llama2-7b");
const ClusterSpec kTwoNodes = *cluster_preset("2x8xa100-80g");

}  // namespace

TEST_CASE("model presets are all loadable and consistent") {
  for (const auto& name : model_preset_names()) {
    const ModelSpec m = ok(load_model(name));
    CHECK(m.name == name);
    CHECK(m.hidden % m.heads == 0);
    CHECK(m.heads % m.kv_heads == 0);
  }
  for (const char* name :
       {"gpt3-1.3b", "gpt3-175b", "llama2-7b", "llama2-70b", "llama3-8b", "llama3-70b"}) {
    CHECK(model_preset(name).has_value());
  }
  // Published parameter counts, within 3%.
  CHECK(ok(load_model("gpt3-175b")).total_params() == doctest::Approx(175e9).epsilon(0.03));
  CHECK(ok(load_model("llama2-7b")).total_params() == doctest::Approx(6.74e9).epsilon(0.03));
  CHECK(ok(load_model("llama2-70b")).total_params() == doctest::Approx(69.0e9).epsilon(0.03));
  CHECK(ok(load_model("llama3-8b")).total_params() == doctest::Approx(8.03e9).epsilon(0.03));
  CHECK(ok(load_model("llama3-70b")).total_params() == doctest::Approx(70.6e9).epsilon(0.03));
  CHECK(failure_of(load_model("gpt5")).find("unknown preset \"gpt5\"") != std::string::npos);
}

TEST_CASE("cluster presets compose node groups and mixed GPU types") {
  const ClusterSpec c = ok(load_cluster("4x8xa100-80g"));
  CHECK(c.num_gpus() == 32);
  CHECK(c.num_nodes() == 4);
  CHECK(ok(load_cluster("8xh100")).num_gpus() == 8);
  const ClusterSpec mixed = ok(load_cluster("1x8xa100-80g+2x4xh800"));
  CHECK(mixed.num_gpus() == 16);
  CHECK(mixed.num_nodes() == 3);
  ClusterTopology topo(mixed);
  CHECK(topo.types.size() == 2);
  CHECK(topo.types[topo.type_of_gpu[0]].name == "a100-80g");
  CHECK(topo.types[topo.type_of_gpu[15]].name == "h800");
  CHECK(topo.node_of_gpu[12] == 2);
  for (const char* bad : {"4x8xtpu", "x8xh100", "4x8xh100+", "0x8xh100", "h100"}) {
    CHECK(failure_of(load_cluster(bad)).find("not a cluster preset") != std::string::npos);
  }
  for (const auto& name : gpu_type_names()) CHECK(gpu_type(name)->peak_tflops > 0);
}

TEST_CASE("model TOML: full form, defaults, and errors with file and line") {
  TempFile good(R"([model]
name = "tiny"
layers = 4
hidden = 512
heads = 8
seq_len = 1024
vocab = 32000
)");
  const ModelSpec m = ok(load_model(good.path()));
  CHECK(m.ffn_hidden == 2048);
  CHECK(m.kv_heads == 8);
  CHECK(m.dtype == DType::kBF16);

  struct Case {
    const char* toml;
    const char* expected;
  };
  const std::vector<Case> cases = {
      {"[model]\nlayers = 4\nhidden = 512\nheads = 8\nseq_len = 1024\n",
       ":1: [model] vocab: missing"},
      {"[model]\nlayers = \"4\"\nhidden = 512\nheads = 8\nseq_len = 1024\nvocab = 10\n",
       ":2: [model] layers: must be an integer, got string"},
      {"[model]\nlayers = 4\nhidden = 512\nheads = 8\nseq_len = 1024\nvocab = 10\nlayer = 3\n",
       ":7: [model] unknown key 'layer'"},
      {"[model]\nlayers = 4\nhidden = 500\nheads = 8\nseq_len = 1024\nvocab = 10\n",
       "heads = 8 must divide hidden = 500"},
      {"[model]\nlayers = 4\nhidden = 512\nheads = 8\nkv_heads = 3\nseq_len = 1024\nvocab = 10\n",
       ":5: [model] kv_heads"},
      {"[model]\nlayers = 0\nhidden = 512\nheads = 8\nseq_len = 1024\nvocab = 10\n",
       ":2: [model] layers: must be in [1,"},
      {"[model]\npreset = \"llama2-7b\"\ndtype = \"fp8\"\n",
       ":3: [model] dtype: must be one of bf16 | fp16"},
      {"[model]\nlayers = 4\nhidden = ", "invalid TOML"},
      {"[cluster]\n", "no [model] table"},
  };
  for (const auto& c : cases) {
    TempFile f(c.toml);
    const std::string message = failure_of(load_model(f.path()));
    INFO(message);
    CHECK(message.find(f.path()) == 0);
    CHECK(message.find(c.expected) != std::string::npos);
  }
  CHECK(failure_of(load_model("/nonexistent/m.toml")).find("no such file") !=
        std::string::npos);
}

TEST_CASE("cluster TOML: groups, link overrides, custom GPU types, errors") {
  TempFile f(R"([cluster]
name = "lab"
inter_node_Gbps = 100

[[cluster.gpu_types]]
name = "mygpu"
peak_tflops = 100
memory_gib = 24
hbm_GBps = 1000
nvlink_GBps = 64

[[cluster.nodes]]
count = 2
gpus_per_node = 4
gpu = "mygpu"

[[cluster.nodes]]
gpus_per_node = 8
gpu = "h100"
intra_node_GBps = 400
)");
  const ClusterSpec c = ok(load_cluster(f.path()));
  REQUIRE(c.groups.size() == 2);
  CHECK(c.num_gpus() == 16);
  CHECK(c.groups[0].gpu.name == "mygpu");
  CHECK(c.groups[0].inter_node_Gbps == 100);
  CHECK(c.groups[0].intra_node_GBps == 32);
  CHECK(c.groups[1].intra_node_GBps == 400);
  CHECK(c.groups[1].inter_node_Gbps == 100);

  struct Case {
    const char* toml;
    const char* expected;
  };
  const std::vector<Case> cases = {
      {"[cluster]\n[[cluster.nodes]]\ngpus_per_node = 8\ngpu = \"b200\"\n",
       ":4: [cluster.nodes] gpu: unknown GPU type \"b200\""},
      {"[cluster]\n[[cluster.nodes]]\ngpu = \"h100\"\n", "[cluster.nodes] gpus_per_node: missing"},
      {"[cluster]\nname = \"x\"\n", "[cluster] nodes: missing"},
      {"[cluster]\n[[cluster.nodes]]\ngpus_per_node = 8\ngpu = \"h100\"\nspeed = 2\n",
       ":5: [cluster.nodes] unknown key 'speed'"},
      {"[cluster]\ninter_node_efficiency = 1.5\n[[cluster.nodes]]\ngpus_per_node = 8\ngpu = "
       "\"h100\"\n",
       ":2: [cluster] inter_node_efficiency: must be in"},
  };
  for (const auto& k : cases) {
    TempFile t(k.toml);
    const std::string message = failure_of(load_cluster(t.path()));
    INFO(message);
    CHECK(message.find(k.expected) != std::string::npos);
  }
}

TEST_CASE("strategy TOML: every validation error names file, line, key and reason") {
  struct Case {
    const char* body;      // lines after [strategy]
    const char* expected;  // fragment of the message, including the line
  };
  // llama2-7b (32 layers, 32 heads) on 2 nodes of 8 GPUs.
  const std::vector<Case> cases = {
      {"tp = 8\nglobal_batch = 16\ntpp = 2\n", ":4: [strategy] unknown key 'tpp'"},
      {"tp = \"8\"\nglobal_batch = 16\n", ":2: [strategy] tp: must be an integer, got string"},
      {"zero = 4\nglobal_batch = 16\n", ":2: [strategy] zero: must be in [0, 3], got 4"},
      {"sp = 1\nglobal_batch = 16\n", ":2: [strategy] sp: must be true or false"},
      {"tp = 2\n", "[strategy] global_batch: missing"},
      {"dp = 3\nglobal_batch = 12\n",
       ":2: [strategy] dp: dp*tp*pp*cp = 3*1*1*1 = 3 but the cluster has 16 GPUs"},
      {"tp = 3\nglobal_batch = 12\n",
       ":2: [strategy] tp: tp*pp*cp = 3 does not divide the 16 GPUs"},
      {"cp = 0\nglobal_batch = 12\n", ":2: [strategy] cp: must be in [1, "},
      {"cp = 3\nglobal_batch = 12\n",
       ":2: [strategy] cp: tp*pp*cp = 3 does not divide the 16 GPUs"},
      {"tp = 4\ncp = 2\nattention = \"unfused\"\nglobal_batch = 8\n",
       ":3: [strategy] cp: context parallelism (cp = 2) needs attention = \"flash\""},
      {"attention = \"fused\"\nglobal_batch = 8\n",
       ":2: [strategy] attention: must be one of flash | unfused, got \"fused\""},
      {"fp8 = \"yes\"\nglobal_batch = 8\n", ":2: [strategy] fp8: must be true or false"},
      {"tp = 8\nfp8 = true\nglobal_batch = 8\n",
       ":3: [strategy] fp8: fp8 = true needs FP8 tensor cores, which the a100-80g lacks"},
      {"tp = 16\nglobal_batch = 16\n",
       ":2: [strategy] tp: the tensor-parallel group of replica 0, stage 0 spans nodes"},
      {"tp = 8\nglobal_batch = 7\n",
       ":3: [strategy] global_batch: global_batch = 7 is not divisible by microbatch_size*dp = 2"},
      {"tp = 8\npp = 2\nstages = [10, 10]\nglobal_batch = 8\n",
       ":4: [strategy] stages: covers 20 layers but the model has 32"},
      {"tp = 8\npp = 2\nstages = [32]\nglobal_batch = 8\n",
       ":4: [strategy] stages: has 1 entries but pp*virtual_stages = 2"},
      {"tp = 8\npp = 2\nstages = \"even\"\nglobal_batch = 8\n",
       ":4: [strategy] stages: must be \"balanced\""},
      {"tp = 8\ndp_shares = [3, 4]\nglobal_batch = 8\n",
       ":3: [strategy] dp_shares: shares sum to 7 but global_batch = 8"},
      {"tp = 8\ndp_shares = [8]\nglobal_batch = 8\n",
       ":3: [strategy] dp_shares: has 1 entries but dp = 2"},
      {"tp = 8\nmicrobatch_size = 2\ndp_shares = [3, 5]\nglobal_batch = 8\n",
       "dp_shares: share 3 is not a positive multiple of microbatch_size = 2"},
      {"tp = 8\npp = 2\nschedule = \"interleaved\"\nglobal_batch = 8\n",
       ":1: [strategy] virtual_stages: the interleaved schedule needs virtual_stages >= 2"},
      {"tp = 8\npp = 2\nvirtual_stages = 2\nglobal_batch = 8\n",
       ":4: [strategy] virtual_stages: virtual_stages > 1 needs schedule = \"interleaved\""},
      {"tp = 8\npp = 2\nschedule = \"interleaved\"\nvirtual_stages = 2\nglobal_batch = 3\n",
       ":4: [strategy] schedule: the interleaved schedule needs each replica's microbatch count "
       "(3) to be a multiple of pp = 2"},
      {"tp = 8\nschedule = \"zigzag\"\nglobal_batch = 8\n",
       ":3: [strategy] schedule: must be one of gpipe | 1f1b | interleaved, got \"zigzag\""},
      {"tp = 8\npp = 2\nzero = 2\nglobal_batch = 8\n",
       ":4: [strategy] zero: ZeRO stage 2 partitions gradients"},
      {"tp = 8\ncompression = \"gzip\"\nglobal_batch = 8\n",
       ":3: [strategy] compression: \"gzip\" is not one of none | fp16 | topk:RATIO | "
       "powersgd:RANK"},
      {"tp = 8\ncompression = \"topk:1.5\"\nglobal_batch = 8\n",
       "[strategy] compression: topk ratio must be in (0, 1)"},
      {"tp = 8\nglobal_batch = 8\n[strategy.compression]\ndefault = \"fp16\"\noverrides = [{ "
       "layers = [30, 40], method = \"fp16\" }]\n",
       "[strategy] compression: layer range [30, 40] is not inside [0, 31]"},
      {"tp = 8\nglobal_batch = 8\n[strategy.compression]\nmethod = \"fp16\"\n",
       ":5: [strategy.compression] unknown key 'method'"},
      {"tp = 8\nplacement = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 14]\nglobal_batch = "
       "8\n",
       ":3: [strategy] placement: GPU 14 listed twice"},
      {"tp = 8\nplacement = \"random\"\nglobal_batch = 8\n",
       ":3: [strategy] placement: must be \"tp-pp-dp\""},
      {"tp = 8\npp = 64\nglobal_batch = 8\n",
       "[strategy] tp: tp*pp*cp = 512 does not divide the 16 GPUs"},
      {"tp = 5\ndp = 2\nplacement = [0, 1, 2, 3, 4, 8, 9, 10, 11, 12]\nglobal_batch = 8\n",
       "tp: tp = 5 does not divide the model's 32 attention heads"},
  };
  for (const auto& c : cases) {
    INFO(std::string(c.body));
    TempFile f(std::string("[strategy]\n") + c.body);
    const std::string message = failure_of(load_strategy(f.path(), kLlama7b, kTwoNodes));
    INFO(message);
    CHECK(message.find(f.path()) == 0);
    CHECK(message.find(c.expected) != std::string::npos);
  }
}

TEST_CASE("strategy TOML: a full layout loads and round-trips through strategy_to_toml") {
  TempFile f(R"([strategy]
tp = 4
pp = 2
sp = true
microbatch_size = 2
global_batch = 32
schedule = "interleaved"
virtual_stages = 2
recompute = "selective"
zero = 1
overlap_grad_reduce = false
stages = [7, 9, 9, 7]
placement = "tp-dp-pp"
dp_shares = [12, 20]

[strategy.compression]
default = "fp16"
overrides = [
  { layers = [0, 3], method = "topk:0.01" },
  { layers = [20, 31], method = "powersgd:4" },
]
)");
  const Strategy s = ok(load_strategy(f.path(), kLlama7b, kTwoNodes));
  CHECK(s.dp == 2);
  CHECK(s.layers_per_chunk(32) == std::vector<int>{7, 9, 9, 7});
  CHECK(s.shares() == std::vector<int>{12, 20});
  CHECK(s.compression_of_layer(2).kind == Compression::Kind::kTopK);
  CHECK(s.compression_of_layer(10).kind == Compression::Kind::kFP16);
  CHECK(s.compression_of_layer(25).powersgd_rank == 4);
  CHECK(s.gpu_of_rank(1, 0, 0) == 4);  // tp-dp-pp: the replica index moves before the stage

  TempFile again(strategy_to_toml(s));
  CHECK(ok(load_strategy(again.path(), kLlama7b, kTwoNodes)) == s);
}

TEST_CASE("inline strategies and presets") {
  const Strategy a = ok(load_strategy("tp=8,pp=2,global_batch=64,schedule=gpipe", kLlama7b, kTwoNodes));
  CHECK(a.dp == 1);
  CHECK(a.schedule == Schedule::kGPipe);
  const Strategy b = ok(load_strategy("tp=2,global_batch=64,stages=[32]", kLlama7b, kTwoNodes));
  CHECK(b.stage_layers == std::vector<int>{32});
  const Strategy dp = ok(load_strategy("dp", kLlama7b, kTwoNodes));
  CHECK(dp.dp == 16);
  CHECK(dp.global_batch % 16 == 0);
  const Strategy m = ok(load_strategy("megatron,global_batch=1024", kLlama7b, kTwoNodes));
  CHECK(m.tp == 8);
  CHECK(m.global_batch == 1024);
  CHECK(failure_of(load_strategy("zigzag", kLlama7b, kTwoNodes)).find("unknown preset") !=
        std::string::npos);
  CHECK(failure_of(load_strategy("tp=8,global_batch=8,bogus=1", kLlama7b, kTwoNodes)).find("--strategy: [strategy] unknown key 'bogus'") != std::string::npos);
  CHECK(failure_of(load_strategy("tp=8,8", kLlama7b, kTwoNodes)).find("not key=value") !=
        std::string::npos);
}

TEST_CASE("conditions TOML: tables of exceptions or full arrays, checked against the cluster") {
  TempFile f(
      "[conditions]\ngpu_speed = { 3 = 0.5 }\nnode_inter_bw = [1.0, 0.25]\nfailed_gpus = [7]\n");
  const Conditions c = ok(load_conditions(f.path(), kTwoNodes));
  CHECK(c.speed(3) == 0.5);
  CHECK(c.speed(4) == 1.0);
  CHECK(c.inter(1) == 0.25);
  CHECK(c.failed(7));
  CHECK_FALSE(c.failed(6));
  struct Case {
    const char* toml;
    const char* expected;
  };
  const std::vector<Case> cases = {
      {"[conditions]\ngpu_speed = { 16 = 0.5 }\n",
       ":2: [conditions] gpu_speed: \"16\" is not an index in [0, 15]"},
      {"[conditions]\ngpu_speed = { 1 = -1 }\n", "factor -1"},
      {"[conditions]\nnode_inter_bw = [1.0]\n", "has 1 entries but the cluster has 2"},
      {"[conditions]\nfailed_gpus = [99]\n", "entry 99 is outside [0, 15]"},
      {"[conditions]\nslow = 1\n", "unknown key 'slow'"},
  };
  for (const auto& k : cases) {
    TempFile t(k.toml);
    const std::string message = failure_of(load_conditions(t.path(), kTwoNodes));
    INFO(message);
    CHECK(message.find(k.expected) != std::string::npos);
  }
}
