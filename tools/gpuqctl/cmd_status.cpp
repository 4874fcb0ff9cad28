// gpuqctl status [--json]: the daemon's pools and workers as a table, or its status document.
#include <algorithm>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "commands.hpp"
#include "gpuq/client.hpp"
#include "gpuq/common/cpu_list.hpp"

namespace gpuq::ctl {
namespace {

std::optional<double> number_field(const Json& object, const char* key) {
  if (!object.is_object()) return std::nullopt;
  auto it = object.find(key);
  if (it == object.end() || !it->is_number()) return std::nullopt;
  return it->get<double>();
}

// [0,1,2,3,6] -> "0-3,6".
std::string format_cpus(const Json& worker) {
  if (!worker.is_object()) return "-";
  auto it = worker.find("cpus");
  if (it == worker.end() || !it->is_array() || it->empty()) return "-";
  std::vector<long long> cpus;
  for (const Json& c : *it) {
    if (c.is_number_integer()) cpus.push_back(c.get<long long>());
  }
  std::sort(cpus.begin(), cpus.end());
  const std::string out = gpuq::cpu_list_text(cpus);
  return out.empty() ? "-" : out;
}

void print_status_table(const Json& doc) {
  std::string header = "gpuqd " + text_field(doc, "version") + ", pid " + text_field(doc, "pid");
  if (auto up = number_field(doc, "uptime_s")) header += ", up " + format_uptime(*up);
  header += ", " + text_field(doc, "state", "state unknown");
  header += ", clients " + text_field(doc, "clients");
  std::cout << header << '\n';

  auto pools = doc.is_object() ? doc.find("pools") : doc.end();
  if (pools == doc.end() || !pools->is_array() || pools->empty()) {
    std::cout << "no pools\n";
    return;
  }
  for (const Json& pool : *pools) {
    std::string line = "pool " + text_field(pool, "name", "?") + " (" + text_field(pool, "kind") +
                       "): " + text_field(pool, "status", "status unknown");
    std::string reason = text_field(pool, "reason", "");
    if (!reason.empty()) line += " (" + reason + ")";
    line += ", queue " + text_field(pool, "queue_depth") + "/" + text_field(pool, "capacity");
    line += ", workers " + text_field(pool, "workers_ready") + "/" +
            text_field(pool, "workers_total") + " ready";
    if (pool.is_object() && pool.contains("accepting") && pool["accepting"] == false) {
      line += ", not accepting jobs";
    }
    std::cout << '\n' << line << '\n';

    auto workers = pool.is_object() ? pool.find("workers") : pool.end();
    if (workers == pool.end() || !workers->is_array() || workers->empty()) {
      std::cout << "  no workers\n";
      continue;
    }
    std::cout << strf("  %6s %8s %-12s %-10s %-4s %10s %8s %8s\n", "WORKER", "PID", "CPUS", "STATE",
                      "BUSY", "DONE", "FAILED", "RESTARTS");
    for (const Json& w : *workers) {
      std::cout << strf("  %6s %8s %-12s %-10s %-4s %10s %8s %8s\n", text_field(w, "id").c_str(),
                        text_field(w, "pid").c_str(), format_cpus(w).c_str(),
                        text_field(w, "state").c_str(), text_field(w, "busy").c_str(),
                        text_field(w, "jobs_done").c_str(), text_field(w, "jobs_failed").c_str(),
                        text_field(w, "restarts").c_str());
    }
  }
}

int run_status(const std::string& runtime_dir, bool as_json) {
  gpuq::Result<std::string> text = gpuq::daemon_status_json(runtime_dir);
  if (!text) return daemon_error(text.error());
  Json doc = Json::parse(text.value(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return daemon_error(gpuq::Error(gpuq::ErrorCode::kProtocolMismatch,
                                    "the daemon's status document is not valid JSON"));
  }
  if (as_json) {
    std::cout << doc.dump(2) << '\n';
  } else {
    print_status_table(doc);
  }
  return kExitOk;
}

}  // namespace

int cmd_status(ArgCursor& cursor, std::string& runtime_dir) {
  std::string error;
  bool as_json = false;
  while (!cursor.done()) {
    std::string_view arg = cursor.peek();
    if (arg == "--json") {
      as_json = true;
      cursor.next();
    } else if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      return kExitOk;
    } else if (cursor.take_value("--runtime-dir", runtime_dir, error)) {
      if (!error.empty()) return usage_error(error);
    } else {
      return usage_error("unknown argument '" + std::string(arg) + "' for status");
    }
  }
  return run_status(runtime_dir, as_json);
}

}  // namespace gpuq::ctl
