// gpuqctl ready: the readiness probe. Exit 0 if the daemon accepts jobs and every available pool
// has a live, ready worker; else print why and exit 1.
#include <cstdint>
#include <iostream>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "commands.hpp"
#include "gpuq/client.hpp"

namespace gpuq::ctl {
namespace {

int run_ready(const std::string& runtime_dir) {
  gpuq::Result<std::string> text = gpuq::daemon_status_json(runtime_dir);
  if (!text) return daemon_error(text.error());
  Json doc = Json::parse(text.value(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("ready") ||
      !doc["ready"].is_boolean()) {
    return daemon_error(gpuq::Error(gpuq::ErrorCode::kProtocolMismatch,
                                    "the daemon's status document has no readiness field"));
  }
  if (doc["ready"].get<bool>()) {
    std::cout << "ready\n";
    return kExitOk;
  }
  std::string why;
  if (text_field(doc, "state", "") == "draining") why = "the daemon is draining";
  if (doc.contains("pools") && doc["pools"].is_array()) {
    for (const Json& pool : doc["pools"]) {
      if (!pool.is_object()) continue;
      auto ready_workers = pool.find("workers_ready");
      if (ready_workers != pool.end() && ready_workers->is_number_unsigned() &&
          ready_workers->get<uint64_t>() > 0) {
        continue;
      }
      if (!why.empty()) why += "; ";
      why += "pool '" + text_field(pool, "name", "?") + "' has no ready worker (" +
             text_field(pool, "reason", "no reason given") + ")";
    }
  }
  std::cout << "not ready: " << (why.empty() ? "see gpuqctl status" : why) << '\n';
  return kExitFailure;
}

}  // namespace

int cmd_ready(ArgCursor& cursor, std::string& runtime_dir) {
  if (std::optional<int> done = parse_no_arguments(cursor, runtime_dir, "ready")) return *done;
  return run_ready(runtime_dir);
}

}  // namespace gpuq::ctl
