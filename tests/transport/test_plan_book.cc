// The rank's side of the switch protocol replayed from the transcripts in tests/data/switch/
// (their format is in that folder's README.md); the Python client's PlanBook replays the same
// files (tests/python/test_plans.py).
#include <doctest/doctest.h>

#include <deque>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "transport/plan_book.h"

using namespace parapilot::transport;

namespace {

std::string rest_of(std::istringstream& in) {
  std::string text;
  std::getline(in >> std::ws, text);
  return text;
}

// Replays one transcript; every mismatch is a failed CHECK naming the file and line.
void replay(const std::filesystem::path& path) {
  std::ifstream file(path);
  REQUIRE(file.good());
  std::deque<Message> sent;
  PlanBook<std::uint64_t> book(3, [&](const Message& m) { sent.push_back(m); });
  std::string line;
  int number = 0;
  while (std::getline(file, line)) {
    ++number;
    if (const auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream in(line);
    std::string verb;
    if (!(in >> verb)) continue;
    INFO(path.filename().string() << ":" << number << ": " << line);
    std::string arrow, word;
    std::uint64_t id = 0, step = 0, after = 0, want = 0;
    if (verb == "recv") {
      in >> word;
      if (word == "prepare") {
        in >> id;
        PlanPrepare p;
        p.plan_id = id;
        const std::optional<PlanPrepare> handed = book.on_message(p);
        CHECK((handed && handed->plan_id == id));
      } else if (word == "commit") {
        in >> id >> step;
        CHECK(!book.on_message(PlanCommit{id, step}));
      } else if (word == "abort") {
        in >> id;
        CHECK(!book.on_message(PlanAbort{id, rest_of(in)}));
      } else if (word == "shutdown") {
        CHECK(!book.on_message(Shutdown{rest_of(in)}));
      } else {
        FAIL("unknown message " << word);
      }
    } else if (verb == "stage") {
      in >> id;
      book.stage(id, id);
    } else if (verb == "ready") {
      in >> id;
      book.ready(id);
    } else if (verb == "refuse") {
      in >> id;
      book.refuse(id, rest_of(in));
    } else if (verb == "agent-lost") {
      book.drop_uncommitted();
    } else if (verb == "committed-at") {
      in >> step >> after >> arrow >> want;
      CHECK(book.committed_at(step, after) == want);
    } else if (verb == "holds") {
      in >> id >> arrow >> word;
      CHECK(book.holds(id) == (word == "yes"));
    } else if (verb == "applied") {
      in >> id >> arrow >> word;
      const std::optional<std::uint64_t> staged = book.applied(id);
      CHECK(staged.has_value() == (word == "yes"));
      if (staged) CHECK(*staged == id);
    } else if (verb == "missed") {
      in >> id;
      book.missed(id, rest_of(in));
    } else if (verb == "sent") {
      in >> word;
      if (word == "none") {
        CHECK(sent.empty());
        sent.clear();
        continue;
      }
      REQUIRE(!sent.empty());
      const Message m = sent.front();
      sent.pop_front();
      if (word == "ready") {
        std::string outcome;
        in >> id >> outcome;
        const auto* r = std::get_if<PlanReady>(&m);
        REQUIRE(r != nullptr);
        CHECK(r->plan_id == id);
        CHECK(r->rank == 3);
        CHECK(r->ok == (outcome == "ok"));
        if (!r->ok) CHECK(!r->detail.empty());
      } else if (word == "ack") {
        in >> id;
        const auto* a = std::get_if<Ack>(&m);
        REQUIRE(a != nullptr);
        CHECK(a->acked == MessageType::plan_commit);
        CHECK(a->id == id);
        CHECK(a->rank == 3);
      } else {
        FAIL("unknown sent message " << word);
      }
    } else if (verb == "stop" || verb == "no-plans") {
      in >> arrow;
      const std::string expected = rest_of(in);
      const std::optional<std::string> reason =
          verb == "stop" ? book.stop_reason() : book.no_plans_reason();
      if (expected == "none")
        CHECK(!reason.has_value());
      else
        CHECK(reason.value_or("<none>") == expected);
    } else {
      FAIL("unknown line " << verb);
    }
  }
}

}  // namespace

TEST_CASE("the rank's plan book follows every switch-protocol transcript") {
  const std::filesystem::path dir = std::filesystem::path(PARAPILOT_TEST_DATA_DIR) / "switch";
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".txt") continue;
    replay(entry.path());
    ++files;
  }
  CHECK(files >= 9);
}
