// transport/plan_name.h replays tests/data/plan_name/vectors.json, the same vectors
// python/parapilot/plan_name.py replays (tests/python/test_plan_name.py): both sides read and
// write every plan name the same way and refuse the same malformed ones.
#include "transport/plan_name.h"

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

using namespace parapilot::transport;
using parapilot::StatusOr;

namespace {

nlohmann::json vectors() {
  const auto path = std::filesystem::path(PARAPILOT_TEST_DATA_DIR) / "plan_name" / "vectors.json";
  std::ifstream in(path);
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

CompressionMethod method(const std::string& name) {
  if (name == "fp16") return CompressionMethod::fp16;
  if (name == "topk") return CompressionMethod::topk;
  if (name == "powersgd") return CompressionMethod::powersgd;
  REQUIRE(name == "none");
  return CompressionMethod::none;
}

PlanName typed(const std::string& kind, const nlohmann::json& f) {
  if (kind == "layout") {
    LayoutPlanName n;
    n.dp = f.at("dp");
    n.tp = f.at("tp");
    n.pp = f.at("pp");
    n.microbatch = f.at("microbatch");
    n.sp = f.at("sp");
    n.virtual_stages = f.at("virtual_stages");
    n.zero = f.at("zero");
    n.elastic = f.at("elastic");
    if (!f.at("schedule").is_null()) n.schedule = f.at("schedule").get<std::string>();
    if (!f.at("recompute").is_null()) n.recompute = f.at("recompute").get<std::string>();
    n.stage_layers = f.at("stage_layers").get<std::vector<int>>();
    n.dp_shares = f.at("dp_shares").get<std::vector<int>>();
    n.gpus = f.at("gpus").get<std::vector<int>>();
    return n;
  }
  if (kind == "action") {
    ActionPlanName a;
    a.shares = f.at("shares").get<std::vector<double>>();
    for (const auto& m : f.at("compression")) a.compression.push_back(method(m.get<std::string>()));
    a.topk_ratio = f.at("topk_ratio");
    a.powersgd_rank = f.at("powersgd_rank");
    a.bucket_bytes = f.at("bucket_bytes");
    a.microbatch = f.at("microbatch");
    a.layout = f.at("layout");
    return a;
  }
  REQUIRE(kind == "label");
  return LabelPlanName{f.at("label").get<std::string>()};
}

PlanNameKind kind_named(const std::string& kind) {
  if (kind == "layout") return PlanNameKind::layout;
  if (kind == "action") return PlanNameKind::action;
  return PlanNameKind::label;
}

}  // namespace

TEST_CASE("valid plan names decode to their fields and encode back") {
  const nlohmann::json v = vectors();
  REQUIRE(v.at("valid").size() >= 10);
  for (const nlohmann::json& t : v.at("valid")) {
    const std::string text = t.at("text");
    CAPTURE(text);
    CHECK(plan_name_kind(text) == kind_named(t.at("kind")));
    StatusOr<PlanName> got = decode_plan_name(text);
    REQUIRE(got.ok());
    PlanName want = typed(t.at("kind"), t.at("fields"));
    REQUIRE(got->index() == want.index());
    if (auto* a = std::get_if<ActionPlanName>(&*got)) {
      const auto& shares = std::get<ActionPlanName>(want).shares;
      REQUIRE(a->shares.size() == shares.size());
      for (std::size_t i = 0; i < shares.size(); ++i)
        CHECK(a->shares[i] == doctest::Approx(shares[i]).epsilon(1e-12));
      a->shares = shares;
    }
    CHECK(*got == want);
    StatusOr<std::string> encoded = encode_plan_name(want);
    REQUIRE(encoded.ok());
    CHECK(*encoded == t.value("encoded", text));
  }
}

TEST_CASE("malformed plan names are refused naming the field") {
  const nlohmann::json v = vectors();
  REQUIRE(v.at("invalid").size() >= 20);
  for (const nlohmann::json& t : v.at("invalid")) {
    const std::string text = t.at("text");
    CAPTURE(text);
    StatusOr<PlanName> got = decode_plan_name(text);
    REQUIRE_FALSE(got.ok());
    CHECK(got.status().code() == parapilot::StatusCode::kInvalidArgument);
    for (const auto& word : t.at("error")) {
      CAPTURE(word);
      CHECK(got.status().message().find(word.get<std::string>()) != std::string::npos);
    }
  }
}

TEST_CASE("what cannot be written is refused") {
  ActionPlanName a;
  a.layout = "dp=1;pp=4";
  CHECK_FALSE(encode_plan_name(a).ok());
  a.layout.clear();
  a.shares.assign(40, 0.1);
  CHECK_FALSE(encode_plan_name(a).ok());
  CHECK_FALSE(encode_plan_name(LabelPlanName{"dp4-anything"}).ok());
}
