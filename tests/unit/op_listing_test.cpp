// OpListings (daemon/supervisor/op_listing.hpp): a Python pool's ops listed while the loop
// serves, with stand-in interpreters (shell scripts that print what gpuq._worker --list-ops
// would), a real epoll loop and real child processes (ForkExecLauncher): the ops come back
// through on_done once the child is reaped, a failing import names its module, a listing that
// hangs is killed at its time limit, and a cancelled one never reports.
#include <doctest/doctest.h>
#include <sys/epoll.h>
#include <sys/wait.h>

#include <optional>
#include <string>
#include <vector>

#include "gpuq/common/clock.hpp"
#include "op_listing.hpp"
#include "support/scratch_dir.hpp"

namespace gpuq::daemon {
namespace {

using Scratch = test::ScratchDir;

PoolConfig python_pool(const std::string& interpreter) {
  PoolConfig p;
  p.name = "py";
  p.python = PythonPoolConfig{};
  p.python->interpreter = interpreter;
  p.python->modules = {"models.text"};
  return p;
}

struct Outcome {
  uint32_t pool = 0;
  Result<std::vector<ListedPythonOp>> ops = Error(ErrorCode::kInternal, "none");
  PythonListingDetail detail;
};

// The supervisor's part: the loop's events to the listings, children reaped, until `done`
// or `limit_ms` passes.
struct Harness {
  EventLoop loop;
  ForkExecLauncher launcher;
  OpListings listings;
  std::vector<Outcome> done;

  explicit Harness(uint64_t timeout_ns) : listings(loop, launcher, timeout_ns) {
    REQUIRE(loop.open().ok());
    listings.set_on_done([this](uint32_t pool, Result<std::vector<ListedPythonOp>> ops,
                                const PythonListingDetail& detail) {
      done.push_back({pool, std::move(ops), detail});
    });
  }
  void run(size_t want, int limit_ms) {
    const uint64_t end = monotonic_ns() + uint64_t(limit_ms) * 1'000'000;
    while (done.size() < want && monotonic_ns() < end) {
      epoll_event events[8];
      auto n = loop.wait(events, 8, 20);
      REQUIRE(n.ok());
      for (int i = 0; i < *n; ++i) {
        if (tag_kind(events[i].data.u64) == Tag::kListing) {
          listings.on_output(tag_id(events[i].data.u64));
        }
      }
      while (auto child = launcher.reap()) listings.on_exit(child->pid, child->status);
      listings.tick(monotonic_ns());
    }
  }
};

TEST_CASE("OpListings: the ops a pool's modules define, python_call first, without blocking") {
  Scratch s;
  // It prints its list only after a while: start() returns at once meanwhile.
  const std::string python = s.script("python-ok", R"(sleep 0.3
echo 'a module printed this' >&2
echo '[{"name":"ol_one","summary":"1"},{"name":"ol_two","summary":"2","max_batch_size":4}]'
)");
  Harness h(10'000'000'000ull);
  const uint64_t before = monotonic_ns();
  REQUIRE(h.listings.start(3, python_pool(python), monotonic_ns()).ok());
  CHECK(monotonic_ns() - before < 200'000'000ull);
  CHECK(h.listings.running(3));
  auto again = h.listings.start(3, python_pool(python), monotonic_ns());
  REQUIRE(!again.ok());
  CHECK(again.error().message() == "pool py: its ops are being listed");
  h.run(1, 10'000);
  REQUIRE(h.done.size() == 1);
  CHECK(h.done[0].pool == 3);
  REQUIRE_MESSAGE(h.done[0].ops.ok(), h.done[0].ops.error().message());
  const auto& ops = *h.done[0].ops;
  REQUIRE(ops.size() == 3);
  CHECK(ops[0].name == kPythonCallOp);
  CHECK(ops[1].name == "ol_one");
  CHECK(ops[2].batching.max_batch_size == 4);
  CHECK(h.done[0].detail.stderr_text == "a module printed this\n");
  CHECK(!h.listings.running(3));
}

TEST_CASE("OpListings: a module that does not import: its name, exception and traceback") {
  Scratch s;
  const std::string python = s.script("python-bad", R"(cat >&2 <<'TRACE'
Traceback (most recent call last):
  File "/venv/gpuq/_worker.py", line 54, in _import_modules
    importlib.import_module(m)
  File "/srv/models/text.py", line 3, in <module>
    raise RuntimeError('no weights')
RuntimeError: no weights
TRACE
exit 1
)");
  Harness h(10'000'000'000ull);
  REQUIRE(h.listings.start(0, python_pool(python), monotonic_ns()).ok());
  h.run(1, 10'000);
  REQUIRE(h.done.size() == 1);
  REQUIRE(!h.done[0].ops.ok());
  CHECK(h.done[0].ops.error().message() ==
        "importing module 'models.text' failed (exit status 1): RuntimeError: no weights");
  CHECK(h.done[0].detail.module == "models.text");
  CHECK(h.done[0].detail.stderr_text.find("raise RuntimeError") != std::string::npos);
}

TEST_CASE("OpListings: a listing past its time is killed; a cancelled one never reports") {
  Scratch s;
  const std::string python = s.script("python-hangs", "echo 'loading' >&2\nexec sleep 30\n");
  Harness h(300'000'000ull);
  REQUIRE(h.listings.start(1, python_pool(python), monotonic_ns()).ok());
  REQUIRE(h.listings.start(2, python_pool(python), monotonic_ns()).ok());
  h.listings.cancel(2);
  CHECK(!h.listings.running(2));
  h.run(1, 10'000);
  REQUIRE(h.done.size() == 1);
  CHECK(h.done[0].pool == 1);
  REQUIRE(!h.done[0].ops.ok());
  CHECK(h.done[0].ops.error().code() == ErrorCode::kTimeout);
  CHECK(h.done[0].ops.error().message() == "listing its ops took more than 300 ms");
  CHECK(h.done[0].detail.stderr_text == "loading\n");
  h.run(2, 500);  // the cancelled one was killed and reaped: nothing more comes
  CHECK(h.done.size() == 1);
  // An interpreter that is gone is an error at start, naming the key.
  auto gone = h.listings.start(4, python_pool(s.dir + "/no-python"), monotonic_ns());
  REQUIRE(!gone.ok());
  CHECK(gone.error().message().find("python.interpreter") == 0);
}

}  // namespace
}  // namespace gpuq::daemon
