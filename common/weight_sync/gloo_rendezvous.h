// JoinGlooGroup: a c10d ProcessGroupGloo joined within one deadline, for the weight-sync groups
// (gloo_weight_sync.cc) and the learner's rank group (learner/distributed/rank_group.cc).
//
// Gloo's own join takes many deadlines when a rank stops during it: every store wait gets the
// whole timeout, and each pair whose peer does not answer is waited for 5 times the timeout
// (gloo's tcp Pair::waitUntil). gloo_stall_test measured 10.0 s for a 2 s deadline, and the chaos
// test 26.9 s for 5 s. Here the whole join has one deadline, `timeout` after the call:
//   1. a barrier on the store: every rank sets "arrived/<rank>" and waits for the others;
//   2. gloo's rendezvous on the store, every wait of which ends at the deadline;
//   3. gloo's pair connections: gloo's timeout is a fifth of what is left, since gloo waits 5
//      times its timeout for a pair.
// So a rank stopped anywhere in its join costs the others one deadline; only a second rank
// stopped in phase 3 adds another (gloo connects its pairs one after the other). The group's
// timeout is `timeout` afterwards.
//
// Before the process's first group, c10d's flight recorder is turned off (see
// DisableFlightRecorder below) unless the user set its size.
#pragma once

#ifdef GRPO_HAVE_GLOO

#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace grpo::common {

// c10d's flight recorder (torch 2.11; on unless TORCH_FR_BUFFER_SIZE or
// TORCH_NCCL_TRACE_BUFFER_SIZE is 0) is one per process, and records every collective of every
// group; it looks up and inserts each group's status in a std::map before it takes its mutex
// (FlightRecorderDetail.hpp, recordWithResetEnabled). Two groups of one process that issue
// collectives at once (the learner's weight-sync groups and its rank group; a test's ranks as
// threads) corrupt that map: gloo_weight_sync_test died of SIGSEGV in _Rb_tree_insert_and_rebalance
// under ProcessGroupGloo::enqueue, in CI once and here 3 times in 104 runs under load. So the first
// JoinGlooGroup of a process sets TORCH_FR_BUFFER_SIZE=0 before any group exists (the recorder
// reads it once, when first used); a size the user set is kept, with a warning. Idempotent.
void DisableFlightRecorder();

// Throws what c10d throws (c10::Error, std::runtime_error) when the group does not form; a
// message that passed a deadline says "timed out". `hostname` is the address this rank listens
// on ("127.0.0.1" for loopback); empty: c10d's default device (the machine's hostname, else
// loopback). The store's keys are used under its own prefix; the barrier's are "arrived/<rank>".
c10::intrusive_ptr<c10d::ProcessGroupGloo> JoinGlooGroup(c10::intrusive_ptr<c10d::Store> store,
                                                         int rank, int world_size,
                                                         std::chrono::milliseconds timeout,
                                                         const std::string& hostname);

}  // namespace grpo::common

#endif  // GRPO_HAVE_GLOO
