// The progress bar of `grpo submit --follow` / `grpo watch`: one line from the job's counters,
// with an ETA from the rate observed since the watch began. Pure functions of the numbers given,
// no I/O, so that the line is testable.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace grpo::services {

// One observation of a job (a JobEvent's Job).
struct JobProgress {
  int64_t step = 0;              // optimizer steps done
  int64_t max_steps = 0;         // the job ends after this many (>= 1)
  int64_t trained = 0;           // prompts done with the current pass: TRAINED or FILTERED
  int64_t total = 0;             // prompts in the ledger
  int64_t pass = 0;              // 0-based pass over the data
  std::optional<double> reward;  // mean reward of the last step, when one was trained
};

// Fraction of the job done, in [0, 1]: step / max_steps (the job ends at max_steps).
double ProgressFraction(const JobProgress& p);

// "M:SS", or "H:MM:SS" from an hour; "--:--" for a negative or non-finite duration.
std::string FormatDuration(double seconds);

// Seconds left, extrapolating the progress made between `first` (at first_s) and `now`
// (at now_s); nullopt while no progress was seen since `first`.
std::optional<double> EstimateSecondsLeft(const JobProgress& first, double first_s,
                                          const JobProgress& now, double now_s);

// "[######----]  60% | step 6/10 | prompts 24/40 (pass 1) | reward -3.21 | 0:12 | ETA 0:08"
// with a bar of `bar_width` cells (no newline).
std::string ProgressLine(const JobProgress& first, double first_s, const JobProgress& now,
                         double now_s, int bar_width = 24);

}  // namespace grpo::services
