// Unit tests of the checked-call wrappers (common/include/gpuq/common/posix_call.hpp): each form,
// driven by real calls that really fail and really succeed, reports the call, the error number
// and its text, the place and the mapped ErrorCode; leaves errno as the call set it; retries
// EINTR; and allocates nothing when the call succeeds.
#include "gpuq/common/posix_call.hpp"

#include <dirent.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <string>
#include <thread>

#include "gpuq/common/clock.hpp"
#include "gpuq/common/unique_fd.hpp"

// Every allocation of this test program is counted, so that a test can check that a successful
// call allocated nothing.
namespace {
std::atomic<long> g_allocations{0};
}  // namespace

// Out of line, so that GCC does not pair an inlined free() with a new expression and warn
// (-Wmismatched-new-delete): the pair is matched, both sides being these replacements.
[[gnu::noinline]] void* operator new(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
[[gnu::noinline]] void operator delete(void* p) noexcept {
  std::free(p);
}
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}

namespace gpuq {
namespace {

constexpr const char* kMissing = "/nonexistent-gpuq-posix-call-test/file";

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The checks every failure shares: the code, and a message that names the call, the error
// number and its text, and this file.
void check_failure(const Error& e, ErrorCode code, const char* call, int err) {
  INFO(e.message());
  CHECK(e.code() == code);
  CHECK(e.message().rfind(std::string(call) + " failed: ", 0) == 0);
  CHECK(contains(e.message(), std::strerror(err)));
  CHECK(contains(e.message(), "(errno " + std::to_string(err) + ", "));
  CHECK(contains(e.message(), "posix_call_test.cpp:"));
}

TEST_CASE("GPUQ_POSIX_CALL: open of a missing path fails with ENOENT, named") {
  errno = 0;
  Result<long> fd = GPUQ_POSIX_CALL(::open, kMissing, O_RDONLY | O_CLOEXEC);
  const int err = errno;
  REQUIRE_FALSE(fd.ok());
  check_failure(fd.error(), ErrorCode::kSystemError, "open", ENOENT);
  CHECK(err == ENOENT);  // errno is the call's, not disturbed by building the message
}

TEST_CASE("GPUQ_POSIX_CALL: open of /dev/null returns the descriptor") {
  const long before = g_allocations.load();
  Result<long> fd = GPUQ_POSIX_CALL(::open, "/dev/null", O_RDONLY | O_CLOEXEC);
  const long allocated = g_allocations.load() - before;
  REQUIRE(fd.ok());
  CHECK(*fd >= 0);
  CHECK(allocated == 0);
  UniqueFd owned(static_cast<int>(*fd));
  struct stat st {};
  CHECK(GPUQ_POSIX_CALL(::fstat, owned.get(), &st).ok());
}

TEST_CASE("GPUQ_POSIX_CALL: a call without arguments compiles and succeeds") {
  Result<long> pid = GPUQ_POSIX_CALL(::getppid);
  REQUIRE(pid.ok());
  CHECK(*pid == static_cast<long>(::getppid()));
}

TEST_CASE("GPUQ_ERRNUM_CALL: pthread_setname_np with a 20-character name returns ERANGE") {
  errno = 0;
  Result<void> r = GPUQ_ERRNUM_CALL(pthread_setname_np, pthread_self(), "twenty-characters-xx");
  const int err = errno;
  REQUIRE_FALSE(r.ok());
  check_failure(r.error(), ErrorCode::kSystemError, "pthread_setname_np", ERANGE);
  CHECK(err == ERANGE);  // the returned number, put in errno
}

TEST_CASE("GPUQ_ERRNUM_CALL: pthread_setname_np with a short name succeeds") {
  char old_name[16] = "";
  REQUIRE(GPUQ_ERRNUM_CALL(pthread_getname_np, pthread_self(), old_name, sizeof old_name).ok());
  const long before = g_allocations.load();
  Result<void> r = GPUQ_ERRNUM_CALL(pthread_setname_np, pthread_self(), "gpuq-test");
  const long allocated = g_allocations.load() - before;
  CHECK(r.ok());
  CHECK(allocated == 0);
  char name[16] = "";
  REQUIRE(GPUQ_ERRNUM_CALL(pthread_getname_np, pthread_self(), name, sizeof name).ok());
  CHECK(std::string(name) == "gpuq-test");
  CHECK(GPUQ_ERRNUM_CALL(pthread_setname_np, pthread_self(), old_name).ok());
}

// No libc call reports failure as a negative error number (libsystemd's do, and the test does
// not link it): two stand-ins with that convention.
long returns_minus_enoent() {
  return -ENOENT;
}
long returns_seven() {
  return 7;
}

TEST_CASE("GPUQ_NEG_ERRNO_CALL: a negative return is the error number") {
  errno = 0;
  Result<long> r = GPUQ_NEG_ERRNO_CALL(returns_minus_enoent);
  const int err = errno;
  REQUIRE_FALSE(r.ok());
  check_failure(r.error(), ErrorCode::kSystemError, "returns_minus_enoent", ENOENT);
  CHECK(err == ENOENT);
  Result<long> ok = GPUQ_NEG_ERRNO_CALL(returns_seven);
  REQUIRE(ok.ok());
  CHECK(*ok == 7);
}

TEST_CASE("GPUQ_NONNULL_CALL: fopen of a missing file returns null, reported as ENOENT") {
  Result<FILE*> f = GPUQ_NONNULL_CALL(std::fopen, kMissing, "rb");
  REQUIRE_FALSE(f.ok());
  check_failure(f.error(), ErrorCode::kSystemError, "fopen", ENOENT);
}

TEST_CASE("GPUQ_NONNULL_CALL: fopen and opendir of what exists return the pointer") {
  const long before = g_allocations.load();
  Result<DIR*> d = GPUQ_NONNULL_CALL(::opendir, "/");
  const long allocated = g_allocations.load() - before;
  REQUIRE(d.ok());
  CHECK(allocated == 0);  // opendir's own buffer comes from malloc, not operator new
  CHECK(::closedir(*d) == 0);
  Result<FILE*> f = GPUQ_NONNULL_CALL(std::fopen, "/dev/null", "rb");
  REQUIRE(f.ok());
  CHECK(std::fclose(*f) == 0);
}

TEST_CASE("GPUQ_MMAP_CALL: mmap of a bad descriptor returns MAP_FAILED, reported as EBADF") {
  Result<void*> p = GPUQ_MMAP_CALL(::mmap, nullptr, 4096, PROT_READ, MAP_SHARED, -1, 0);
  REQUIRE_FALSE(p.ok());
  check_failure(p.error(), ErrorCode::kSystemError, "mmap", EBADF);
}

TEST_CASE("GPUQ_MMAP_CALL: ENOMEM maps to OutOfMemory") {
  // 2^62 bytes: more address space than the process has.
  Result<void*> p = GPUQ_MMAP_CALL(::mmap, nullptr, size_t{1} << 62, PROT_READ,
                                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  REQUIRE_FALSE(p.ok());
  check_failure(p.error(), ErrorCode::kOutOfMemory, "mmap", ENOMEM);
}

TEST_CASE("GPUQ_MMAP_CALL: an anonymous mapping succeeds") {
  const long before = g_allocations.load();
  Result<void*> p = GPUQ_MMAP_CALL(::mmap, nullptr, 4096, PROT_READ | PROT_WRITE,
                                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  const long allocated = g_allocations.load() - before;
  REQUIRE(p.ok());
  CHECK(allocated == 0);
  static_cast<char*>(*p)[0] = 1;
  CHECK(GPUQ_POSIX_CALL(::munmap, *p, 4096).ok());
}

TEST_CASE("GPUQ_DL_CALL: dlopen of a missing library fails with dlerror's text") {
  Result<void*> lib = GPUQ_DL_CALL(::dlopen, "libgpuq-no-such-library.so.9", RTLD_NOW);
  REQUIRE_FALSE(lib.ok());
  INFO(lib.error().message());
  CHECK(lib.error().code() == ErrorCode::kSystemError);
  CHECK(lib.error().message().rfind("dlopen failed: ", 0) == 0);
  CHECK(contains(lib.error().message(), "libgpuq-no-such-library.so.9"));
  CHECK(contains(lib.error().message(), "posix_call_test.cpp:"));
}

TEST_CASE("GPUQ_DL_CALL: dlsym finds a symbol, and names one it cannot find") {
  Result<void*> self = GPUQ_DL_CALL(::dlopen, nullptr, RTLD_NOW);
  REQUIRE(self.ok());
  Result<void*> sym = GPUQ_DL_CALL(::dlsym, *self, "malloc");
  CHECK(sym.ok());
  Result<void*> missing = GPUQ_DL_CALL(::dlsym, *self, "gpuq_no_such_symbol");
  REQUIRE_FALSE(missing.ok());
  INFO(missing.error().message());
  CHECK(missing.error().message().rfind("dlsym failed: ", 0) == 0);
  CHECK(contains(missing.error().message(), "gpuq_no_such_symbol"));
  CHECK(::dlclose(*self) == 0);
}

TEST_CASE("GPUQ_SYSTEM_ERROR and the errno-to-code mapping") {
  errno = EACCES;
  Error e = GPUQ_SYSTEM_ERROR("bind /run/gpuq/gpuq.sock");
  CHECK(e.code() == ErrorCode::kPermissionDenied);
  CHECK(e.message().rfind("bind /run/gpuq/gpuq.sock failed: ", 0) == 0);
  CHECK(errno == EACCES);
  CHECK(detail::error_code_for_errno(EPERM) == ErrorCode::kPermissionDenied);
  CHECK(detail::error_code_for_errno(ENOMEM) == ErrorCode::kOutOfMemory);
  CHECK(detail::error_code_for_errno(EBADF) == ErrorCode::kSystemError);
}

// ---- EINTR ----------------------------------------------------------------------------------

std::atomic<int> g_signals{0};
std::atomic<int> g_reads{0};

void count_signal(int) {
  g_signals.fetch_add(1);
}

// read(2), counting its calls: a retry after EINTR is a second call.
ssize_t counting_read(int fd, void* buf, size_t n) {
  g_reads.fetch_add(1);
  return ::read(fd, buf, n);
}

// The scheduler state of thread `tid` of this process ('S': asleep, as in a blocked read).
char thread_state(pid_t tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string line;
  std::getline(in, line);
  const size_t close_paren = line.rfind(')');
  return close_paren != std::string::npos && close_paren + 2 < line.size() ? line[close_paren + 2]
                                                                           : '?';
}

// Waits (with a deadline) until the reader has made `calls` calls and sleeps in the last one.
bool wait_blocked_in_read(pid_t tid, int calls) {
  const uint64_t deadline = monotonic_ns() + 10'000'000'000ull;
  while (monotonic_ns() < deadline) {
    if (g_reads.load() == calls && thread_state(tid) == 'S') return true;
    std::this_thread::yield();
  }
  return false;
}

TEST_CASE("GPUQ_POSIX_CALL: a read interrupted by a signal (no SA_RESTART) is retried") {
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  UniqueFd read_end(p[0]), write_end(p[1]);
  struct sigaction sa {
  }, old{};
  sa.sa_handler = count_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: the kernel ends the blocked read with EINTR
  REQUIRE(::sigaction(SIGUSR1, &sa, &old) == 0);
  g_signals = 0;
  g_reads = 0;

  const pid_t reader_tid = ::gettid();
  const pthread_t reader = pthread_self();
  std::atomic<bool> helper_ok{true};
  std::thread helper([&] {
    // Interrupt the first read once it sleeps, then feed the second.
    if (!wait_blocked_in_read(reader_tid, 1)) helper_ok = false;
    pthread_kill(reader, SIGUSR1);
    if (!wait_blocked_in_read(reader_tid, 2)) helper_ok = false;
    const char byte = 'x';
    if (::write(write_end.get(), &byte, 1) != 1) helper_ok = false;
  });
  char got = 0;
  Result<long> n = GPUQ_POSIX_CALL(counting_read, read_end.get(), &got, 1);
  helper.join();
  REQUIRE(::sigaction(SIGUSR1, &old, nullptr) == 0);

  CHECK(helper_ok.load());
  REQUIRE(n.ok());
  CHECK(*n == 1);
  CHECK(got == 'x');
  CHECK(g_signals.load() == 1);
  CHECK(g_reads.load() == 2);  // the EINTR, then the read that returned the byte
}

}  // namespace
}  // namespace gpuq
