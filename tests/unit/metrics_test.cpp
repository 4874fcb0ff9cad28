// Metrics pieces without a daemon (docs/metrics.md): the worker's histogram and its bounds, the
// text format's label escaping, the GPU sampler's line, and the config keys job_metrics and
// metrics_listen. The whole path (workers counting, gpuqd rendering, gpuqctl and HTTP serving,
// parsed by prometheus_client) is tested in python/tests/test_metrics.py.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "config.hpp"
#include "gpu_discovery.hpp"
#include "gpuq/common/job_metrics.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "metrics_report.hpp"

using namespace gpuq;

namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("observe: a duration goes to the first bucket whose bound it does not pass") {
  static WorkerMetrics m{};  // static: zeroed, and too big for a comfortable stack frame
  uint64_t bounds[kMetricBounds];
  for (uint32_t b = 0; b < kMetricBounds; ++b) bounds[b] = (b + 1) * 100;  // 100, 200, ...
  OpMetrics& op = m.ops[0];
  observe(op, kRun, bounds, 0);
  observe(op, kRun, bounds, 100);   // on the bound: that bucket (le is "less or equal")
  observe(op, kRun, bounds, 101);   // past it: the next
  observe(op, kRun, bounds, 2200);  // the last finite bound
  observe(op, kRun, bounds, 2201);  // +Inf
  observe(op, kRun, bounds, UINT64_MAX / 4);
  observe(op, kQueueWait, bounds, 150);
  CHECK(op.buckets[0][kRun].load() == 2);
  CHECK(op.buckets[1][kRun].load() == 1);
  CHECK(op.buckets[kMetricBounds - 1][kRun].load() == 1);
  CHECK(op.buckets[kMetricBounds][kRun].load() == 2);
  CHECK(op.sum_ticks[kRun].load() == 0 + 100 + 101 + 2200 + 2201 + UINT64_MAX / 4);
  CHECK(op.buckets[1][kQueueWait].load() == 1);  // the other histogram, apart
  CHECK(op.buckets[0][kQueueWait].load() == 0);
  CHECK(op.sum_ticks[kQueueWait].load() == 150);
}

TEST_CASE("observe_batch_call and observe_gather: rows and gathering times by bucket") {
  static WorkerMetrics m{};
  uint64_t bounds[kMetricBounds];
  for (uint32_t b = 0; b < kMetricBounds; ++b) bounds[b] = (b + 1) * 100;
  OpBatchMetrics& op = m.batch[3];
  observe_batch_call(op, 1);         // le 1
  observe_batch_call(op, 2);         // on the bound: le 2
  observe_batch_call(op, 3);         // le 4
  observe_batch_call(op, 65536);     // the last finite bound
  observe_batch_call(op, 65537);     // +Inf
  observe_gather(op, bounds, 100);   // on the first bound
  observe_gather(op, bounds, 101);   // the next
  observe_gather(op, bounds, 2201);  // +Inf
  CHECK(op.calls.load() == 5);
  CHECK(op.rows_sum.load() == 1 + 2 + 3 + 65536 + 65537);
  CHECK(op.rows_buckets[0].load() == 1);
  CHECK(op.rows_buckets[1].load() == 1);
  CHECK(op.rows_buckets[2].load() == 1);
  CHECK(op.rows_buckets[kBatchRowBounds - 1].load() == 1);
  CHECK(op.rows_buckets[kBatchRowBounds].load() == 1);
  CHECK(op.gathers.load() == 3);
  CHECK(op.gather_ticks.load() == 100 + 101 + 2201);
  CHECK(op.gather_buckets[0].load() == 1);
  CHECK(op.gather_buckets[1].load() == 1);
  CHECK(op.gather_buckets[kMetricBounds].load() == 1);
  CHECK(m.batch[2].calls.load() == 0);  // other slots untouched
  CHECK(m.ops[3].outcomes[0].load() == 0);
}

TEST_CASE("the metrics page fits the private memfd after WorkerPrivate") {
  CHECK(kWorkerMetricsOffset >= sizeof(WorkerPrivate));
  CHECK(kWorkerMetricsOffset + sizeof(WorkerMetrics) <= kWorkerPrivateBytes);
  CHECK(kWorkerPrivateBytes % 4096 == 0);
  // Each op's counts start on a line of their own: no line shared between two ops' counts.
  CHECK(offsetof(WorkerMetrics, ops) % 64 == 0);
  CHECK(sizeof(OpMetrics) % 64 == 0);
  // The first line holds the outcomes and both sums; a short job's buckets the next.
  CHECK(offsetof(OpMetrics, buckets) == 64);
  // The bounds rise (observe relies on it).
  for (uint32_t b = 1; b < kMetricBounds; ++b)
    CHECK(kMetricBoundSeconds[b] > kMetricBoundSeconds[b - 1]);
  // A batched op's counts: on lines of their own, in bounds that rise from 1 row.
  CHECK(offsetof(WorkerMetrics, batch) % 64 == 0);
  CHECK(sizeof(OpBatchMetrics) % 64 == 0);
  CHECK(kBatchRowBound[0] == 1);
  for (uint32_t b = 1; b < kBatchRowBounds; ++b) CHECK(kBatchRowBound[b] > kBatchRowBound[b - 1]);
}

TEST_CASE("label values escape backslash, double quote and newline") {
  CHECK(daemon::escape_label_value("plain") == "plain");
  CHECK(daemon::escape_label_value(R"(a"b\c)") == R"(a\"b\\c)");
  CHECK(daemon::escape_label_value("two\nlines") == R"(two\nlines)");
}

TEST_CASE("GPU sample lines: written and read back; bad ones refused") {
  daemon::GpuSample a;
  a.uuid = "GPU-aaaa";
  a.utilization = 0.37;
  a.memory_used_bytes = 1ull << 30;
  a.memory_total_bytes = 80ull << 30;
  daemon::GpuSample b;  // nothing readable but its UUID
  b.uuid = "GPU-bbbb";
  const std::string line = daemon::gpu_samples_line({a, b});
  CHECK(line.back() == '\n');
  auto back = daemon::parse_gpu_samples_line(line.substr(0, line.size() - 1));
  REQUIRE(back.ok());
  REQUIRE(back->size() == 2);
  CHECK((*back)[0].uuid == "GPU-aaaa");
  CHECK((*back)[0].utilization == doctest::Approx(0.37));
  CHECK((*back)[0].memory_used_bytes == (1ull << 30));
  CHECK((*back)[0].memory_total_bytes == (80ull << 30));
  CHECK_FALSE((*back)[1].utilization.has_value());
  CHECK_FALSE((*back)[1].memory_used_bytes.has_value());
  for (const char* bad : {"", "[]", R"({"gpus": 3})", R"({"gpus": [{}]})",
                          R"({"gpus": [{"uuid": "x", "utilization": 1.5}]})",
                          R"({"gpus": [{"uuid": "x", "memory_used_bytes": -1}]})"}) {
    CAPTURE(bad);
    auto r = daemon::parse_gpu_samples_line(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(contains(r.error().message(), "GPU sample"));
  }
}

TEST_CASE("config: job_metrics and metrics_listen") {
  const std::vector<int> cpus = {0};
  auto defaulted = daemon::parse_config("{}", cpus);
  REQUIRE(defaulted.ok());
  CHECK(defaulted->job_metrics);
  CHECK_FALSE(defaulted->metrics_listen.has_value());

  auto off = daemon::parse_config(R"({"job_metrics": false, "metrics_listen": null})", cpus);
  REQUIRE(off.ok());
  CHECK_FALSE(off->job_metrics);
  CHECK_FALSE(off->metrics_listen.has_value());

  auto port_only = daemon::parse_config(R"({"metrics_listen": "9464"})", cpus);
  REQUIRE(port_only.ok());
  REQUIRE(port_only->metrics_listen.has_value());
  CHECK(port_only->metrics_listen->host == "127.0.0.1");  // loopback unless named
  CHECK(port_only->metrics_listen->port == 9464);
  auto any = daemon::parse_config(R"({"metrics_listen": "0.0.0.0:9100"})", cpus);
  REQUIRE(any.ok());
  CHECK(any->metrics_listen->host == "0.0.0.0");

  for (const char* bad :
       {R"({"job_metrics": 1})", R"({"metrics_listen": 9464})",
        R"({"metrics_listen": "localhost:9464"})", R"({"metrics_listen": "127.0.0.1:70000"})",
        R"({"metrics_listen": ""})"}) {
    CAPTURE(bad);
    auto r = daemon::parse_config(bad, cpus);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == ErrorCode::kInvalidArgument);
    CHECK_MESSAGE((contains(r.error().message(), "job_metrics") ||
                   contains(r.error().message(), "metrics_listen")),
                  r.error().message());
  }
}
