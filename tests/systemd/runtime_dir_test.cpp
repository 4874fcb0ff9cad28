// Unit: where a client looks for the daemon (common/runtime_dir): its own user's daemon first,
// then the system service's directory (/run/gpuq, here a temporary stand-in), and explicit
// choices always win.
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <doctest/doctest.h>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>

#include "gpuq/common/runtime_dir.hpp"

namespace {

// Sets (or unsets, with nullopt) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value->c_str(), 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

struct TempDir {
  std::string path;
  TempDir() {
    char t[] = "/tmp/gpuqr-XXXXXX";
    REQUIRE(::mkdtemp(t) != nullptr);
    path = t;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

// A bound (not listening) Unix socket at `path`: what a daemon leaves in its directory.
void make_socket(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
  REQUIRE(fd >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  ::close(fd);
}

}  // namespace

TEST_CASE("client runtime dir: own daemon, else the system service's, explicit choices first") {
  TempDir user_runtime, system_dir;
  const std::string own = user_runtime.path + "/gpuq";
  ScopedEnv xdg("XDG_RUNTIME_DIR", user_runtime.path);
  ScopedEnv runtime_directory("RUNTIME_DIRECTORY", std::nullopt);
  ScopedEnv gpuq_dir("GPUQ_RUNTIME_DIR", std::nullopt);
  const auto resolve = [&](const std::string& explicit_dir) {
    return gpuq::detail::resolve_client_runtime_dir(explicit_dir, system_dir.path);
  };

  SUBCASE("no daemon of the user's own: the system service's directory") {
    CHECK(resolve("") == system_dir.path);
  }
  SUBCASE("no daemon anywhere: the user's own directory, which the error will name") {
    REQUIRE(::rmdir(system_dir.path.c_str()) == 0);
    CHECK(resolve("") == own);
  }
  SUBCASE("a socket in the user's own directory: that daemon") {
    REQUIRE(::mkdir(own.c_str(), 0700) == 0);
    make_socket(own + "/" + gpuq::kSocketName);
    CHECK(resolve("") == own);
  }
  SUBCASE("the own directory without a socket (a daemon that stopped): the system service's") {
    REQUIRE(::mkdir(own.c_str(), 0700) == 0);
    CHECK(resolve("") == system_dir.path);
  }
  SUBCASE("--runtime-dir and GPUQ_RUNTIME_DIR win") {
    CHECK(resolve("/somewhere") == "/somewhere");
    ScopedEnv set("GPUQ_RUNTIME_DIR", std::string("/elsewhere"));
    CHECK(resolve("") == "/elsewhere");
    CHECK(resolve("/somewhere") == "/somewhere");
  }
  SUBCASE("the public rule uses /run/gpuq") {
    CHECK(std::string(gpuq::kSystemRuntimeDir) == "/run/gpuq");
    ScopedEnv set("GPUQ_RUNTIME_DIR", std::string("/elsewhere"));
    CHECK(gpuq::resolve_client_runtime_dir("") == "/elsewhere");
  }
}
