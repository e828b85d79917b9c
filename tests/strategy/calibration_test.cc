// The cost model against published measurements (tests/data): Megatron-LM SC'21 Table 1 on
// A100 (unfused attention, as the 2021 code ran it) and 2024 Hopper runs (NVIDIA's recipes
// and the Nemotron-4 15B report: flash attention, GQA, context parallelism, the distributed
// optimizer). Physical constants only (docs/cost-model.md says which were fitted on which
// rows); every row ran, so it must fit in memory, and it must be predicted within 10%.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>

#include "strategy/cost_model.h"
#include "core/error.h"
#include "strategy/published_runs.h"
#include "strategy/spec_io.h"
#include "tests/test_util.h"

using namespace parapilot;
using parapilot::testing::ok;

namespace {

std::string data(const std::string& name) {
  return std::string(PARAPILOT_TEST_DATA_DIR) + "/" + name;
}

void print(const PublishedRun& run, const CostBreakdown& b, double error) {
  std::printf(
      "calibration %-22s error %+5.1f%%  (iter %.3fs: compute %.3f recompute %.3f tp %.3f cp "
      "%.3f pp %.3f bubble %.3f dp %.3f opt %.3f; mem %.1f of %.0f GiB)\n",
      run.id.c_str(), 100 * error, b.iteration_time_s, b.compute_s, b.recompute_s, b.tp_comm_s,
      b.cp_comm_s, b.pp_comm_s, b.bubble_s, b.dp_comm_s, b.optimizer_s, b.memory_gib,
      b.memory_capacity_gib);
}

// Every row ran: it fits, and its published figure is predicted within 10%.
void check_within_10_percent(const std::vector<PublishedRun>& runs, Attention attention) {
  for (const PublishedRun& run : runs) {
    CHECK(run.strategy.attention == attention);
    const CostBreakdown b = CostModel(run.model, run.cluster).evaluate(run.strategy);
    const double error = run.predicted(b) / run.published() - 1.0;
    print(run, b, error);
    CHECK_MESSAGE(b.fits_in_memory, run.id << ": " << b.reason);
    CHECK_MESSAGE(std::abs(error) <= 0.10, run.id << " error " << 100 * error << "%");
  }
}

}  // namespace

TEST_CASE("cost model reproduces Megatron-LM SC'21 Table 1 within 10% (attention unfused)") {
  const auto runs = ok(load_sc21_runs(data("megatron-sc21-table1.csv")));
  REQUIRE(runs.size() == 4);
  check_within_10_percent(runs, Attention::kUnfused);
}

TEST_CASE("cost model predicts the published Hopper runs within 10% and fits them in memory") {
  const auto runs = ok(load_hopper_runs(data("modern-given.csv")));
  REQUIRE(runs.size() == 3);
  check_within_10_percent(runs, Attention::kFlash);
}

TEST_CASE("published-run files: a malformed row is refused with its file, line and column") {
  const std::string path = "/tmp/parapilot-calibration-test.csv";
  auto message_of = [&](const std::string& body) {
    {
      std::ofstream out(path);
      out << "# comment\n" << body;
    }
    const auto runs = load_hopper_runs(path);
    return runs.ok() ? std::string("(no error)") : runs.status().message();
  };
  const std::string header =
      "id,model_name,layers,hidden,heads,kv_heads,ffn_hidden,vocab,seq_len,activation,tied,gpu,"
      "gpus,inter_node_Gbps,tp,pp,cp,sp,virtual_stages,microbatch,global_batch,recompute,zero,"
      "attention,fp8,iteration_s\n";
  const std::string good =
      "X1,m,4,512,8,8,2048,1000,1024,gelu,true,h100,8,400,2,1,2,true,1,1,8,none,1,flash,false,1.0";
  CHECK(message_of(header + good + "\n") == "(no error)");
  CHECK(message_of(header).find(": no rows") != std::string::npos);
  std::string bad = good;
  bad.replace(bad.find(",4,512"), 6, ",four,512");
  CHECK(message_of(header + bad + "\n").find(":3: layers: not an integer: four") !=
        std::string::npos);
  bad = good;
  bad.replace(bad.find("h100"), 4, "h999");
  CHECK(message_of(header + bad + "\n").find(":3: gpu: ") != std::string::npos);
  bad = good;
  bad.replace(bad.find(",2,1,2,"), 7, ",2,1,3,");  // cp = 3 does not divide 8 GPUs / tp
  CHECK(message_of(header + bad + "\n").find(":3: ") != std::string::npos);
  CHECK(message_of(header + bad + "\n").find("cp") != std::string::npos);
  bad = good;
  bad.replace(bad.find("false,1.0"), 9, "false,-1");
  CHECK(message_of(header + bad + "\n").find("iteration_s: not a positive number") !=
        std::string::npos);
  std::remove(path.c_str());
}

TEST_CASE("Korthikanti et al. 2022: the 530B GPT's MFU within 10% (attention unfused)") {
  // Their abstract: 54.2% MFU with sequence parallelism and selective recompute, 42.1% with
  // full recompute, on 2,240 A100 at tp = 8, pp = 35 (the global batch of 2,240 is assumed).
  ModelSpec m;
  m.name = "gpt-530b";
  m.layers = 105;
  m.hidden = 20480;
  m.heads = 128;
  m.kv_heads = 128;
  m.ffn_hidden = 4 * m.hidden;
  m.seq_len = 2048;
  m.vocab = 51200;
  const ClusterSpec c = ok(load_cluster("280x8xa100-80g"));
  const CostModel cost(m, c);
  const struct {
    const char* layout;
    double published_mfu;
  } rows[] = {{"tp=8,pp=35,global_batch=2240,sp=true,recompute=selective,attention=unfused", 0.542},
              {"tp=8,pp=35,global_batch=2240,sp=true,recompute=full,attention=unfused", 0.421}};
  for (const auto& row : rows) {
    const CostBreakdown b = cost.evaluate(ok(load_strategy(row.layout, m, c)));
    INFO(row.layout << ": MFU " << b.mfu);
    CHECK(b.fits_in_memory);
    CHECK(std::abs(b.mfu / row.published_mfu - 1) <= 0.10);
  }
}
