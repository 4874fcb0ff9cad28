// Unit tests of gpuqctl top's arithmetic: the Prometheus text reader
// (tools/gpuqctl/prom_text.hpp) and the rates and quantiles computed from two metrics texts
// (tools/gpuqctl/top_report.hpp).
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gpuqctl/prom_text.hpp"
#include "gpuqctl/top_report.hpp"

namespace gpuq::ctl {
namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::vector<PromSample> parse_ok(const std::string& text) {
  auto samples = parse_prom_text(text);
  REQUIRE_MESSAGE(samples.ok(), samples.error().to_string());
  return std::move(samples).value();
}

// A histogram's _bucket lines as gpuqd writes them: `cumulative` holds the counts of the bounds
// in `bounds` and then of +Inf.
std::string histogram_text(const std::string& name, const std::string& pool, const std::string& op,
                           const std::vector<std::string>& bounds,
                           const std::vector<double>& cumulative) {
  REQUIRE(cumulative.size() == bounds.size() + 1);
  std::string text;
  for (size_t i = 0; i < cumulative.size(); ++i) {
    const std::string le = i < bounds.size() ? bounds[i] : "+Inf";
    text += name + "_bucket{pool=\"" + pool + "\",op=\"" + op + "\",le=\"" + le + "\"} " +
            std::to_string(static_cast<long long>(cumulative[i])) + "\n";
  }
  text += name + "_count{pool=\"" + pool + "\",op=\"" + op + "\"} " +
          std::to_string(static_cast<long long>(cumulative.back())) + "\n";
  return text;
}

const std::vector<std::string> kBounds = {"0.001", "0.01", "0.1"};

// The parts of a metrics text every test shares: one pool "cpu" with 4 workers.
std::string common_text(double start_time, const std::string& extra) {
  return "# HELP gpuq_build_info gpuqd's version (the value is always 1).\n"
         "# TYPE gpuq_build_info gauge\n"
         "gpuq_build_info{version=\"0.1.0\"} 1\n"
         "gpuq_start_time_seconds " +
         std::to_string(start_time) +
         "\n"
         "gpuq_ready 1\n"
         "gpuq_draining 0\n"
         "gpuq_clients_connected 2\n"
         "gpuq_clients_max 64\n"
         "gpuq_queue_depth{pool=\"cpu\"} 3\n"
         "gpuq_queue_capacity{pool=\"cpu\"} 40\n" +
         extra +
         "gpuq_workers{pool=\"cpu\",state=\"starting\"} 0\n"
         "gpuq_workers{pool=\"cpu\",state=\"idle\"} 1\n"
         "gpuq_workers{pool=\"cpu\",state=\"busy\"} 2\n"
         "gpuq_workers{pool=\"cpu\",state=\"stuck\"} 0\n"
         "gpuq_workers{pool=\"cpu\",state=\"restarting\"} 1\n"
         "gpuq_workers{pool=\"cpu\",state=\"failed\"} 0\n";
}

// ---- The text reader ------------------------------------------------------------------------

TEST_CASE("parse_prom_text skips comments and blank lines and reads names, labels and values") {
  const std::string text =
      "# HELP gpuq_jobs_total Jobs that ended, by pool, op and outcome.\n"
      "# TYPE gpuq_jobs_total counter\n"
      "\n"
      "# any other comment { \" \\ \n"
      "   \t\n"
      "gpuq_ready 1\n"
      "gpuq_jobs_total{pool=\"cpu\",op=\"echo\",outcome=\"ok\"} 12345\n"
      "gpuq_x{ a = \"1\" , b=\"2\", } 2 1700000000000\n"
      "gpuq_empty{} -3.5\r\n"
      "ns:name_with:colons 0\n"
      "last_without_newline 7";

  const std::vector<PromSample> s = parse_ok(text);

  REQUIRE(s.size() == 6);
  CHECK(s[0].name == "gpuq_ready");
  CHECK(s[0].labels.empty());
  CHECK(s[0].value == 1);
  CHECK(s[1].name == "gpuq_jobs_total");
  REQUIRE(s[1].labels.size() == 3);
  CHECK(s[1].labels[0] == std::pair<std::string, std::string>("pool", "cpu"));
  CHECK(s[1].label("op") == "echo");
  CHECK(s[1].label("outcome") == "ok");
  CHECK(s[1].label("missing").empty());
  CHECK(s[1].value == 12345);
  CHECK(s[2].label("a") == "1");
  CHECK(s[2].label("b") == "2");
  CHECK(s[2].value == 2);  // the timestamp is dropped
  CHECK(s[3].name == "gpuq_empty");
  CHECK(s[3].labels.empty());
  CHECK(s[3].value == -3.5);
  CHECK(s[4].name == "ns:name_with:colons");
  CHECK(s[5].value == 7);
}

TEST_CASE("parse_prom_text unescapes label values: backslash, double quote, newline") {
  const std::vector<PromSample> s =
      parse_ok(R"(m{pool="a \"quoted\" name",path="C:\\dir\\",text="two\nlines",comma="x,y}"} 1)");

  REQUIRE(s.size() == 1);
  CHECK(s[0].label("pool") == "a \"quoted\" name");
  CHECK(s[0].label("path") == "C:\\dir\\");
  CHECK(s[0].label("text") == "two\nlines");
  CHECK(s[0].label("comma") == "x,y}");
}

TEST_CASE("parse_prom_text reads +Inf, -Inf, NaN and exponent numbers") {
  const std::vector<PromSample> s = parse_ok(
      "h_bucket{le=\"+Inf\"} 5\n"
      "a +Inf\n"
      "b -Inf\n"
      "c NaN\n"
      "d 1.5e-06\n"
      "e 2E3\n"
      "f +7\n"
      "g .25\n"
      "h 1e+300\n");

  REQUIRE(s.size() == 9);
  CHECK(s[0].label("le") == "+Inf");
  CHECK(parse_prom_value(s[0].label("le")) == std::numeric_limits<double>::infinity());
  CHECK(std::isinf(s[1].value));
  CHECK(s[1].value > 0);
  CHECK(std::isinf(s[2].value));
  CHECK(s[2].value < 0);
  CHECK(std::isnan(s[3].value));
  CHECK(s[4].value == doctest::Approx(1.5e-6));
  CHECK(s[5].value == 2000);
  CHECK(s[6].value == 7);
  CHECK(s[7].value == 0.25);
  CHECK(s[8].value == 1e300);
  CHECK(parse_prom_value("5e-06") == doctest::Approx(5e-6));
  CHECK(parse_prom_value("inf").has_value());
  CHECK_FALSE(parse_prom_value("").has_value());
  CHECK_FALSE(parse_prom_value("+").has_value());
  CHECK_FALSE(parse_prom_value("--1").has_value());
  CHECK_FALSE(parse_prom_value("1x").has_value());
  CHECK_FALSE(parse_prom_value("0x10").has_value());
  CHECK_FALSE(parse_prom_value("infinity").has_value());
}

TEST_CASE("parse_prom_text names the first malformed line and what is wrong with it") {
  struct Case {
    const char* text;
    const char* expected;
  };
  const Case cases[] = {
      {"ok 1\nm{a=\"x} 1\n", "metrics line 2: a label value has no closing quote"},
      {"m{a=\"\\t\"} 1\n", "metrics line 1: unknown escape \\t"},
      {"m{a=x} 1\n", "metrics line 1: a label value must be in double quotes"},
      {"m{a=\"x\" b=\"y\"} 1\n", "metrics line 1: expected ',' or '}' after label a"},
      {"m{1a=\"x\"} 1\n", "metrics line 1: expected a label name"},
      {"# c\n\nm\n", "metrics line 3: no value for m"},
      {"m one\n", "metrics line 1: value 'one' of m is not a number"},
      {"m 1 2 3\n", "metrics line 1: unexpected text after the timestamp"},
      {"m 1 1.5\n", "metrics line 1: timestamp '1.5' of m is not a whole number"},
      {"{a=\"x\"} 1\n", "metrics line 1: expected a metric name"},
      {"9m 1\n", "metrics line 1: expected a metric name"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.text);
    auto r = parse_prom_text(c.text);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == ErrorCode::kInvalidArgument);
    CHECK_MESSAGE(contains(r.error().message(), c.expected), r.error().message());
  }
}

// ---- Quantiles --------------------------------------------------------------------------------

TEST_CASE("histogram_quantile interpolates linearly inside the bucket, as Prometheus does") {
  // 100 observations: none <= 1 ms, 50 in (1 ms, 10 ms], 50 in (10 ms, 100 ms], none above.
  const std::vector<std::pair<double, double>> buckets = {
      {0.001, 0}, {0.01, 50}, {0.1, 100}, {INFINITY, 100}};

  // p50: rank 50 is the end of (1 ms, 10 ms].
  CHECK(histogram_quantile(0.5, buckets) == doctest::Approx(0.01));
  // p99: rank 99, 49 into the 50 of (10 ms, 100 ms]: 10 ms + 90 ms x 49/50.
  CHECK(histogram_quantile(0.99, buckets) == doctest::Approx(0.0982));
  // p25: rank 25, halfway into (1 ms, 10 ms].
  CHECK(histogram_quantile(0.25, buckets) == doctest::Approx(0.0055));
  // The first bucket starts at 0: 10 observations all <= 1 ms, p50 = 0.5 ms.
  CHECK(histogram_quantile(0.5, {{0.001, 10}, {0.01, 10}, {INFINITY, 10}}) ==
        doctest::Approx(0.0005));
  // In any order, the way a sum over ops may come.
  CHECK(histogram_quantile(0.5, {{INFINITY, 100}, {0.1, 100}, {0.001, 0}, {0.01, 50}}) ==
        doctest::Approx(0.01));
}

TEST_CASE("histogram_quantile: +Inf bucket, no observations, malformed histograms") {
  // A rank in the +Inf bucket gives the highest finite bound.
  CHECK(histogram_quantile(0.99, {{0.001, 0}, {0.1, 10}, {INFINITY, 1000}}) ==
        doctest::Approx(0.1));
  // No observations, no +Inf bucket, or one bucket only: no value (Prometheus: NaN).
  CHECK_FALSE(histogram_quantile(0.5, {{0.001, 0}, {INFINITY, 0}}).has_value());
  CHECK_FALSE(histogram_quantile(0.5, {{0.001, 5}, {0.1, 10}}).has_value());
  CHECK_FALSE(histogram_quantile(0.5, {{INFINITY, 10}}).has_value());
  CHECK_FALSE(histogram_quantile(0.5, {}).has_value());
  CHECK_FALSE(histogram_quantile(1.5, {{0.1, 10}, {INFINITY, 10}}).has_value());
  // Equal bounds are merged; counts that dip are made monotonic.
  CHECK(histogram_quantile(0.5, {{0.01, 25}, {0.01, 25}, {0.1, 100}, {INFINITY, 100}}) ==
        doctest::Approx(0.01));
  CHECK(histogram_quantile(0.5, {{0.01, 50}, {0.1, 40}, {INFINITY, 100}}) == doctest::Approx(0.01));
}

// ---- Rates from two texts ---------------------------------------------------------------------

TEST_CASE("compute_top: jobs/s and failed/s over every op and outcome, p50/p99 of the deltas") {
  // Before: 1000 echo jobs ok, all slow (in (10 ms, 100 ms]); 10 failed.
  const std::string before = common_text(
      1700000000.5,
      "gpuq_jobs_total{pool=\"cpu\",op=\"echo\",outcome=\"ok\"} 1000\n"
      "gpuq_jobs_total{pool=\"cpu\",op=\"echo\",outcome=\"failed\"} 10\n"
      "gpuq_jobs_total{pool=\"cpu\",op=\"sleep\",outcome=\"ok\"} 0\n" +
          histogram_text("gpuq_job_queue_wait_seconds", "cpu", "echo", kBounds,
                         {0, 0, 1010, 1010}) +
          histogram_text("gpuq_job_queue_wait_seconds", "cpu", "sleep", kBounds, {0, 0, 0, 0}) +
          histogram_text("gpuq_job_run_seconds", "cpu", "echo", kBounds, {0, 0, 1010, 1010}) +
          histogram_text("gpuq_job_run_seconds", "cpu", "sleep", kBounds, {0, 0, 0, 0}) +
          "gpuq_worker_restarts_total{pool=\"cpu\"} 3\n");
  // After 2 s: +150 echo ok, +10 echo failed, +40 sleep ok (= 200 jobs); their queue waits:
  // 100 echo <= 1 ms, 60 echo in (1 ms, 10 ms], 40 sleep in (1 ms, 10 ms]. Run times: every one
  // of the 200 in (10 ms, 100 ms], two sleep ones above 100 ms. One restart more.
  const std::string after = common_text(
      1700000000.5,
      "gpuq_jobs_total{pool=\"cpu\",op=\"echo\",outcome=\"ok\"} 1150\n"
      "gpuq_jobs_total{pool=\"cpu\",op=\"echo\",outcome=\"failed\"} 20\n"
      "gpuq_jobs_total{pool=\"cpu\",op=\"sleep\",outcome=\"ok\"} 40\n" +
          histogram_text("gpuq_job_queue_wait_seconds", "cpu", "echo", kBounds,
                         {100, 160, 1170, 1170}) +
          histogram_text("gpuq_job_queue_wait_seconds", "cpu", "sleep", kBounds, {0, 40, 40, 40}) +
          histogram_text("gpuq_job_run_seconds", "cpu", "echo", kBounds, {0, 0, 1170, 1170}) +
          histogram_text("gpuq_job_run_seconds", "cpu", "sleep", kBounds, {0, 0, 38, 40}) +
          "gpuq_worker_restarts_total{pool=\"cpu\"} 4\n");

  const TopReport r = compute_top(parse_ok(before), parse_ok(after), 2.0);

  CHECK_FALSE(r.daemon_restarted);
  CHECK(r.version == "0.1.0");
  CHECK(r.ready);
  CHECK_FALSE(r.draining);
  CHECK(r.clients == 2);
  CHECK(r.clients_max == 64);
  REQUIRE(r.pools.size() == 1);
  const PoolTop& p = r.pools[0];
  CHECK(p.name == "cpu");
  CHECK(p.jobs_per_s == doctest::Approx(100));  // 200 jobs in 2 s
  CHECK(p.failed_per_s == doctest::Approx(5));  // 10 in 2 s
  // Queue wait: 100 of 200 <= 1 ms, so p50 is the bucket's end; p99 is rank 198, 98 into the
  // 100 of (1 ms, 10 ms]: 1 ms + 9 ms x 98/100.
  REQUIRE(p.wait_p50.has_value());
  CHECK(*p.wait_p50 == doctest::Approx(0.001));
  REQUIRE(p.wait_p99.has_value());
  CHECK(*p.wait_p99 == doctest::Approx(0.00982));
  // Run: 198 of 200 in (10 ms, 100 ms], 2 above: p50 rank 100 of 198 in the bucket; p99 rank
  // 198 is its end.
  REQUIRE(p.run_p50.has_value());
  CHECK(*p.run_p50 == doctest::Approx(0.01 + 0.09 * 100.0 / 198.0));
  REQUIRE(p.run_p99.has_value());
  CHECK(*p.run_p99 == doctest::Approx(0.1));
  CHECK(p.queue_depth == 3);
  CHECK(p.queue_capacity == 40);
  CHECK(p.workers_in("busy") == 2);
  CHECK(p.workers_in("idle") == 1);
  CHECK(p.workers_in("restarting") == 1);
  CHECK(p.workers_in("stuck") == 0);
  CHECK(p.restarts == 4);
  CHECK(p.restarts_delta == 1);
}

TEST_CASE("compute_top: no job in the interval gives rates of 0 and no quantiles") {
  const std::string text = common_text(
      1700000000,
      "gpuq_jobs_total{pool=\"cpu\",op=\"echo\",outcome=\"ok\"} 1000\n" +
          histogram_text("gpuq_job_queue_wait_seconds", "cpu", "echo", kBounds,
                         {0, 0, 1000, 1000}) +
          histogram_text("gpuq_job_run_seconds", "cpu", "echo", kBounds, {0, 0, 1000, 1000}));

  const TopReport r = compute_top(parse_ok(text), parse_ok(text), 1.0);

  REQUIRE(r.pools.size() == 1);
  CHECK(r.pools[0].jobs_per_s == 0);
  CHECK(r.pools[0].failed_per_s == 0);
  CHECK_FALSE(r.pools[0].wait_p50.has_value());
  CHECK_FALSE(r.pools[0].wait_p99.has_value());
  CHECK_FALSE(r.pools[0].run_p50.has_value());
  CHECK_FALSE(r.pools[0].run_p99.has_value());
  const std::string shown = format_top(r, 1700000065);
  CHECK(contains(shown, "gpuqd 0.1.0, up 1m05s, ready, clients 2/64, over 1.00 s\n"));
  CHECK(contains(shown, "       0.0       0.0          -          -          -          -"));
}

TEST_CASE("compute_top: a series new in the second text counts from 0") {
  const std::string before = common_text(1700000000, "");
  const std::string after = common_text(
      1700000000,
      "gpuq_jobs_total{pool=\"cpu\",op=\"echo\",outcome=\"ok\"} 30\n" +
          histogram_text("gpuq_job_run_seconds", "cpu", "echo", kBounds, {30, 30, 30, 30}));

  const TopReport r = compute_top(parse_ok(before), parse_ok(after), 3.0);

  REQUIRE(r.pools.size() == 1);
  CHECK(r.pools[0].jobs_per_s == doctest::Approx(10));
  CHECK(r.pools[0].run_p50 == doctest::Approx(0.0005));
  CHECK_FALSE(r.pools[0].wait_p50.has_value());  // no queue wait histogram at all
}

TEST_CASE("compute_top: a counter that went down is no data, never a negative rate") {
  // Pool cpu's counters went down (its daemon restarted between the texts without a new start
  // time in view, or a worker page was lost); pool gpu's went up.
  const std::string before = common_text(
      1700000000,
      "gpuq_jobs_total{pool=\"cpu\",op=\"echo\",outcome=\"ok\"} 500\n"
      "gpuq_jobs_total{pool=\"gpu\",op=\"gemm\",outcome=\"ok\"} 10\n" +
          histogram_text("gpuq_job_run_seconds", "cpu", "echo", kBounds, {500, 500, 500, 500}) +
          "gpuq_worker_restarts_total{pool=\"cpu\"} 5\n");
  const std::string after = common_text(
      1700000000,
      "gpuq_jobs_total{pool=\"cpu\",op=\"echo\",outcome=\"ok\"} 20\n"
      "gpuq_jobs_total{pool=\"gpu\",op=\"gemm\",outcome=\"ok\"} 30\n" +
          histogram_text("gpuq_job_run_seconds", "cpu", "echo", kBounds, {20, 20, 20, 20}) +
          "gpuq_worker_restarts_total{pool=\"cpu\"} 0\n");

  const TopReport r = compute_top(parse_ok(before), parse_ok(after), 1.0);

  REQUIRE(r.pools.size() == 2);
  const PoolTop& cpu = r.pools[0];
  CHECK(cpu.name == "cpu");
  CHECK_FALSE(cpu.jobs_per_s.has_value());
  CHECK_FALSE(cpu.failed_per_s.has_value());
  CHECK_FALSE(cpu.run_p50.has_value());
  CHECK_FALSE(cpu.run_p99.has_value());
  CHECK(cpu.restarts == 0);
  CHECK_FALSE(cpu.restarts_delta.has_value());
  const PoolTop& gpu = r.pools[1];
  CHECK(gpu.name == "gpu");
  CHECK(gpu.jobs_per_s == doctest::Approx(20));
  // Shown as "-", never as a negative number.
  const std::string shown = format_top(r, 1700000001);
  CHECK_FALSE(contains(shown, "-480"));
  CHECK(contains(shown, "\ncpu                -         -"));
}

TEST_CASE("compute_top: a series of the first text missing from the second is no data") {
  const std::string before =
      common_text(1700000000,
                  "gpuq_jobs_total{pool=\"cpu\",op=\"echo\",outcome=\"ok\"} 500\n"
                  "gpuq_jobs_total{pool=\"cpu\",op=\"sleep\",outcome=\"ok\"} 5\n");
  const std::string after =
      common_text(1700000000, "gpuq_jobs_total{pool=\"cpu\",op=\"echo\",outcome=\"ok\"} 600\n");

  const TopReport r = compute_top(parse_ok(before), parse_ok(after), 1.0);

  REQUIRE(r.pools.size() == 1);
  CHECK_FALSE(r.pools[0].jobs_per_s.has_value());
}

TEST_CASE("compute_top: a new daemon start time voids every rate") {
  const std::string jobs = "gpuq_jobs_total{pool=\"cpu\",op=\"echo\",outcome=\"ok\"} ";
  const std::string before = common_text(1700000000, jobs + "5\n");
  const std::string after = common_text(1700000100, jobs + "900\n");

  const TopReport r = compute_top(parse_ok(before), parse_ok(after), 1.0);

  CHECK(r.daemon_restarted);
  REQUIRE(r.pools.size() == 1);
  CHECK_FALSE(r.pools[0].jobs_per_s.has_value());
  CHECK(contains(format_top(r, 1700000200), "the daemon restarted: no rates this time"));
}

// A batched op's gpuq_batch_rows _sum and _count lines as gpuqd writes them.
std::string batch_rows_text(const std::string& pool, const std::string& op, double rows,
                            double calls) {
  const std::string labels = "{pool=\"" + pool + "\",op=\"" + op + "\"} ";
  return "gpuq_batch_rows_sum" + labels + std::to_string(static_cast<long long>(rows)) + "\n" +
         "gpuq_batch_rows_count" + labels + std::to_string(static_cast<long long>(calls)) + "\n";
}

TEST_CASE("compute_top and format_top: the mean batch size of a pool's batched ops") {
  // Pool py has two batched ops: classify took 300 rows in 10 calls over the interval, embed
  // (new in the second text: counts from 0) 60 rows in 10 calls. Pool cpu has none.
  const std::string before =
      common_text(1700000000, "gpuq_jobs_total{pool=\"py\",op=\"classify\",outcome=\"ok\"} 100\n" +
                                  batch_rows_text("py", "classify", 100, 10));
  const std::string after =
      common_text(1700000000, "gpuq_jobs_total{pool=\"py\",op=\"classify\",outcome=\"ok\"} 460\n" +
                                  batch_rows_text("py", "classify", 400, 20) +
                                  batch_rows_text("py", "embed", 60, 10));

  const TopReport r = compute_top(parse_ok(before), parse_ok(after), 2.0);

  REQUIRE(r.pools.size() == 2);
  const PoolTop& cpu = r.pools[0];
  CHECK(cpu.name == "cpu");
  CHECK_FALSE(cpu.batched);
  CHECK_FALSE(cpu.mean_batch.has_value());
  const PoolTop& py = r.pools[1];
  CHECK(py.name == "py");
  CHECK(py.batched);
  REQUIRE(py.mean_batch.has_value());
  CHECK(*py.mean_batch == doctest::Approx(18.0));  // 360 rows in 20 calls
  const std::string shown = format_top(r, 1700000001);
  CHECK(contains(shown, " RESTARTS   BATCH\n"));
  CHECK(contains(shown, "    18.0\n"));
  // The cpu line has no BATCH cell (not even a blank one).
  const size_t cpu_line = shown.find("\ncpu ");
  REQUIRE(cpu_line != std::string::npos);
  const std::string cpu_text =
      shown.substr(cpu_line + 1, shown.find('\n', cpu_line + 1) - cpu_line);
  CHECK(cpu_text.substr(cpu_text.size() - 2) != " \n");
}

TEST_CASE("compute_top: no batched call in the interval, or a batch counter that went down") {
  const std::string idle = common_text(1700000000, batch_rows_text("py", "classify", 400, 20));
  TopReport r = compute_top(parse_ok(idle), parse_ok(idle), 1.0);
  REQUIRE(r.pools.size() == 2);
  CHECK(r.pools[1].batched);
  CHECK_FALSE(r.pools[1].mean_batch.has_value());
  CHECK(contains(format_top(r, 1700000001), "       -\n"));

  const std::string lower = common_text(1700000000, batch_rows_text("py", "classify", 40, 5));
  r = compute_top(parse_ok(idle), parse_ok(lower), 1.0);
  REQUIRE(r.pools.size() == 2);
  CHECK_FALSE(r.pools[1].mean_batch.has_value());

  // A series gone from the second text: no data either, and no BATCH column without batching.
  r = compute_top(parse_ok(idle), parse_ok(common_text(1700000000, "")), 1.0);
  for (const PoolTop& p : r.pools) CHECK_FALSE(p.mean_batch.has_value());
  CHECK_FALSE(contains(format_top(r, 1700000001), "BATCH"));
}

TEST_CASE("compute_top and format_top: draining, GPU workers and GPUs, no escape codes") {
  std::string text = common_text(
      1700000000,
      "gpuq_worker_gpu_memory_used_bytes{pool=\"gpu\",worker=\"4\",gpu=\"0\"} 1073741824\n"
      "gpuq_worker_gpu_memory_budget_bytes{pool=\"gpu\",worker=\"4\",gpu=\"0\"} 4294967296\n"
      "gpuq_gpu_utilization_ratio{gpu=\"0\",uuid=\"GPU-1234\"} 0.45\n"
      "gpuq_gpu_memory_used_bytes{gpu=\"0\",uuid=\"GPU-1234\"} 4294967296\n"
      "gpuq_gpu_memory_total_bytes{gpu=\"0\",uuid=\"GPU-1234\"} 85899345920\n");
  text.replace(text.find("gpuq_draining 0"), 15, "gpuq_draining 1");

  const TopReport r = compute_top(parse_ok(text), parse_ok(text), 1.0);

  CHECK(r.draining);
  REQUIRE(r.gpu_workers.size() == 1);
  CHECK(r.gpu_workers[0].pool == "gpu");
  CHECK(r.gpu_workers[0].worker == "4");
  CHECK(r.gpu_workers[0].used_bytes == 1073741824.0);
  CHECK(r.gpu_workers[0].budget_bytes == 4294967296.0);
  REQUIRE(r.gpus.size() == 1);
  CHECK(r.gpus[0].uuid == "GPU-1234");
  CHECK(r.gpus[0].utilization == doctest::Approx(0.45));
  const std::string shown = format_top(r, 1700000001);
  CHECK(contains(shown, ", draining, "));
  CHECK(contains(shown, "1.00 GiB / 4.00 GiB (25%)"));
  CHECK(contains(shown, "  45%  4.00 GiB / 80.00 GiB (5%)"));
  CHECK(contains(shown, "GPU-1234"));
  CHECK(shown.find('\033') == std::string::npos);
}

TEST_CASE("compute_top and format_top: the clients with the most jobs queued, at most five") {
  std::string extra;
  // Seven clients; client 6 has the most queued, client 2 ties client 3 on queued and runs more.
  const int queued[] = {0, 3, 5, 5, 1, 2, 9};
  const int running[] = {1, 0, 2, 0, 0, 1, 1};
  for (int c = 0; c < 7; ++c) {
    for (const char* state : {"queued", "running"}) {
      extra += "gpuq_client_jobs{client=\"" + std::to_string(c) + "\",pid=\"" +
               std::to_string(1000 + c) + "\",program=\"" +
               (c == 6 ? std::string("a-program-name-longer-than-the-column") : "app") +
               "\",state=\"" + state + "\"} " +
               std::to_string(std::string(state) == "queued" ? queued[c] : running[c]) + "\n";
    }
  }
  const std::string text = common_text(1700000000, extra);
  const TopReport r = compute_top(parse_ok(text), parse_ok(text), 1.0);
  REQUIRE(r.clients_with_jobs.size() == 7);
  const std::string shown = format_top(r, 1700000001);
  INFO(shown);
  CHECK(contains(shown, "CLIENT      PID  PROGRAM"));
  const size_t six = shown.find("     6     1006  a-program-name-longer...");
  const size_t two = shown.find("     2     1002  app");
  const size_t three = shown.find("     3     1003  app");
  REQUIRE(six != std::string::npos);
  REQUIRE(two != std::string::npos);
  REQUIRE(three != std::string::npos);
  CHECK(six < two);
  CHECK(two < three);                               // the same queued: more running first
  CHECK_FALSE(contains(shown, "     4     1004"));  // the sixth and seventh are left out
  CHECK_FALSE(contains(shown, "     0     1000"));
  // No client with jobs: no table.
  const std::string idle = common_text(1700000000, "");
  CHECK_FALSE(
      contains(format_top(compute_top(parse_ok(idle), parse_ok(idle), 1.0), 1700000001), "CLIENT"));
}

}  // namespace
}  // namespace gpuq::ctl
