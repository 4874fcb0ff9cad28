// The config's max_clients (daemon/supervisor/config.hpp, docs/config.md): "auto" and its
// default, 8 per CPU the daemon may use, at least 256, at most kMaxClients - 1 (a JobRef's
// 10-bit client index); a number in [1, 1022]; anything else refused, naming the key.
#include <doctest/doctest.h>

#include <numeric>
#include <string>
#include <vector>

#include "config.hpp"

namespace gpuq::daemon {
namespace {

std::vector<int> cpus(int n) {
  std::vector<int> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

TEST_CASE("default_max_clients: 8 per CPU, at least 256, at most 1022") {
  CHECK(default_max_clients(1) == 256);
  CHECK(default_max_clients(2) == 256);
  CHECK(default_max_clients(32) == 256);
  CHECK(default_max_clients(33) == 264);
  CHECK(default_max_clients(64) == 512);
  CHECK(default_max_clients(127) == 1016);
  CHECK(default_max_clients(128) == kMaxClients - 1);
  CHECK(default_max_clients(4096) == kMaxClients - 1);
}

TEST_CASE("max_clients: absent or \"auto\" is the default of the daemon's CPUs") {
  for (int n : {2, 48, 200}) {
    CAPTURE(n);
    auto absent = parse_config("{}", cpus(n));
    REQUIRE(absent.ok());
    CHECK(absent->max_clients == default_max_clients(static_cast<size_t>(n)));
    auto automatic = parse_config(R"({"max_clients": "auto"})", cpus(n));
    REQUIRE(automatic.ok());
    CHECK(automatic->max_clients == absent->max_clients);
  }
  auto set = parse_config(R"({"max_clients": 1022})", cpus(2));
  REQUIRE(set.ok());
  CHECK(set->max_clients == 1022);
}

TEST_CASE("max_clients: a bad value names the key and what it may be") {
  struct Case {
    const char* json;
    const char* says;
  };
  for (const Case& c :
       {Case{R"({"max_clients": 0})", "config: max_clients: must be in [1, 1022], got 0"},
        Case{R"({"max_clients": 1023})", "config: max_clients: must be in [1, 1022], got 1023"},
        Case{R"({"max_clients": -4})", "config: max_clients: must be in [1, 1022], got -4"},
        Case{R"({"max_clients": "many"})",
             "config: max_clients: must be \"auto\" or an integer in [1, 1022], got \"many\""},
        Case{R"({"max_clients": 2.5})",
             "config: max_clients: must be \"auto\" or an integer in [1, 1022], got 2.5"}}) {
    CAPTURE(c.json);
    auto r = parse_config(c.json, cpus(2));
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().message() == c.says);
  }
}

}  // namespace
}  // namespace gpuq::daemon
