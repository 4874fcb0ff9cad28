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

// A duration in milliseconds as format_ns() writes it ("1.234 s").
std::string format_ms(double ms) {
  return format_ns(ms <= 0 ? 0 : static_cast<uint64_t>(ms * 1e6));
}

// What a busy worker runs, from its "job" object: "sleep from client 3 \"pytest\" (pid 4242),
// running 1.250 s of its 2.000 s limit, asked to stop (time limit)". "-" when it runs none.
std::string format_job(const Json& worker) {
  auto it = worker.is_object() ? worker.find("job") : worker.end();
  if (it == worker.end() || !it->is_object()) return "-";
  const Json& job = *it;
  std::string text = text_field(job, "op", "?") + " from client " + text_field(job, "client", "?");
  std::string name = text_field(job, "client_name", "");
  // A client names itself: no control characters of its reach the terminal.
  std::replace_if(
      name.begin(), name.end(),
      [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; }, '?');
  if (!name.empty()) text += " \"" + name + "\"";
  if (job.contains("client_pid") && job["client_pid"].is_number()) {
    text += " (pid " + text_field(job, "client_pid") + ")";
  }
  if (auto age = number_field(job, "age_ms")) text += ", running " + format_ms(*age);
  if (auto limit = number_field(job, "time_limit_ms")) {
    text += " of its " + format_ms(*limit) + " limit";
  }
  const std::string stop = text_field(job, "stop_requested", "");
  if (stop == "time_limit") {
    text += ", asked to stop (time limit)";
  } else if (stop == "cancel") {
    text += ", asked to stop (cancelled)";
  } else if (!stop.empty()) {
    text += ", asked to stop (" + stop + ")";
  }
  return text;
}

// "  <what>:" and `text` (a traceback) below it, each line indented; nothing when it is empty.
void print_indented(const std::string& what, const std::string& text) {
  if (text.empty()) return;
  std::cout << "  " << what << ":\n";
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    std::cout << "    " << std::string_view(text).substr(begin, end - begin) << '\n';
    begin = end + 1;
  }
}

// The clients with jobs queued or running, most queued first (status' `client_jobs`).
void print_client_jobs(const Json& doc) {
  auto clients = doc.is_object() ? doc.find("client_jobs") : doc.end();
  if (clients == doc.end() || !clients->is_array() || clients->empty()) return;
  std::cout << "\nclients with jobs (most queued first):\n";
  std::cout << strf("  %6s %8s %-24s %6s %8s %8s  %s\n", "CLIENT", "PID", "PROGRAM", "WEIGHT",
                    "QUEUED", "RUNNING", "POOLS");
  for (const Json& c : *clients) {
    std::string pools;
    if (auto p = c.is_object() ? c.find("pools") : c.end(); p != c.end() && p->is_object()) {
      for (const auto& [name, jobs] : p->items()) {
        pools += (pools.empty() ? "" : ", ") + name + " " + text_field(jobs, "queued") + "/" +
                 text_field(jobs, "running");
      }
    }
    std::string program = text_field(c, "program", "");
    if (program.size() > 24) program = program.substr(0, 21) + "...";
    std::cout << strf("  %6s %8s %-24s %6s %8s %8s  ", text_field(c, "client").c_str(),
                      text_field(c, "pid").c_str(), program.c_str(),
                      text_field(c, "weight").c_str(), text_field(c, "queued").c_str(),
                      text_field(c, "running").c_str())
              << pools << '\n';
  }
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
    // Jobs queued at each priority level but the normal one, when there are any.
    if (auto levels = pool.is_object() ? pool.find("queued_by_priority") : pool.end();
        levels != pool.end() && levels->is_object()) {
      std::string by_level;
      for (const char* level : {"high", "low"}) {
        if (auto n = number_field(*levels, level); n && *n > 0) {
          by_level += (by_level.empty() ? "" : ", ") + text_field(*levels, level) + " " + level;
        }
      }
      if (!by_level.empty()) line += " (" + by_level + ")";
    }
    if (text_field(pool, "status", "") == "removed") {  // by a config reload: no workers to show
      std::cout << '\n' << line << '\n';
      continue;
    }
    line += ", workers " + text_field(pool, "workers_ready") + "/" +
            text_field(pool, "workers_total") + " ready";
    if (auto stuck = number_field(pool, "workers_stuck"); stuck && *stuck > 0) {
      line += ", " + text_field(pool, "workers_stuck") + " stuck";
    }
    // Spare workers (spare_workers): ready ones held out of the ring, and how many took a dead
    // or stopped worker's place.
    if (auto spares = number_field(pool, "spares_total"); spares && *spares > 0) {
      line += ", spares " + text_field(pool, "spares_ready") + "/" +
              text_field(pool, "spares_total") + " ready";
      if (auto promoted = number_field(pool, "spare_promotions"); promoted && *promoted > 0) {
        line += " (" + text_field(pool, "spare_promotions") + " promoted)";
      }
    }
    if (auto limit = number_field(pool, "job_time_limit_ms")) {
      line += ", job time limit " + format_ms(*limit);
    }
    // Rolling restarts (gpuqctl restart): the generation past the first, one in progress.
    if (auto g = number_field(pool, "generation"); g && *g > 1) {
      line += ", generation " + text_field(pool, "generation");
    }
    const Json* rollout = pool.is_object() && pool.contains("rollout") ? &pool["rollout"] : nullptr;
    if (rollout != nullptr && text_field(*rollout, "state", "") == "rolling") {
      line += ", rolling restart in progress";
    }
    if (auto forced = number_field(pool, "stops_forced"); forced && *forced > 0) {
      line += ", " + text_field(pool, "stops_forced") + (*forced == 1 ? " worker" : " workers") +
              " stopped for jobs that did not end";
    }
    if (pool.is_object() && pool.contains("accepting") && pool["accepting"] == false) {
      line += ", not accepting jobs";
    }
    if (auto unserved = number_field(pool, "unserved_ms")) {
      line += ", no ready worker for " + format_ms(*unserved);
    }
    std::cout << '\n' << line << '\n';
    // A pool that is down: what its jobs fail with (the pool, its last worker's exit).
    if (pool.is_object() && pool.contains("failing_jobs") && pool["failing_jobs"] == true) {
      std::cout << "  jobs fail with PoolDown: " << text_field(pool, "failing_jobs_error", "")
                << '\n';
    }
    // A Python pool: its interpreter and ops, and the traceback of a failed op listing.
    if (auto py = pool.is_object() ? pool.find("python") : pool.end();
        py != pool.end() && py->is_object()) {
      std::string ops;
      if (auto o = py->find("ops"); o != py->end() && o->is_array()) {
        for (const Json& name : *o) {
          ops += (ops.empty() ? "" : ", ") +
                 (name.is_string() ? name.get<std::string>() : name.dump());
        }
      }
      std::cout << "  python " << text_field(*py, "interpreter")
                << ", ops: " << (ops.empty() ? "none" : ops)
                << (py->value("allow_callables", false) ? "; runs callables" : "") << '\n';
      // Its batched ops: "  batching classify: max_batch_size 64, max_queue_delay_us 500";
      // a step op's: "  batching generate: per step, max_batch_size 32".
      if (auto b = py->find("batching"); b != py->end() && b->is_object()) {
        for (const auto& [name, settings] : b->items()) {
          if (settings.is_object() && settings.value("step", false)) {
            std::cout << "  batching " << name << ": per step, max_batch_size "
                      << text_field(settings, "max_batch_size") << '\n';
            continue;
          }
          std::cout << "  batching " << name << ": max_batch_size "
                    << text_field(settings, "max_batch_size") << ", max_queue_delay_us "
                    << text_field(settings, "max_queue_delay_us") << '\n';
        }
      }
    }
    if (rollout != nullptr && text_field(*rollout, "state", "") == "failed") {
      print_indented("last rolling restart stopped", text_field(*rollout, "error", ""));
    }
    print_indented("start error", text_field(pool, "start_error", ""));

    auto workers = pool.is_object() ? pool.find("workers") : pool.end();
    if (workers == pool.end() || !workers->is_array() || workers->empty()) {
      std::cout << "  no workers\n";
      continue;
    }
    std::cout << strf("  %6s %8s %-12s %-10s %-4s %10s %8s %8s  %s\n", "WORKER", "PID", "CPUS",
                      "STATE", "BUSY", "DONE", "FAILED", "RESTARTS", "JOB");
    for (const Json& w : *workers) {
      // A spare: "spare" once ready (held out of the ring), else "spare/<state>".
      std::string state = text_field(w, "state");
      const std::string role = text_field(w, "role", "active");
      if (role == "spare" || role == "surge") {  // a surge seat runs only during a rollout
        state = state == "ready" ? role : role + "/" + state;
      }
      // The job last: its text has no bound on its length that strf's buffer could hold.
      std::cout << strf("  %6s %8s %-12s %-10s %-4s %10s %8s %8s  ", text_field(w, "id").c_str(),
                        text_field(w, "pid").c_str(), format_cpus(w).c_str(), state.c_str(),
                        text_field(w, "busy").c_str(), text_field(w, "jobs_done").c_str(),
                        text_field(w, "jobs_failed").c_str(), text_field(w, "restarts").c_str())
                << format_job(w) << '\n';
      // A worker whose starts fail, or that waits to be started again: how many in a row, how
      // its last process ended, when the next try comes.
      const auto failures = number_field(w, "start_failures");
      const auto next = number_field(w, "next_start_ms");
      if ((failures && *failures > 0) || next) {
        std::string about = "  worker " + text_field(w, "id") + ":";
        if (failures && *failures > 0) {
          about += " failed to start " + text_field(w, "start_failures") + " times in a row;";
        }
        if (w.is_object() && w.contains("last_exit") && w["last_exit"].is_string()) {
          about += " last exit: " + text_field(w, "last_exit") + ";";
        }
        if (next) about += " next start in " + format_ms(*next) + ";";
        about.pop_back();
        std::cout << about << '\n';
      }
      print_indented("worker " + text_field(w, "id") + " start error",
                     text_field(w, "start_error", ""));
    }
  }
  print_client_jobs(doc);
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
