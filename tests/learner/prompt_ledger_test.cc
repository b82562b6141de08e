#include "learner/prompt_ledger.h"

#include <gtest/gtest.h>
#include <sqlite3.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace grpo::learner {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

// A fake wall clock in unix ms; safe to read from several threads.
struct FakeClock {
  std::atomic<int64_t> ms{1000};
};

class PromptLedgerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("prompt_ledger_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    path_ = (dir_ / "ledger.db").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::unique_ptr<PromptLedger> OpenLedger() {
    PromptLedgerOptions options;
    options.now_ms = [c = &clock_] { return c->ms.load(); };
    auto ledger = PromptLedger::Open(path_, options);
    EXPECT_TRUE(ledger.ok()) << ledger.status().ToString();
    return ledger.ok() ? std::move(ledger).value() : nullptr;
  }

  // n rows {"prompt": "p<i>"}.
  static std::vector<std::string> Rows(int n) {
    std::vector<std::string> rows;
    for (int i = 0; i < n; ++i) rows.push_back(R"({"prompt": "p)" + std::to_string(i) + R"("})");
    return rows;
  }

  static std::vector<std::string> Ids(const std::vector<Lease>& leases) {
    std::vector<std::string> ids;
    for (const Lease& l : leases) ids.push_back(l.prompt_id);
    return ids;
  }

  PromptState StateOf(PromptLedger& ledger, const std::string& prompt_id) {
    auto r = ledger.GetPrompt(prompt_id);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? r->state : PromptState::kQueued;
  }

  fs::path dir_;
  std::string path_;
  FakeClock clock_;
};

void ExpectCounts(PromptLedger& ledger, int64_t queued, int64_t leased, int64_t trained,
                  int64_t rejected) {
  auto c = ledger.Counts();
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->queued, queued);
  EXPECT_EQ(c->leased, leased);
  EXPECT_EQ(c->trained, trained);
  EXPECT_EQ(c->rejected, rejected);
}

TEST_F(PromptLedgerTest, AddDatasetQueuesEveryLineUnderStableIds) {
  auto ledger = OpenLedger();
  const std::vector<std::string> lines = {
      R"({"prompt": "What is 2+2?", "answer": "4"})",
      R"({"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}]})",
      R"({"prompt": "Name a prime.", "answer": "2"})",
  };
  auto info = ledger->AddDataset("key-1", lines);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->dataset_id, "ds-1");
  EXPECT_EQ(info->prompt_count, 3);
  EXPECT_TRUE(info->created);
  ExpectCounts(*ledger, 3, 0, 0, 0);

  auto p = ledger->GetPrompt("ds-1:1");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->dataset_id, "ds-1");
  EXPECT_EQ(p->row_json, lines[1]);
  EXPECT_EQ(p->state, PromptState::kQueued);
  EXPECT_EQ(p->attempts, 0);
  EXPECT_EQ(p->pass, 0);
  EXPECT_EQ(p->created_ms, 1000);
  EXPECT_EQ(ledger->GetPrompt("ds-1:3").status().code(), StatusCode::kNotFound);

  auto second = ledger->AddDataset("key-2", Rows(2));
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->dataset_id, "ds-2");
  ExpectCounts(*ledger, 5, 0, 0, 0);
}

TEST_F(PromptLedgerTest, BlankLinesAreSkippedButKeepTheirIndex) {
  auto ledger = OpenLedger();
  auto info = ledger->AddDataset("k", {R"({"prompt": "a"})", "  ", R"({"prompt": "b"})", ""});
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->prompt_count, 2);
  EXPECT_TRUE(ledger->GetPrompt("ds-1:0").ok());
  EXPECT_EQ(ledger->GetPrompt("ds-1:1").status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(ledger->GetPrompt("ds-1:2").ok());
}

TEST_F(PromptLedgerTest, BadLineRejectsWholeSubmissionNamingTheLine) {
  auto ledger = OpenLedger();
  std::vector<std::string> lines = Rows(2);
  lines.push_back(R"({"text": "no prompt field"})");
  lines.push_back(R"({"prompt": "fine"})");
  auto info = ledger->AddDataset("k", lines);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(info.status().message().find("line 3"), std::string::npos) << info.status().message();
  ExpectCounts(*ledger, 0, 0, 0, 0);
  EXPECT_EQ(ledger->GetPrompt("ds-1:0").status().code(), StatusCode::kNotFound);

  // Nothing of the refused submission remains: the key is free and ids start again at ds-1.
  auto retry = ledger->AddDataset("k", Rows(2));
  ASSERT_TRUE(retry.ok()) << retry.status().ToString();
  EXPECT_EQ(retry->dataset_id, "ds-1");
  EXPECT_TRUE(retry->created);
}

TEST_F(PromptLedgerTest, EveryKindOfMalformedRowIsInvalidArgument) {
  auto ledger = OpenLedger();
  const std::vector<std::string> bad = {
      R"({"prompt": "unterminated)",
      R"(["prompt", "x"])",
      R"("just a string")",
      R"({"prompt": 7})",
      R"({"prompt": ""})",
      R"({"messages": "hi"})",
      R"({"messages": []})",
      R"({"messages": [{"content": "no role"}]})",
      R"({"messages": [{"role": "user"}]})",
      R"({"messages": [{"role": "user", "content": 3}]})",
      R"({"messages": ["user: hi"]})",
      R"({"prompt": 1, "messages": [{"role": "user", "content": "hi"}]})",
  };
  for (const std::string& row : bad) {
    auto info = ledger->AddDataset("", {R"({"prompt": "ok"})", row});
    ASSERT_FALSE(info.ok()) << row;
    EXPECT_EQ(info.status().code(), StatusCode::kInvalidArgument) << row;
    EXPECT_NE(info.status().message().find("line 2"), std::string::npos)
        << row << " -> " << info.status().message();
  }
  ExpectCounts(*ledger, 0, 0, 0, 0);
  EXPECT_EQ(ledger->AddDataset("", {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ledger->AddDataset("", {"", " "}).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(PromptLedgerTest, ResubmittingSameKeyAndLinesReturnsTheExistingDataset) {
  auto ledger = OpenLedger();
  auto first = ledger->AddDataset("key", Rows(3));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto again = ledger->AddDataset("key", Rows(3));
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->dataset_id, "ds-1");
  EXPECT_EQ(again->prompt_count, 3);
  EXPECT_FALSE(again->created);
  ExpectCounts(*ledger, 3, 0, 0, 0);
}

TEST_F(PromptLedgerTest, SameKeyWithDifferentLinesIsAlreadyExists) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("key", Rows(3)).ok());
  auto other = ledger->AddDataset("key", Rows(4));
  EXPECT_EQ(other.status().code(), StatusCode::kAlreadyExists);
  EXPECT_NE(other.status().message().find("key"), std::string::npos);
  ExpectCounts(*ledger, 3, 0, 0, 0);
}

TEST_F(PromptLedgerTest, EmptyKeyNeverDeduplicates) {
  auto ledger = OpenLedger();
  auto a = ledger->AddDataset("", Rows(2));
  auto b = ledger->AddDataset("", Rows(2));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->dataset_id, "ds-1");
  EXPECT_EQ(b->dataset_id, "ds-2");
  ExpectCounts(*ledger, 4, 0, 0, 0);
}

TEST_F(PromptLedgerTest, LeasesOldestFirstUpToMaxPrompts) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("a", Rows(3)).ok());
  ASSERT_TRUE(ledger->AddDataset("b", Rows(2)).ok());

  auto first = ledger->LeasePrompts("w1", 2, milliseconds(500));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(Ids(*first), (std::vector<std::string>{"ds-1:0", "ds-1:1"}));
  EXPECT_EQ((*first)[0].row_json, R"({"prompt": "p0"})");
  EXPECT_EQ((*first)[0].deadline_ms, 1500);  // now 1000 + 500
  EXPECT_EQ((*first)[0].pass, 0);
  EXPECT_EQ((*first)[0].attempts, 0);

  auto second = ledger->LeasePrompts("w2", 2, milliseconds(500));
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(Ids(*second), (std::vector<std::string>{"ds-1:2", "ds-2:0"}));
  auto third = ledger->LeasePrompts("w1", 2, milliseconds(500));
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(Ids(*third), (std::vector<std::string>{"ds-2:1"}));
  auto none = ledger->LeasePrompts("w1", 2, milliseconds(500));
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  ExpectCounts(*ledger, 0, 5, 0, 0);

  std::set<std::string> lease_ids;
  for (const auto* batch : {&*first, &*second, &*third}) {
    for (const Lease& l : *batch) {
      EXPECT_EQ(l.lease_id.size(), 32u);
      EXPECT_EQ(l.lease_id.find_first_not_of("0123456789abcdef"), std::string::npos);
      lease_ids.insert(l.lease_id);
    }
  }
  EXPECT_EQ(lease_ids.size(), 5u);
  auto p = ledger->GetPrompt("ds-1:2");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->worker_id, "w2");
  EXPECT_EQ(p->lease_id, (*second)[0].lease_id);
  EXPECT_EQ(p->lease_deadline_ms, 1500);
}

TEST_F(PromptLedgerTest, LeasePromptsRejectsBadArguments) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("a", Rows(1)).ok());
  EXPECT_EQ(ledger->LeasePrompts("", 1, milliseconds(10)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ledger->LeasePrompts("w", 0, milliseconds(10)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ledger->LeasePrompts("w", 1, milliseconds(0)).status().code(),
            StatusCode::kInvalidArgument);
  ExpectCounts(*ledger, 1, 0, 0, 0);
}

TEST_F(PromptLedgerTest, ExpiredLeaseReturnsToQueueAndCountsAnAttempt) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("a", Rows(1)).ok());
  auto first = ledger->LeasePrompts("w1", 1, milliseconds(100));  // deadline 1100
  ASSERT_TRUE(first.ok() && first->size() == 1);

  clock_.ms = 1100;  // at the deadline the lease still holds
  auto early = ledger->LeasePrompts("w2", 1, milliseconds(100));
  ASSERT_TRUE(early.ok());
  EXPECT_TRUE(early->empty());
  ExpectCounts(*ledger, 0, 1, 0, 0);

  clock_.ms = 1101;
  auto late = ledger->LeasePrompts("w2", 1, milliseconds(100));
  ASSERT_TRUE(late.ok());
  ASSERT_EQ(late->size(), 1u);
  EXPECT_EQ((*late)[0].prompt_id, "ds-1:0");
  EXPECT_EQ((*late)[0].attempts, 1);
  EXPECT_EQ((*late)[0].deadline_ms, 1201);
  EXPECT_NE((*late)[0].lease_id, (*first)[0].lease_id);
  auto p = ledger->GetPrompt("ds-1:0");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->attempts, 1);
  EXPECT_EQ(p->worker_id, "w2");
  // The first worker's lease is gone for good.
  EXPECT_EQ(ledger->CompleteLease((*first)[0].lease_id, "ds-1:0").code(),
            StatusCode::kFailedPrecondition);
}

TEST_F(PromptLedgerTest, CompleteMarksPromptTrained) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("a", Rows(2)).ok());
  auto leases = ledger->LeasePrompts("w", 2, milliseconds(100));
  ASSERT_TRUE(leases.ok() && leases->size() == 2);
  clock_.ms = 1100;  // the deadline itself is still inside the lease
  ASSERT_TRUE(ledger->CompleteLease((*leases)[0].lease_id, "ds-1:0").ok());
  auto p = ledger->GetPrompt("ds-1:0");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->state, PromptState::kTrained);
  EXPECT_EQ(p->lease_id, "");
  EXPECT_EQ(p->updated_ms, 1100);
  ExpectCounts(*ledger, 0, 1, 1, 0);
}

TEST_F(PromptLedgerTest, CompleteUnderExpiredLeaseIsRefusedAndLeavesPromptLeased) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("a", Rows(1)).ok());
  auto leases = ledger->LeasePrompts("w", 1, milliseconds(100));
  ASSERT_TRUE(leases.ok() && leases->size() == 1);
  clock_.ms = 1101;
  Status s = ledger->CompleteLease((*leases)[0].lease_id, "ds-1:0");
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("unknown or expired lease"), std::string::npos) << s.message();
  auto p = ledger->GetPrompt("ds-1:0");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->state, PromptState::kLeased);
  EXPECT_EQ(p->lease_id, (*leases)[0].lease_id);
  ExpectCounts(*ledger, 0, 1, 0, 0);
}

TEST_F(PromptLedgerTest, CompleteUnderUnknownLeaseOrPromptIsRefused) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("a", Rows(1)).ok());
  auto leases = ledger->LeasePrompts("w", 1, milliseconds(100));
  ASSERT_TRUE(leases.ok() && leases->size() == 1);
  EXPECT_EQ(ledger->CompleteLease("00000000000000000000000000000000", "ds-1:0").code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(ledger->CompleteLease("", "ds-1:0").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(ledger->CompleteLease((*leases)[0].lease_id, "ds-9:0").code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(StateOf(*ledger, "ds-1:0"), PromptState::kLeased);
  ExpectCounts(*ledger, 0, 1, 0, 0);
}

TEST_F(PromptLedgerTest, CompleteWithAnotherPromptsLeaseIsRefused) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("a", Rows(2)).ok());
  auto leases = ledger->LeasePrompts("w", 2, milliseconds(100));
  ASSERT_TRUE(leases.ok() && leases->size() == 2);
  EXPECT_EQ(ledger->CompleteLease((*leases)[0].lease_id, "ds-1:1").code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(StateOf(*ledger, "ds-1:0"), PromptState::kLeased);
  EXPECT_EQ(StateOf(*ledger, "ds-1:1"), PromptState::kLeased);
}

TEST_F(PromptLedgerTest, DoubleCompleteIsRefused) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("a", Rows(1)).ok());
  auto leases = ledger->LeasePrompts("w", 1, milliseconds(100));
  ASSERT_TRUE(leases.ok() && leases->size() == 1);
  ASSERT_TRUE(ledger->CompleteLease((*leases)[0].lease_id, "ds-1:0").ok());
  Status again = ledger->CompleteLease((*leases)[0].lease_id, "ds-1:0");
  EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(again.message().find("TRAINED"), std::string::npos) << again.message();
  ExpectCounts(*ledger, 0, 0, 1, 0);
}

TEST_F(PromptLedgerTest, ReleaseReturnsPromptToQueueWithoutAnAttempt) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("a", Rows(2)).ok());
  auto leases = ledger->LeasePrompts("w1", 2, milliseconds(100));
  ASSERT_TRUE(leases.ok() && leases->size() == 2);
  ASSERT_TRUE(ledger->ReleaseLease((*leases)[0].lease_id, "ds-1:0").ok());
  auto p = ledger->GetPrompt("ds-1:0");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->state, PromptState::kQueued);
  EXPECT_EQ(p->attempts, 0);
  EXPECT_EQ(p->lease_id, "");
  ExpectCounts(*ledger, 1, 1, 0, 0);
  // The released lease can no longer complete; the prompt is leased again.
  EXPECT_EQ(ledger->CompleteLease((*leases)[0].lease_id, "ds-1:0").code(),
            StatusCode::kFailedPrecondition);
  auto again = ledger->LeasePrompts("w2", 5, milliseconds(100));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(Ids(*again), (std::vector<std::string>{"ds-1:0"}));
}

TEST_F(PromptLedgerTest, ExpiringAWorkersLeasesRequeuesOnlyItsPromptsWithAnAttempt) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("a", Rows(5)).ok());
  auto gone = ledger->LeasePrompts("w-gone", 2, milliseconds(60'000));    // ds-1:0, ds-1:1
  auto alive = ledger->LeasePrompts("w-alive", 2, milliseconds(60'000));  // ds-1:2, ds-1:3
  ASSERT_TRUE(gone.ok() && gone->size() == 2 && alive.ok() && alive->size() == 2);
  auto moved = ledger->ExpireWorkerLeases("w-gone");
  ASSERT_TRUE(moved.ok()) << moved.status().ToString();
  EXPECT_EQ(*moved, 2);
  ExpectCounts(*ledger, 3, 2, 0, 0);  // ds-1:0, ds-1:1 back beside ds-1:4; w-alive keeps its two
  for (const char* id : {"ds-1:0", "ds-1:1"}) {
    auto p = ledger->GetPrompt(id);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->state, PromptState::kQueued) << id;
    EXPECT_EQ(p->attempts, 1) << id;
  }
  EXPECT_EQ(StateOf(*ledger, "ds-1:2"), PromptState::kLeased);
  // The gone worker's lease no longer completes; the live one's still does.
  EXPECT_EQ(ledger->CompleteLease((*gone)[0].lease_id, "ds-1:0").code(),
            StatusCode::kFailedPrecondition);
  EXPECT_TRUE(ledger->CompleteLease((*alive)[0].lease_id, "ds-1:2").ok());
  auto none = ledger->ExpireWorkerLeases("w-gone");
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, 0);
}

TEST_F(PromptLedgerTest, RejectStoresReasonAndNeverLeasesAgain) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("a", Rows(1)).ok());
  auto leases = ledger->LeasePrompts("w", 1, milliseconds(100));
  ASSERT_TRUE(leases.ok() && leases->size() == 1);
  ASSERT_TRUE(ledger->RejectPrompt((*leases)[0].lease_id, "ds-1:0", "prompt too long").ok());
  auto p = ledger->GetPrompt("ds-1:0");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->state, PromptState::kRejected);
  EXPECT_EQ(p->reject_reason, "prompt too long");
  ExpectCounts(*ledger, 0, 0, 0, 1);
  clock_.ms = 1'000'000;
  auto more = ledger->LeasePrompts("w", 1, milliseconds(100));
  ASSERT_TRUE(more.ok());
  EXPECT_TRUE(more->empty());
}

TEST_F(PromptLedgerTest, CountsForDatasetCountsOnlyThatDataset) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("a", Rows(2)).ok());
  ASSERT_TRUE(ledger->AddDataset("b", Rows(3)).ok());
  ASSERT_TRUE(ledger->LeasePrompts("w", 3, milliseconds(100)).ok());  // ds-1:0, ds-1:1, ds-2:0
  auto a = ledger->CountsForDataset("ds-1");
  auto b = ledger->CountsForDataset("ds-2");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->queued, 0);
  EXPECT_EQ(a->leased, 2);
  EXPECT_EQ(b->queued, 2);
  EXPECT_EQ(b->leased, 1);
  EXPECT_EQ(ledger->CountsForDataset("ds-3").status().code(), StatusCode::kNotFound);
}

TEST_F(PromptLedgerTest, NextPassIsRefusedWhilePromptsAreOutstanding) {
  auto ledger = OpenLedger();
  EXPECT_EQ(ledger->StartNextPass(2).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(ledger->AddDataset("a", Rows(2)).ok());
  auto leases = ledger->LeasePrompts("w", 1, milliseconds(100));
  ASSERT_TRUE(leases.ok() && leases->size() == 1);
  ASSERT_TRUE(ledger->CompleteLease((*leases)[0].lease_id, "ds-1:0").ok());
  auto next = ledger->StartNextPass(2);  // ds-1:1 still queued
  EXPECT_EQ(next.status().code(), StatusCode::kFailedPrecondition);
  ExpectCounts(*ledger, 1, 0, 1, 0);
  EXPECT_EQ(ledger->StartNextPass(0).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(PromptLedgerTest, NextPassRequeuesTrainedPromptsButNotRejectedOnes) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("a", Rows(3)).ok());
  auto leases = ledger->LeasePrompts("w", 3, milliseconds(100));
  ASSERT_TRUE(leases.ok() && leases->size() == 3);
  ASSERT_TRUE(ledger->CompleteLease((*leases)[0].lease_id, "ds-1:0").ok());
  ASSERT_TRUE(ledger->RejectPrompt((*leases)[1].lease_id, "ds-1:1", "bad").ok());
  ASSERT_TRUE(ledger->CompleteLease((*leases)[2].lease_id, "ds-1:2").ok());

  auto next = ledger->StartNextPass(2);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_TRUE(*next);
  ExpectCounts(*ledger, 2, 0, 0, 1);
  EXPECT_EQ(ledger->Counts()->pass, 1);

  auto second = ledger->LeasePrompts("w", 5, milliseconds(100));
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(Ids(*second), (std::vector<std::string>{"ds-1:0", "ds-1:2"}));
  EXPECT_EQ((*second)[0].pass, 1);
  for (const Lease& l : *second) ASSERT_TRUE(ledger->CompleteLease(l.lease_id, l.prompt_id).ok());

  // Pass 1 was the last of 2: nothing changes.
  auto done = ledger->StartNextPass(2);
  ASSERT_TRUE(done.ok());
  EXPECT_FALSE(*done);
  ExpectCounts(*ledger, 0, 0, 2, 1);
  EXPECT_EQ(ledger->Counts()->pass, 1);
}

TEST_F(PromptLedgerTest, ConcurrentLeasersNeverShareAPrompt) {
  auto ledger = OpenLedger();
  constexpr int kPrompts = 400, kThreads = 4;
  ASSERT_TRUE(ledger->AddDataset("a", Rows(kPrompts)).ok());
  std::vector<std::vector<Lease>> got(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string worker = std::to_string(t) + "-worker";
      while (true) {
        auto batch = ledger->LeasePrompts(worker, 7, milliseconds(60'000));
        if (!batch.ok() || batch->empty()) break;
        got[t].insert(got[t].end(), batch->begin(), batch->end());
      }
    });
  }
  for (std::thread& t : threads) t.join();

  std::map<std::string, int> times_leased;
  std::set<std::string> lease_ids;
  for (const auto& leases : got) {
    for (const Lease& l : leases) {
      ++times_leased[l.prompt_id];
      lease_ids.insert(l.lease_id);
    }
  }
  EXPECT_EQ(times_leased.size(), static_cast<size_t>(kPrompts));
  for (const auto& [id, n] : times_leased) EXPECT_EQ(n, 1) << id;
  EXPECT_EQ(lease_ids.size(), static_cast<size_t>(kPrompts));
  ExpectCounts(*ledger, 0, kPrompts, 0, 0);
}

TEST_F(PromptLedgerTest, ReopenPreservesStatesLeasesAndIdempotencyKeys) {
  std::string lease2;
  {
    auto ledger = OpenLedger();
    ASSERT_TRUE(ledger->AddDataset("key", Rows(4)).ok());
    auto leases = ledger->LeasePrompts("w", 3, milliseconds(1000));  // deadline 2000
    ASSERT_TRUE(leases.ok() && leases->size() == 3);
    ASSERT_TRUE(ledger->CompleteLease((*leases)[0].lease_id, "ds-1:0").ok());
    ASSERT_TRUE(ledger->RejectPrompt((*leases)[1].lease_id, "ds-1:1", "bad").ok());
    lease2 = (*leases)[2].lease_id;
  }
  {
    clock_.ms = 1500;
    auto ledger = OpenLedger();
    ExpectCounts(*ledger, 1, 1, 1, 1);
    auto p = ledger->GetPrompt("ds-1:1");
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->reject_reason, "bad");
    auto again = ledger->AddDataset("key", Rows(4));
    ASSERT_TRUE(again.ok());
    EXPECT_FALSE(again->created);
    EXPECT_EQ(StateOf(*ledger, "ds-1:2"), PromptState::kLeased);
    EXPECT_EQ(ledger->GetPrompt("ds-1:2")->lease_id, lease2);
  }
  {
    // Past the deadline: the next lease call reclaims ds-1:2 ahead of ds-1:3 (FIFO).
    clock_.ms = 2001;
    auto ledger = OpenLedger();
    auto leases = ledger->LeasePrompts("w2", 10, milliseconds(1000));
    ASSERT_TRUE(leases.ok());
    EXPECT_EQ(Ids(*leases), (std::vector<std::string>{"ds-1:2", "ds-1:3"}));
    EXPECT_EQ((*leases)[0].attempts, 1);
    EXPECT_EQ(ledger->CompleteLease(lease2, "ds-1:2").code(), StatusCode::kFailedPrecondition);
  }
}

TEST_F(PromptLedgerTest, LeaseStaysValidAcrossReopenUntilItsDeadline) {
  Lease lease;
  {
    auto ledger = OpenLedger();
    ASSERT_TRUE(ledger->AddDataset("key", Rows(1)).ok());
    auto leases = ledger->LeasePrompts("w", 1, milliseconds(1000));
    ASSERT_TRUE(leases.ok() && leases->size() == 1);
    lease = (*leases)[0];
  }
  clock_.ms = 2000;
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->CompleteLease(lease.lease_id, lease.prompt_id).ok());
  ExpectCounts(*ledger, 0, 0, 1, 0);
}

TEST_F(PromptLedgerTest, CommittedCallsSurviveProcessExitWithoutClose) {
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Child: commit some calls, then die without closing the database or running destructors.
    auto ledger = PromptLedger::Open(path_, {});
    if (!ledger.ok()) ::_exit(2);
    if (!(*ledger)->AddDataset("key", Rows(3)).ok()) ::_exit(3);
    auto leases = (*ledger)->LeasePrompts("w", 2, milliseconds(3'600'000));
    if (!leases.ok() || leases->size() != 2) ::_exit(4);
    if (!(*ledger)->CompleteLease((*leases)[0].lease_id, "ds-1:0").ok()) ::_exit(5);
    ::_exit(0);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFEXITED(wstatus));
  ASSERT_EQ(WEXITSTATUS(wstatus), 0);
  // The commits are in the write-ahead log, not yet checkpointed into the main file.
  EXPECT_TRUE(fs::exists(path_ + "-wal"));

  PromptLedgerOptions options;  // system clock: the child's leases (1 h) are still valid
  auto ledger = PromptLedger::Open(path_, options);
  ASSERT_TRUE(ledger.ok()) << ledger.status().ToString();
  ExpectCounts(**ledger, 1, 1, 1, 0);
  EXPECT_EQ((*ledger)->GetPrompt("ds-1:0")->state, PromptState::kTrained);
  EXPECT_EQ((*ledger)->GetPrompt("ds-1:1")->state, PromptState::kLeased);
}

TEST_F(PromptLedgerTest, FileUsesWriteAheadLog) {
  auto ledger = OpenLedger();
  ASSERT_NE(ledger, nullptr);
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open_v2(path_.c_str(), &db, SQLITE_OPEN_READONLY, nullptr), SQLITE_OK);
  sqlite3_stmt* stmt = nullptr;
  ASSERT_EQ(sqlite3_prepare_v2(db, "PRAGMA journal_mode", -1, &stmt, nullptr), SQLITE_OK);
  ASSERT_EQ(sqlite3_step(stmt), SQLITE_ROW);
  EXPECT_STREQ(reinterpret_cast<const char*>(sqlite3_column_text(stmt, 0)), "wal");
  sqlite3_finalize(stmt);
  sqlite3_close(db);
}

TEST_F(PromptLedgerTest, NonSqliteFileIsRefusedNamingThePathAndLeftIntact) {
  const std::string text = "this is a text file, not a database\n" + std::string(600, 'x');
  std::ofstream(path_) << text;
  auto ledger = PromptLedger::Open(path_);
  ASSERT_FALSE(ledger.ok());
  EXPECT_EQ(ledger.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(ledger.status().message().find(path_), std::string::npos) << ledger.status().message();
  std::stringstream after;
  after << std::ifstream(path_).rdbuf();
  EXPECT_EQ(after.str(), text);
}

TEST_F(PromptLedgerTest, ForeignSqliteDatabaseIsRefused) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path_.c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, "CREATE TABLE users (name TEXT)", nullptr, nullptr, nullptr),
            SQLITE_OK);
  sqlite3_close(db);
  auto ledger = PromptLedger::Open(path_);
  ASSERT_FALSE(ledger.ok());
  EXPECT_EQ(ledger.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(ledger.status().message().find(path_), std::string::npos);
}

TEST_F(PromptLedgerTest, UnopenablePathIsRefusedNamingThePath) {
  const std::string missing_dir = (dir_ / "no" / "such" / "dir" / "ledger.db").string();
  auto in_missing_dir = PromptLedger::Open(missing_dir);
  ASSERT_FALSE(in_missing_dir.ok());
  EXPECT_EQ(in_missing_dir.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(in_missing_dir.status().message().find(missing_dir), std::string::npos)
      << in_missing_dir.status().message();

  const std::string directory = dir_.string();
  auto is_dir = PromptLedger::Open(directory);
  ASSERT_FALSE(is_dir.ok());
  EXPECT_NE(is_dir.status().message().find(directory), std::string::npos)
      << is_dir.status().message();
}

// Leases every queued prompt (at most n) and accepts each one's group.
std::vector<Lease> LeaseAndAccept(PromptLedger& ledger, int n) {
  auto leases = ledger.LeasePrompts("w", n, milliseconds(100000));
  EXPECT_TRUE(leases.ok()) << leases.status().ToString();
  if (!leases.ok()) return {};
  for (const Lease& l : *leases) EXPECT_TRUE(ledger.CompleteLease(l.lease_id, l.prompt_id).ok());
  return *leases;
}

// (prompt, pass) -> step, from the ledger's record.
std::map<std::pair<std::string, int64_t>, int64_t> TrainingMap(PromptLedger& ledger) {
  std::map<std::pair<std::string, int64_t>, int64_t> out;
  auto t = ledger.Trainings();
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  if (t.ok()) {
    for (const auto& r : *t) out[{r.prompt_id, r.pass}] = r.step;
  }
  return out;
}

TEST_F(PromptLedgerTest, RequeueTrainedQueuesAnAcceptedPromptForItsPassAgain) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("", Rows(2)).ok());
  auto leases = ledger->LeasePrompts("w", 2, milliseconds(1000));
  ASSERT_TRUE(leases.ok());
  ASSERT_TRUE(ledger->CompleteLease((*leases)[0].lease_id, (*leases)[0].prompt_id).ok());
  EXPECT_EQ(ledger->Counts()->accepted, 1);
  EXPECT_TRUE(*ledger->RequeueTrained((*leases)[0].prompt_id, 0));
  auto record = ledger->GetPrompt((*leases)[0].prompt_id);
  EXPECT_EQ(record->state, PromptState::kQueued);
  EXPECT_EQ(record->pass, 0);
  EXPECT_EQ(record->attempts, 0);
  // A leased prompt keeps its lease.
  EXPECT_TRUE(*ledger->RequeueTrained((*leases)[1].prompt_id, 0));
  EXPECT_EQ(StateOf(*ledger, (*leases)[1].prompt_id), PromptState::kLeased);
  EXPECT_EQ(ledger->RequeueTrained("ds-9:0", 0).status().code(), StatusCode::kNotFound);
}

// Issue 12 (1): the next pass starts while the last groups of the pass are still buffered; one
// of them is then refused as stale. Before, requeueing it "under the old pass" matched no row
// and the prompt silently got no training in that pass.
TEST_F(PromptLedgerTest, AGroupRefusedAfterItsPassEndedIsTrainedForThatPassExactlyOnce) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("", Rows(3)).ok());
  auto first = LeaseAndAccept(*ledger, 3);
  ASSERT_EQ(first.size(), 3u);
  ASSERT_TRUE(ledger->MarkTrained({{"ds-1:0", 0}, {"ds-1:1", 0}}, 1).ok());
  // ds-1:2 is still buffered (accepted) when the pass ends.
  auto next = ledger->StartNextPass(10);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  ASSERT_TRUE(*next);
  EXPECT_EQ(ledger->GetPrompt("ds-1:2")->pass, 1);
  // The trainer refuses its pass-0 group: the prompt owes pass 0 and is queued for it first.
  ASSERT_TRUE(*ledger->RequeueTrained("ds-1:2", 0));
  auto again = ledger->LeasePrompts("w", 1, milliseconds(100000));
  ASSERT_TRUE(again.ok());
  ASSERT_EQ(again->size(), 1u);
  EXPECT_EQ((*again)[0].prompt_id, "ds-1:2");
  EXPECT_EQ((*again)[0].pass, 0);
  ASSERT_TRUE(ledger->CompleteLease((*again)[0].lease_id, "ds-1:2").ok());
  // Pass 1 may not end while ds-1:2 owes pass 0 (it is accepted, not trained).
  auto rest = LeaseAndAccept(*ledger, 10);
  ASSERT_EQ(rest.size(), 2u);
  ASSERT_TRUE(ledger->MarkTrained({{"ds-1:0", 1}, {"ds-1:1", 1}}, 2).ok());
  EXPECT_EQ(ledger->StartNextPass(10).status().code(), StatusCode::kFailedPrecondition);
  // Its pass-0 group trains: it is queued for pass 1 at once.
  ASSERT_TRUE(ledger->MarkTrained({{"ds-1:2", 0}}, 3).ok());
  auto record = ledger->GetPrompt("ds-1:2");
  EXPECT_EQ(record->state, PromptState::kQueued);
  EXPECT_EQ(record->pass, 1);
  auto last = LeaseAndAccept(*ledger, 10);
  ASSERT_EQ(last.size(), 1u);
  ASSERT_TRUE(ledger->MarkTrained({{"ds-1:2", 1}}, 4).ok());
  const auto t = TrainingMap(*ledger);
  EXPECT_EQ(t.size(), 6u);
  for (const char* id : {"ds-1:0", "ds-1:1", "ds-1:2"}) {
    EXPECT_EQ(t.count({id, 0}), 1u) << id;
    EXPECT_EQ(t.count({id, 1}), 1u) << id;
  }
  // A second training of a pass is an error, not silence.
  auto dup = ledger->MarkTrained({{"ds-1:0", 0}}, 5);
  EXPECT_EQ(dup.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(dup.status().message().find("ds-1:0"), std::string::npos);
}

// Issue 12 (2): a learner crash after a pass boundary. The checkpoint at step 1 holds ds-1:0's
// pass-0 training only; ds-1:1 was trained at step 2, then the pass ended. Rolling back to step
// 1 must undo the boundary for ds-1:1 (it owes pass 0 again) and keep ds-1:0 in pass 1.
TEST_F(PromptLedgerTest, RollbackToACheckpointUndoesTrainingsAndThePassBoundaryAfterIt) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("", Rows(3)).ok());
  LeaseAndAccept(*ledger, 3);
  ASSERT_TRUE(ledger->MarkTrained({{"ds-1:0", 0}}, 1).ok());
  ASSERT_TRUE(ledger->MarkTrained({{"ds-1:1", 0}}, 2).ok());
  ASSERT_TRUE(ledger->MarkTrained({{"ds-1:2", 0}}, 2).ok());
  ASSERT_TRUE(*ledger->StartNextPass(10));
  // One pass-1 lease is out when the learner dies.
  auto out = ledger->LeasePrompts("w", 1, milliseconds(100000));
  ASSERT_TRUE(out.ok() && out->size() == 1);
  EXPECT_EQ((*out)[0].prompt_id, "ds-1:0");

  auto undone = ledger->RollbackTo(1);
  ASSERT_TRUE(undone.ok()) << undone.status().ToString();
  EXPECT_EQ(undone->trainings_undone, 2);
  const auto t = TrainingMap(*ledger);
  EXPECT_EQ(t.size(), 1u);
  EXPECT_EQ(t.count({"ds-1:0", 0}), 1u);
  for (const char* id : {"ds-1:1", "ds-1:2"}) {
    auto r = ledger->GetPrompt(id);
    EXPECT_EQ(r->state, PromptState::kQueued) << id;
    EXPECT_EQ(r->pass, 0) << id;
  }
  // The lease of ds-1:0 (pass 1) stays valid.
  EXPECT_EQ(StateOf(*ledger, "ds-1:0"), PromptState::kLeased);
  EXPECT_EQ(ledger->GetPrompt("ds-1:0")->pass, 1);
  // Pass 0 is leased first.
  auto redo = ledger->LeasePrompts("w", 5, milliseconds(100000));
  ASSERT_TRUE(redo.ok());
  ASSERT_EQ(redo->size(), 2u);
  EXPECT_EQ((*redo)[0].pass, 0);
  EXPECT_EQ((*redo)[1].pass, 0);
}

TEST_F(PromptLedgerTest, RollbackRequeuesAcceptedGroupsAndKeepsTrainingsUpToTheStep) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("", Rows(3)).ok());
  LeaseAndAccept(*ledger, 3);
  ASSERT_TRUE(ledger->MarkTrained({{"ds-1:0", 0}}, 4).ok());
  // ds-1:1 and ds-1:2 are accepted only (buffered when the job ends).
  auto undone = ledger->RollbackTo(std::numeric_limits<int64_t>::max());
  ASSERT_TRUE(undone.ok());
  EXPECT_EQ(undone->trainings_undone, 0);
  EXPECT_EQ(undone->requeued, 2);
  EXPECT_EQ(StateOf(*ledger, "ds-1:0"), PromptState::kTrained);
  EXPECT_EQ(StateOf(*ledger, "ds-1:1"), PromptState::kQueued);
  EXPECT_EQ(StateOf(*ledger, "ds-1:2"), PromptState::kQueued);
  EXPECT_EQ(ledger->Counts()->accepted, 0);
  // Rolling back to the initial model undoes everything.
  auto all = ledger->RollbackTo(0);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->trainings_undone, 1);
  EXPECT_EQ(StateOf(*ledger, "ds-1:0"), PromptState::kQueued);
}

TEST_F(PromptLedgerTest, ExpireWorkerLeasesKeepsTheLeasesNamed) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("", Rows(3)).ok());
  auto leases = ledger->LeasePrompts("w", 3, milliseconds(100000));
  ASSERT_TRUE(leases.ok() && leases->size() == 3);
  auto moved = ledger->ExpireWorkerLeases("w", {(*leases)[1].lease_id});
  ASSERT_TRUE(moved.ok());
  EXPECT_EQ(*moved, 2);
  EXPECT_EQ(StateOf(*ledger, (*leases)[0].prompt_id), PromptState::kQueued);
  EXPECT_EQ(StateOf(*ledger, (*leases)[1].prompt_id), PromptState::kLeased);
  EXPECT_EQ(StateOf(*ledger, (*leases)[2].prompt_id), PromptState::kQueued);
}

TEST_F(PromptLedgerTest, AVersionOneFileMigratesWithItsTrainedPromptsCountedAsTrained) {
  {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(path_.c_str(), &db), SQLITE_OK);
    const char* v1 = R"sql(
CREATE TABLE schema_version (version INTEGER NOT NULL);
INSERT INTO schema_version VALUES (1);
CREATE TABLE job (id INTEGER PRIMARY KEY CHECK (id = 1), pass INTEGER NOT NULL,
                  created_ms INTEGER NOT NULL);
INSERT INTO job VALUES (1, 1, 0);
CREATE TABLE datasets (seq INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE,
  idempotency_key TEXT UNIQUE, content_sha256 TEXT NOT NULL, prompt_count INTEGER NOT NULL,
  created_ms INTEGER NOT NULL);
INSERT INTO datasets VALUES (1, 'ds-1', NULL, 'x', 2, 0);
CREATE TABLE prompts (seq INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE,
  dataset_id TEXT NOT NULL REFERENCES datasets (id), row_json TEXT NOT NULL,
  state TEXT NOT NULL CHECK (state IN ('QUEUED', 'LEASED', 'TRAINED', 'REJECTED')),
  lease_id TEXT, lease_deadline_ms INTEGER, worker_id TEXT, attempts INTEGER NOT NULL DEFAULT 0,
  reject_reason TEXT, pass INTEGER NOT NULL, created_ms INTEGER NOT NULL,
  updated_ms INTEGER NOT NULL);
CREATE INDEX prompts_by_state ON prompts (state, seq);
CREATE INDEX prompts_by_dataset ON prompts (dataset_id, state);
INSERT INTO prompts (id, dataset_id, row_json, state, pass, created_ms, updated_ms)
  VALUES ('ds-1:0', 'ds-1', '{"prompt":"a"}', 'TRAINED', 1, 0, 0),
         ('ds-1:1', 'ds-1', '{"prompt":"b"}', 'QUEUED', 1, 0, 0);
)sql";
    ASSERT_EQ(sqlite3_exec(db, v1, nullptr, nullptr, nullptr), SQLITE_OK) << sqlite3_errmsg(db);
    sqlite3_close(db);
  }
  auto ledger = OpenLedger();
  ASSERT_NE(ledger, nullptr);
  const auto t = TrainingMap(*ledger);
  // ds-1:0: passes 0 and 1; ds-1:1: pass 0 (it is queued for pass 1).
  EXPECT_EQ(t.size(), 3u);
  EXPECT_EQ(t.count({"ds-1:0", 0}), 1u);
  EXPECT_EQ(t.count({"ds-1:0", 1}), 1u);
  EXPECT_EQ(t.count({"ds-1:1", 0}), 1u);
  EXPECT_EQ(ledger->Counts()->accepted, 0);
  // Nothing is owed: a rollback to step 0 of a v1 file keeps what v1 called trained.
  auto undone = ledger->RollbackTo(0);
  ASSERT_TRUE(undone.ok());
  EXPECT_EQ(undone->trainings_undone, 0);
  EXPECT_EQ(StateOf(*ledger, "ds-1:0"), PromptState::kTrained);
  // The migrated table takes the v3 state (its CHECK constraint was rebuilt).
  auto lease = ledger->LeasePrompts("w", 1, milliseconds(100000));
  ASSERT_TRUE(lease.ok() && lease->size() == 1) << lease.status().ToString();
  ASSERT_TRUE(ledger->FilterPrompt((*lease)[0].lease_id, "ds-1:1", 0).ok());
  EXPECT_EQ(StateOf(*ledger, "ds-1:1"), PromptState::kFiltered);
  EXPECT_EQ(ledger->Counts()->filtered, 1);
}

// Dynamic sampling (learner/dynamic_sampling.h): a filtered group's prompt is done with its pass
// without a training; it is not leased again in that pass, and the next pass queues it again.
TEST_F(PromptLedgerTest, AFilteredPromptIsDoneWithItsPassUntrainedAndQueuedAtTheNext) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("", Rows(3)).ok());
  auto leases = ledger->LeasePrompts("w", 3, milliseconds(100000));
  ASSERT_TRUE(leases.ok() && leases->size() == 3);
  const Lease& a = (*leases)[0];
  const Lease& b = (*leases)[1];
  const Lease& c = (*leases)[2];
  // The lease check of CompleteLease: another prompt's lease, an unknown one.
  EXPECT_EQ(ledger->FilterPrompt(a.lease_id, b.prompt_id, 0).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(ledger->FilterPrompt("", b.prompt_id, 0).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(ledger->CompleteLease(a.lease_id, a.prompt_id).ok());
  ASSERT_TRUE(ledger->FilterPrompt(b.lease_id, b.prompt_id, 0).ok());
  EXPECT_EQ(StateOf(*ledger, b.prompt_id), PromptState::kFiltered);
  // Done with the lease: a second call under it is refused.
  EXPECT_EQ(ledger->FilterPrompt(b.lease_id, b.prompt_id, 0).code(),
            StatusCode::kFailedPrecondition);
  auto counts = ledger->Counts();
  EXPECT_EQ(counts->trained, 1);
  EXPECT_EQ(counts->filtered, 1);
  EXPECT_EQ(counts->leased, 1);
  EXPECT_EQ(counts->total(), 3);
  // Nothing is queued: the filtered prompt is not leased again in pass 0.
  auto none = ledger->LeasePrompts("w2", 3, milliseconds(100000));
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  EXPECT_EQ(ledger->StartNextPass(10).status().code(), StatusCode::kFailedPrecondition);  // c
  ASSERT_TRUE(ledger->CompleteLease(c.lease_id, c.prompt_id).ok());
  // Pass 0 ends once the accepted groups are trained; the record tells training from filtering.
  ASSERT_TRUE(ledger->MarkTrained({{a.prompt_id, 0}, {c.prompt_id, 0}}, 1).ok());
  auto t = ledger->Trainings();
  ASSERT_TRUE(t.ok());
  ASSERT_EQ(t->size(), 3u);
  for (const TrainingRecord& r : *t) {
    EXPECT_EQ(r.pass, 0);
    EXPECT_EQ(r.filtered, r.prompt_id == b.prompt_id) << r.prompt_id;
    EXPECT_EQ(r.step, r.prompt_id == b.prompt_id ? 0 : 1) << r.prompt_id;
  }
  auto next = ledger->StartNextPass(10);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  ASSERT_TRUE(*next);
  auto record = ledger->GetPrompt(b.prompt_id);
  EXPECT_EQ(record->state, PromptState::kQueued);
  EXPECT_EQ(record->pass, 1);
  EXPECT_EQ(ledger->Counts()->queued, 3);
  EXPECT_EQ(ledger->Counts()->filtered, 0);
}

TEST_F(PromptLedgerTest, APassOfOnlyFilteredPromptsEnds) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("", Rows(2)).ok());
  auto leases = ledger->LeasePrompts("w", 2, milliseconds(100000));
  ASSERT_TRUE(leases.ok() && leases->size() == 2);
  for (const Lease& l : *leases) ASSERT_TRUE(ledger->FilterPrompt(l.lease_id, l.prompt_id, 0).ok());
  auto next = ledger->StartNextPass(10);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_TRUE(*next);
  EXPECT_EQ(ledger->Counts()->queued, 2);
  EXPECT_EQ(ledger->Counts()->pass, 1);
}

// A restore to checkpoint S undoes the filterings recorded after S, as it undoes trainings:
// those prompts owe their pass again; one filtered at S stays filtered.
TEST_F(PromptLedgerTest, RollbackUndoesFilteringsAfterTheRestoredStepOnly) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("", Rows(2)).ok());
  auto leases = ledger->LeasePrompts("w", 2, milliseconds(100000));
  ASSERT_TRUE(leases.ok() && leases->size() == 2);
  ASSERT_TRUE(ledger->FilterPrompt((*leases)[0].lease_id, "ds-1:0", 2).ok());
  ASSERT_TRUE(ledger->FilterPrompt((*leases)[1].lease_id, "ds-1:1", 3).ok());
  auto undone = ledger->RollbackTo(2);
  ASSERT_TRUE(undone.ok()) << undone.status().ToString();
  EXPECT_EQ(undone->trainings_undone, 1);
  EXPECT_EQ(undone->requeued, 1);
  EXPECT_EQ(StateOf(*ledger, "ds-1:0"), PromptState::kFiltered);
  auto r = ledger->GetPrompt("ds-1:1");
  EXPECT_EQ(r->state, PromptState::kQueued);
  EXPECT_EQ(r->pass, 0);
  const auto t = TrainingMap(*ledger);
  EXPECT_EQ(t.size(), 1u);
  EXPECT_EQ(t.count({"ds-1:0", 0}), 1u);
  // A pass boundary after the restored step is undone for a prompt filtered after it.
  auto again = ledger->LeasePrompts("w", 1, milliseconds(100000));
  ASSERT_TRUE(again.ok() && again->size() == 1);
  ASSERT_TRUE(ledger->FilterPrompt((*again)[0].lease_id, "ds-1:1", 5).ok());
  ASSERT_TRUE(*ledger->StartNextPass(10));
  ASSERT_TRUE(ledger->RollbackTo(4).ok());
  r = ledger->GetPrompt("ds-1:1");
  EXPECT_EQ(r->state, PromptState::kQueued);
  EXPECT_EQ(r->pass, 0) << "it owes pass 0 again";
  EXPECT_EQ(ledger->GetPrompt("ds-1:0")->pass, 1);
}

// Found by the chaos test with dynamic sampling: a prompt's pass-0 group waits in the buffer
// across the pass boundary, its pass-1 group is filtered first. Pass 0 is not owed (its group
// trains next): the prompt must stay FILTERED, not be queued for pass 0 and trained twice there.
TEST_F(PromptLedgerTest, AFilteringDoesNotTakeAPassWhoseGroupWaitsInTheBuffer) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("", Rows(2)).ok());
  LeaseAndAccept(*ledger, 2);
  ASSERT_TRUE(ledger->MarkTrained({{"ds-1:1", 0}}, 1).ok());
  ASSERT_TRUE(*ledger->StartNextPass(10));  // ds-1:0's pass-0 group is still buffered
  auto lease = ledger->LeasePrompts("w", 2, milliseconds(100000));
  ASSERT_TRUE(lease.ok() && lease->size() == 2);
  const Lease& zero = (*lease)[0].prompt_id == "ds-1:0" ? (*lease)[0] : (*lease)[1];
  EXPECT_EQ(zero.pass, 1);
  ASSERT_TRUE(ledger->FilterPrompt(zero.lease_id, "ds-1:0", 1).ok());
  EXPECT_EQ(StateOf(*ledger, "ds-1:0"), PromptState::kFiltered);
  EXPECT_EQ(ledger->GetPrompt("ds-1:0")->pass, 1);
  // The buffered group trains: recorded once, no duplicate.
  auto marked = ledger->MarkTrained({{"ds-1:0", 0}}, 2);
  ASSERT_TRUE(marked.ok()) << marked.status().ToString();
  EXPECT_EQ(*marked, 1);
  auto t = ledger->Trainings();
  ASSERT_TRUE(t.ok());
  int zero_passes = 0;
  for (const TrainingRecord& r : *t) {
    if (r.prompt_id != "ds-1:0") continue;
    ++zero_passes;
    EXPECT_EQ(r.filtered, r.pass == 1) << "pass " << r.pass;
  }
  EXPECT_EQ(zero_passes, 2);
  // Had its group been refused instead, the pass would be owed: queued at once.
  ASSERT_TRUE(ledger->RollbackTo(std::numeric_limits<int64_t>::max()).ok());
}

// A buffered group of an earlier pass that is refused after its prompt was filtered in a later
// one: the prompt owes the earlier pass and is queued for it at once.
TEST_F(PromptLedgerTest, ARefusedGroupOfAPromptFilteredSinceIsQueuedForItsPass) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("", Rows(2)).ok());
  LeaseAndAccept(*ledger, 2);
  ASSERT_TRUE(ledger->MarkTrained({{"ds-1:1", 0}}, 1).ok());
  ASSERT_TRUE(*ledger->StartNextPass(10));
  auto lease = ledger->LeasePrompts("w", 2, milliseconds(100000));
  ASSERT_TRUE(lease.ok() && lease->size() == 2);
  const Lease& zero = (*lease)[0].prompt_id == "ds-1:0" ? (*lease)[0] : (*lease)[1];
  ASSERT_TRUE(ledger->FilterPrompt(zero.lease_id, "ds-1:0", 1).ok());
  ASSERT_TRUE(*ledger->RequeueTrained("ds-1:0", 0));  // the buffered pass-0 group went stale
  auto r = ledger->GetPrompt("ds-1:0");
  EXPECT_EQ(r->state, PromptState::kQueued);
  EXPECT_EQ(r->pass, 0);
}

// A prompt leased for a pass while it still owes an earlier one (its group of that pass was
// refused as stale after the boundary) and filtered: the pass it owes is queued next.
TEST_F(PromptLedgerTest, AFilteredPromptThatOwesAnEarlierPassIsQueuedForIt) {
  auto ledger = OpenLedger();
  ASSERT_TRUE(ledger->AddDataset("", Rows(2)).ok());
  LeaseAndAccept(*ledger, 2);
  ASSERT_TRUE(ledger->MarkTrained({{"ds-1:0", 0}}, 1).ok());
  ASSERT_TRUE(*ledger->StartNextPass(10));  // ds-1:1's pass-0 group still buffered
  auto lease = ledger->LeasePrompts("w", 2, milliseconds(100000));
  ASSERT_TRUE(lease.ok() && lease->size() == 2);
  const Lease& one = (*lease)[0].prompt_id == "ds-1:1" ? (*lease)[0] : (*lease)[1];
  EXPECT_EQ(one.pass, 1);
  ASSERT_TRUE(*ledger->RequeueTrained("ds-1:1", 0));  // refused as stale: owes pass 0
  EXPECT_EQ(StateOf(*ledger, "ds-1:1"), PromptState::kLeased);
  ASSERT_TRUE(ledger->FilterPrompt(one.lease_id, "ds-1:1", 1).ok());
  auto r = ledger->GetPrompt("ds-1:1");
  EXPECT_EQ(r->state, PromptState::kQueued);
  EXPECT_EQ(r->pass, 0);
  const auto t = TrainingMap(*ledger);
  EXPECT_EQ(t.count({"ds-1:1", 1}), 1u);
  EXPECT_EQ(t.count({"ds-1:1", 0}), 0u);
}

}  // namespace
}  // namespace grpo::learner
