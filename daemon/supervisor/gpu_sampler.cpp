#include "gpu_sampler.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string_view>
#include <utility>

#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"

namespace gpuq::daemon {

Result<void> GpuSampler::start(uint64_t now) {
  started_ns_ = now;
  int fds[2];
  if (auto r = GPUQ_POSIX_CALL(::pipe2, fds, O_CLOEXEC); !r) return r.error();
  UniqueFd read_end(fds[0]), write_end(fds[1]);
  const std::string interval = std::to_string(interval_ms_);
  const char* argv[] = {self_exe_.c_str(), "--sample-gpus", interval.c_str(), nvml_library_.c_str(),
                        nullptr};
  sigset_t empty;
  sigemptyset(&empty);
  const int out = write_end.get();
  const pid_t pid = ::fork();
  if (pid < 0) return GPUQ_SYSTEM_ERROR("fork");
  if (pid == 0) {
    // Child (the supervisor may have threads): raw async-signal-safe calls only, then exec.
    if (out == 1) {
      (void)fcntl(1, F_SETFD, 0);  // already in place: keep it across exec
    } else {
      (void)dup2(out, 1);  // the copy at 1 survives exec
    }
    (void)prctl(PR_SET_PDEATHSIG, SIGKILL);
    (void)sigprocmask(SIG_SETMASK, &empty, nullptr);
    execv(argv[0], const_cast<char* const*>(argv));
    static const char kMsg[] = "gpuqd: GPU sampler: execv failed\n";
    (void)!write(2, kMsg, sizeof kMsg - 1);
    _exit(127);
  }
  pid_ = pid;
  write_end.reset();
  if (auto r = GPUQ_POSIX_CALL(::fcntl, read_end.get(), F_SETFL, O_NONBLOCK); !r) return r.error();
  if (auto r = loop_.add(read_end.get(), tag_, EPOLLIN); !r) return r;
  pipe_ = std::move(read_end);
  buffer_.clear();
  return {};
}

void GpuSampler::on_readable(uint64_t now) {
  char chunk[4096];
  for (;;) {
    const ssize_t n = ::read(pipe_.get(), chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) break;
    if (n <= 0) {  // the child closed its end (it is exiting), or the pipe failed
      close_pipe();
      return;
    }
    buffer_.append(chunk, static_cast<size_t>(n));
  }
  // The last complete line wins; a line longer than any sampler writes is garbage.
  const size_t end = buffer_.rfind('\n');
  if (end == std::string::npos) {
    if (buffer_.size() > (1u << 20)) buffer_.clear();
    return;
  }
  const size_t previous = end == 0 ? std::string::npos : buffer_.rfind('\n', end - 1);
  const size_t begin = previous == std::string::npos ? 0 : previous + 1;
  auto parsed = parse_gpu_samples_line(std::string_view(buffer_).substr(begin, end - begin));
  if (parsed) {
    for (GpuSample& s : *parsed) {
      for (const GpuInfo& g : gpus_) {
        if (g.uuid == s.uuid) s.index = g.index;
      }
    }
    samples_ = std::move(*parsed);
    sampled_ns_ = now;
  } else if (!std::exchange(complained_, true)) {
    GPUQ_LOG_WARN("GPU sampler: %s", parsed.error().message().c_str());
  }
  buffer_.erase(0, end + 1);
}

bool GpuSampler::on_exit(pid_t pid, int /*status*/) {
  if (pid_ == 0 || pid != pid_) return false;
  pid_ = 0;
  close_pipe();
  GPUQ_LOG_WARN("GPU sampler (pid %d) ended; GPU metrics are missing until it is started again",
                pid);
  return true;
}

std::vector<GpuSample> GpuSampler::latest(uint64_t now) {
  // A sampler that has said nothing for a while is stuck (in NVML, on a wedged driver): kill
  // it; its exit is reaped as any other, and a new one starts after the back-off.
  const uint64_t quiet_since = std::max(sampled_ns_, started_ns_);
  if (pid_ != 0 && now - quiet_since > kRestartNs) {
    GPUQ_LOG_WARN("GPU sampler (pid %d) silent for %llu s: stopping it", pid_,
                  static_cast<unsigned long long>((now - quiet_since) / 1'000'000'000));
    (void)::kill(pid_, SIGKILL);  // ESRCH: it has exited already, and is reaped as usual
  }
  if (pid_ == 0 && now - started_ns_ >= kRestartNs) {
    if (auto r = start(now); !r) {
      GPUQ_LOG_WARN("GPU sampler: cannot start: %s", r.error().to_string().c_str());
    }
  }
  if (sampled_ns_ == 0 || now - sampled_ns_ > 3ull * interval_ms_ * 1'000'000) return {};
  return samples_;
}

void GpuSampler::stop() {
  close_pipe();
  if (pid_ != 0) {
    // ESRCH: it has exited and waits to be reaped; the supervisor's exit reaps it.
    (void)::kill(pid_, SIGKILL);
    pid_ = 0;
  }
}

void GpuSampler::close_pipe() {
  if (!pipe_.valid()) return;
  loop_.remove(pipe_.get());
  pipe_.reset();
}

}  // namespace gpuq::daemon
