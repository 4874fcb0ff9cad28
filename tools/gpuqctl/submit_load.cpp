// gpuqctl submit --count N: runs N jobs keeping --concurrency C in flight, shows progress on a
// terminal, and reports jobs/s and submit-to-complete latency.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <iostream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cli.hpp"
#include "gpuq/client.hpp"
#include "submit.hpp"

namespace gpuq::ctl {
namespace {

// Runs args.count jobs keeping args.concurrency in flight and reports throughput and latency.
class LoadRun {
 public:
  LoadRun(const SubmitArgs& args, Session& session)
      : args_(args),
        session_(session),
        total_(*args.count),
        slots_(session.inputs.size()),
        // A probe: 0 (ENOTTY, EBADF) is "not a terminal", and then no progress line is shown.
        progress_(isatty(STDOUT_FILENO) == 1) {
    for (size_t i = slots_.size(); i-- > 0;) free_.push_back(i);
  }

  int run() {
    const gpuq::JobSpec base = make_spec(args_);
    start_ = Clock::now();
    last_progress_ = start_;
    while (true) {
      fill(base);
      if (in_order_.empty()) break;
      wait_oldest();
      harvest_finished();
      show_progress(false);
    }
    const auto elapsed = Clock::now() - start_;
    show_progress(true);
    report(elapsed);
    if (failures_ > 0) {
      std::cerr << "gpuqctl: " << failures_ << " of " << total_
                << " jobs failed; first: " << first_failure_.to_string() << '\n';
      if (cancelled_ > 0) {
        std::cerr << "gpuqctl: cancelled the " << cancelled_
                  << " jobs still queued or running at --timeout-ms\n";
      }
      return kExitFailure;
    }
    return kExitOk;
  }

 private:
  struct Slot {
    gpuq::Job job;
    Clock::time_point submitted;
  };

  std::optional<Clock::time_point> deadline_of(const Slot& slot) const {
    if (!args_.timeout_ms) return std::nullopt;
    return slot.submitted + std::chrono::milliseconds(*args_.timeout_ms);
  }

  void fail(gpuq::Error error) {
    if (failures_++ == 0) first_failure_ = std::move(error);
  }

  // Submits until `concurrency` jobs are in flight or all are submitted. A submit error stops
  // further submissions: it would repeat for every job (unknown op, daemon gone...).
  void fill(const gpuq::JobSpec& base) {
    while (submitted_ < total_ && !stop_submitting_ && !free_.empty()) {
      const size_t i = free_.back();
      gpuq::JobSpec spec = base;
      spec.input = session_.inputs[i];
      spec.output = session_.outputs[i];
      Slot& slot = slots_[i];
      slot.submitted = Clock::now();
      gpuq::Result<gpuq::Job> job = session_.client.submit(spec, time_left(deadline_of(slot)));
      if (!job) {
        fail(std::move(job).error());
        stop_submitting_ = true;
        not_submitted_ = total_ - submitted_ - 1;
        return;
      }
      slot.job = std::move(job).value();
      free_.pop_back();
      in_order_.push_back(i);
      ++submitted_;
    }
  }

  // Waits for the oldest job in flight, in slices of at most 200 ms while a progress line shows.
  void wait_oldest() {
    const size_t i = in_order_.front();
    Slot& slot = slots_[i];
    std::chrono::nanoseconds timeout = time_left(deadline_of(slot));
    if (progress_ && (timeout.count() < 0 || timeout > kProgressPeriod)) timeout = kProgressPeriod;
    gpuq::Result<gpuq::JobResult> result = slot.job.wait(timeout);
    const Clock::time_point now = Clock::now();
    if (result) {
      finish(i, result.value(), now);
    } else if (result.error().code() != gpuq::ErrorCode::kTimeout) {
      fail(std::move(result).error());
      release(i);
    } else if (auto deadline = deadline_of(slot); deadline && now >= *deadline) {
      fail(gpuq::Error(gpuq::ErrorCode::kTimeout,
                       "a job did not finish within " + std::to_string(*args_.timeout_ms) + " ms"));
      // Cancelled rather than only dropped: a queued job would otherwise still run, and a
      // running one is stopped the same way.
      if (slot.job.cancel()) ++cancelled_;
      release(i);
    }
  }

  // Completes the other jobs that have finished meanwhile, so that a job which finished before
  // an older one is timed when it finished, not when the older one did.
  void harvest_finished() {
    for (size_t k = 0; k < in_order_.size();) {
      const size_t i = in_order_[k];
      gpuq::Result<gpuq::JobStatus> status = slots_[i].job.poll();
      if (status && (status.value() == gpuq::JobStatus::kQueued ||
                     status.value() == gpuq::JobStatus::kRunning)) {
        ++k;
        continue;
      }
      const Clock::time_point now = Clock::now();
      gpuq::Result<gpuq::JobResult> result = slots_[i].job.wait(std::chrono::nanoseconds(0));
      if (result) {
        finish(i, result.value(), now);
      } else if (result.error().code() == gpuq::ErrorCode::kTimeout) {
        ++k;  // finished an instant ago in poll's view but not yet readable; wait for it later
      } else {
        fail(std::move(result).error());
        release(i);
      }
    }
  }

  void finish(size_t i, const gpuq::JobResult& result, Clock::time_point now) {
    if (result.ok()) {
      latencies_ns_.push_back(static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(now - slots_[i].submitted).count()));
    } else {
      fail(gpuq::Error(result.code, result.message.empty() ? std::string(status_word(result.status))
                                                           : result.message));
    }
    release(i);
  }

  // Returns slot i to the free list; the Job's destructor returns its job slot.
  void release(size_t i) {
    slots_[i].job = gpuq::Job();
    in_order_.erase(std::find(in_order_.begin(), in_order_.end(), i));
    free_.push_back(i);
    ++completed_;
  }

  void show_progress(bool final_line) {
    if (!progress_) return;
    const Clock::time_point now = Clock::now();
    if (final_line) {
      std::printf("\r%*s\r", 72, "");
      // The progress line is best effort: a terminal that cannot take it loses nothing else.
      (void)std::fflush(stdout);
      return;
    }
    if (now - last_progress_ < kProgressPeriod) return;
    last_progress_ = now;
    const double seconds = std::chrono::duration<double>(now - start_).count();
    std::printf("\r%llu/%llu jobs done, %llu failed, %.0f jobs/s   ",
                static_cast<unsigned long long>(completed_),
                static_cast<unsigned long long>(total_), static_cast<unsigned long long>(failures_),
                seconds > 0 ? static_cast<double>(completed_) / seconds : 0.0);
    (void)std::fflush(stdout);  // best effort, as above
  }

  uint64_t percentile(double p) const {
    // Nearest rank: the smallest value with at least p of the samples at or below it.
    const size_t n = latencies_ns_.size();
    size_t rank = static_cast<size_t>(p * static_cast<double>(n) + 0.999999);
    rank = std::clamp<size_t>(rank, 1, n);
    return latencies_ns_[rank - 1];
  }

  void report(Clock::duration elapsed) {
    const double seconds = std::chrono::duration<double>(elapsed).count();
    std::cout << strf("%llu jobs in %.3f s: %.0f jobs/s, concurrency %zu\n",
                      static_cast<unsigned long long>(completed_), seconds,
                      seconds > 0 ? static_cast<double>(completed_) / seconds : 0.0, slots_.size());
    if (!latencies_ns_.empty()) {
      std::sort(latencies_ns_.begin(), latencies_ns_.end());
      std::cout << "latency (submit to complete, " << latencies_ns_.size() << " jobs): p50 "
                << format_ns(percentile(0.50)) << ", p90 " << format_ns(percentile(0.90))
                << ", p99 " << format_ns(percentile(0.99)) << ", max "
                << format_ns(latencies_ns_.back()) << '\n';
    }
    if (not_submitted_ > 0) {
      std::cout << not_submitted_ << " jobs not submitted after the first submit error\n";
    }
  }

  static constexpr std::chrono::milliseconds kProgressPeriod{200};

  const SubmitArgs& args_;
  Session& session_;
  const uint64_t total_;
  std::vector<Slot> slots_;
  std::vector<size_t> free_;     // slot indices with no job in flight
  std::deque<size_t> in_order_;  // slot indices in flight, oldest submission first
  const bool progress_;
  uint64_t submitted_ = 0;
  uint64_t completed_ = 0;
  uint64_t not_submitted_ = 0;
  bool stop_submitting_ = false;
  uint64_t failures_ = 0;
  uint64_t cancelled_ = 0;  // jobs cancelled at --timeout-ms
  gpuq::Error first_failure_;
  std::vector<uint64_t> latencies_ns_;
  Clock::time_point start_;
  Clock::time_point last_progress_;
};

}  // namespace

int run_load(const SubmitArgs& args, Session& session) {
  return LoadRun(args, session).run();
}

}  // namespace gpuq::ctl
