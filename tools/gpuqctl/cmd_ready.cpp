// gpuqctl ready [--wait S]: the readiness probe. Exit 0 if the daemon accepts jobs and every
// available pool has a live, ready worker; else print why and exit 1. With --wait, it keeps
// asking (no daemon yet, a daemon still starting, pools not ready yet) until the daemon is ready
// or S seconds have passed, then exits 1 with the last reason.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "commands.hpp"
#include "gpuq/client.hpp"

namespace gpuq::ctl {
namespace {

constexpr double kMaxWaitS = 86400;  // a day: anything longer is a mistake in a script
constexpr auto kRetryEvery = std::chrono::milliseconds(100);

// One look at the daemon.
struct Readiness {
  bool ready = false;
  // Why not: a daemon error (no daemon, refused, ...), or the pools not ready ("pool 'x' has no
  // ready worker (...)").
  std::optional<gpuq::Error> error;
  std::string why;
  // Asking again cannot help: the daemon refuses this user, or speaks another protocol.
  bool final = false;
};

Readiness look(const std::string& runtime_dir) {
  Readiness r;
  gpuq::Result<std::string> text = gpuq::daemon_status_json(runtime_dir);
  if (!text) {
    r.error = text.error();
    r.final = text.error().code() == gpuq::ErrorCode::kPermissionDenied ||
              text.error().code() == gpuq::ErrorCode::kProtocolMismatch;
    return r;
  }
  Json doc = Json::parse(text.value(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("ready") ||
      !doc["ready"].is_boolean()) {
    r.error = gpuq::Error(gpuq::ErrorCode::kProtocolMismatch,
                          "the daemon's status document has no readiness field");
    r.final = true;
    return r;
  }
  if (doc["ready"].get<bool>()) {
    r.ready = true;
    return r;
  }
  if (text_field(doc, "state", "") == "draining") r.why = "the daemon is draining";
  if (doc.contains("pools") && doc["pools"].is_array()) {
    for (const Json& pool : doc["pools"]) {
      if (!pool.is_object()) continue;
      auto ready_workers = pool.find("workers_ready");
      if (ready_workers != pool.end() && ready_workers->is_number_unsigned() &&
          ready_workers->get<uint64_t>() > 0) {
        continue;
      }
      if (!r.why.empty()) r.why += "; ";
      r.why += "pool '" + text_field(pool, "name", "?") + "' has no ready worker (" +
               text_field(pool, "reason", "no reason given") + ")";
    }
  }
  if (r.why.empty()) r.why = "see gpuqctl status";
  return r;
}

int run_ready(const std::string& runtime_dir, std::optional<double> wait_s) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(wait_s.value_or(0)));
  for (;;) {
    const Readiness r = look(runtime_dir);
    if (r.ready) {
      std::cout << "ready\n";
      return kExitOk;
    }
    const Clock::time_point now = Clock::now();
    if (!wait_s || r.final || now >= deadline) {
      // With --wait, how long it tried (a final answer came at once: nothing to say).
      const std::string within = wait_s && !r.final ? strf(" within %g s", *wait_s) : "";
      if (r.error) {
        std::cerr << "gpuqctl: " << (within.empty() ? "" : "not ready" + within + ": ")
                  << r.error->to_string() << '\n';
      } else {
        std::cout << "not ready" << within << ": " << r.why << '\n';
      }
      return kExitFailure;
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(kRetryEvery, deadline - now));
  }
}

}  // namespace

int cmd_ready(ArgCursor& cursor, std::string& runtime_dir) {
  std::optional<double> wait_s;
  std::string value, error;
  while (!cursor.done()) {
    const std::string_view arg = cursor.peek();
    if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      return kExitOk;
    }
    if (cursor.take_value("--wait", value, error)) {
      if (!error.empty()) return usage_error(error);
      wait_s = parse_seconds("--wait", value, 0, kMaxWaitS, error);
      if (!wait_s) return usage_error(error);
    } else if (cursor.take_value("--runtime-dir", runtime_dir, error)) {
      if (!error.empty()) return usage_error(error);
    } else {
      return usage_error("unknown argument '" + std::string(arg) + "' for ready");
    }
  }
  return run_ready(runtime_dir, wait_s);
}

}  // namespace gpuq::ctl
