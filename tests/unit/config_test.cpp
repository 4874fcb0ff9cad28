// The config's max_clients (daemon/supervisor/config.hpp, docs/config.md): "auto" and its
// default, 8 per CPU the daemon may use, at least 256, at most kMaxClients - 1 (a JobRef's
// 10-bit client index); a number in [1, 1022]; anything else refused, naming the key. And
// client_weights: users and groups by name or id, weights 1 to 16, each mistake named.
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

TEST_CASE("client_weights: users and groups by name or id, in order; none: every client 1") {
  auto none = parse_config("{}", cpus(2));
  REQUIRE(none.ok());
  CHECK(none->client_weights.empty());
  auto r = parse_config(R"({"client_weights": [{"user": "root", "weight": 4},
                                               {"group": 0, "weight": 2},
                                               {"user": 1234, "weight": 16}]})",
                        cpus(2));
  REQUIRE_MESSAGE(r.ok(), r.error().message());
  REQUIRE(r->client_weights.size() == 3);
  CHECK(r->client_weights[0] == Config::ClientWeight{false, 0, 4});
  CHECK(r->client_weights[1] == Config::ClientWeight{true, 0, 2});
  CHECK(r->client_weights[2] == Config::ClientWeight{false, 1234, 16});
}

TEST_CASE("client_weights: a bad entry names where and what it may be") {
  struct Case {
    const char* json;
    const char* says;
  };
  for (const Case& c : {
           Case{R"({"client_weights": {"root": 2}})", "config: client_weights: must be a list"},
           Case{R"({"client_weights": [3]})", "config: client_weights[0]: must be an object"},
           Case{R"({"client_weights": [{"weight": 2}]})",
                "config: client_weights[0]: must name one \"user\" or one \"group\""},
           Case{R"({"client_weights": [{"user": "root", "group": "root", "weight": 2}]})",
                "config: client_weights[0]: must name one \"user\" or one \"group\""},
           Case{R"({"client_weights": [{"user": "root"}]})",
                "config: client_weights[0].weight: is missing (1 to 16)"},
           Case{R"({"client_weights": [{"user": "root", "weight": 0}]})",
                "config: client_weights[0].weight: must be in [1, 16], got 0"},
           Case{R"({"client_weights": [{"user": "root", "weight": 17}]})",
                "config: client_weights[0].weight: must be in [1, 16], got 17"},
           Case{R"({"client_weights": [{"user": "no-such-user-gpuq", "weight": 2}]})",
                "config: client_weights[0].user: no user named 'no-such-user-gpuq'"},
           Case{R"({"client_weights": [{"group": "root", "weight": 2, "share": 1}]})",
                "config: client_weights[0].share: is not a key of a client weight"},
       }) {
    CAPTURE(c.json);
    auto r = parse_config(c.json, cpus(2));
    REQUIRE_FALSE(r.ok());
    CHECK_MESSAGE(r.error().message().find(c.says) == 0, r.error().message());
  }
}

}  // namespace
}  // namespace gpuq::daemon
