// Writes the seed corpus of the fuzz targets (a few valid inputs each) under ROOT/<target>/:
//   make_seed_corpus ROOT           (re)writes the files
//   make_seed_corpus --check ROOT   fails if a file is missing or differs from what it would write
// The committed corpus is tests/fuzz/corpus; ctest runs the --check form, so a change to a layout
// or a message that makes the seeds stale fails a unit test until they are written again.
// Input formats: tests/fuzz/fuzz_inputs.hpp.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fuzz/fuzz_inputs.hpp"
#include "gpuq/common/clock.hpp"
#include "gpuq/common/messages.hpp"
#include "gpuq/common/params.hpp"
#include "gpuq/common/protocol.hpp"
#include "gpuq/common/shm_layout.hpp"

namespace gpuq::fuzz {
namespace {

using Bytes = std::vector<uint8_t>;

struct Seed {
  std::string target;
  std::string name;
  Bytes bytes;
};

Bytes params_of(const std::vector<Param>& params) {
  ParamWriter w;
  for (const auto& p : params) {
    if (!w.add(p.key, p.value)) {
      std::fprintf(stderr, "make_seed_corpus: bad seed param '%s'\n", p.key.c_str());
      std::exit(1);
    }
  }
  return Bytes(w.data(), w.data() + w.size());
}

// A fuzz_descriptor input: the descriptor, a 4096-byte arena holding `content`, pool 0.
Bytes descriptor_input(uint32_t op_id, uint64_t in_off, uint64_t in_len, uint64_t out_off,
                       uint64_t out_cap, const Bytes& params, std::string_view content) {
  JobDescriptor d;
  std::memset(&d, 0, sizeof d);
  d.op_id = op_id;
  d.input_offset = in_off;
  d.input_bytes = in_len;
  d.output_offset = out_off;
  d.output_capacity = out_cap;
  d.deadline_ns = kNoDeadline;
  d.params_bytes = static_cast<uint32_t>(params.size());
  if (!params.empty()) std::memcpy(d.params, params.data(), params.size());
  Bytes b(kArenaContentAt + content.size());
  std::memcpy(b.data(), &d, sizeof d);
  const uint64_t arena = 4096;
  std::memcpy(b.data() + kArenaWordAt, &arena, sizeof arena);
  b[kPoolAt] = 0;
  if (!content.empty()) std::memcpy(b.data() + kArenaContentAt, content.data(), content.size());
  return b;
}

Bytes frame(MessageType type, std::string_view body) {
  MessageHeader h{kMessageMagic, kProtocolVersion, static_cast<uint16_t>(type),
                  static_cast<uint32_t>(body.size()), 0};
  Bytes b(sizeof h + body.size());
  std::memcpy(b.data(), &h, sizeof h);
  if (!body.empty()) std::memcpy(b.data() + sizeof h, body.data(), body.size());
  return b;
}

std::vector<Seed> seeds() {
  std::vector<Seed> s;
  const std::string text = "the quick brown fox jumps over the lazy dog";
  const Bytes none;
  const Bytes sleep_us = params_of({{"us", int64_t{1000}}});
  const Bytes mixed =
      params_of({{"us", int64_t{5}}, {"scale", 1.5}, {"name", std::string("seed")}});

  s.push_back({"fuzz_descriptor", "noop", descriptor_input(1, 0, 0, 0, 0, none, "")});
  s.push_back({"fuzz_descriptor", "echo", descriptor_input(2, 0, 43, 1024, 64, none, text)});
  s.push_back({"fuzz_descriptor", "sleep", descriptor_input(3, 0, 0, 0, 0, sleep_us, "")});
  s.push_back({"fuzz_descriptor", "checksum", descriptor_input(4, 0, 43, 2048, 4, mixed, text)});
  // Tensor ops (parsed, not run): a 1x1x4x4 by 1x1x3x3 convolution, 100 input bytes; a 2x3 by
  // 3x2 gemm with beta and c, 64 input bytes; each result 16 bytes at arena offset 1024.
  const Bytes conv = params_of({{"x", std::string("1x1x4x4")},
                                {"w", std::string("1x1x3x3")},
                                {"pad", std::string("0x0")},
                                {"relu", int64_t{1}}});
  s.push_back({"fuzz_descriptor", "conv2d", descriptor_input(5, 0, 100, 1024, 16, conv, "")});
  const Bytes gemm = params_of({{"a", std::string("2x3")},
                                {"b", std::string("3x2")},
                                {"beta", 0.5},
                                {"c", std::string("2x2")},
                                {"trans_b", int64_t{0}}});
  s.push_back({"fuzz_descriptor", "gemm", descriptor_input(10, 0, 64, 1024, 16, gemm, "")});

  s.push_back({"fuzz_params", "int", sleep_us});
  s.push_back({"fuzz_params", "mixed", mixed});

  const auto g = ClientSegmentGeometry::compute(8, 65536);
  const std::string geometry =
      "\"slot_count\":8,\"slots_offset\":" + std::to_string(g.slots_offset) +
      ",\"arena_offset\":" + std::to_string(g.arena_offset) +
      ",\"arena_bytes\":" + std::to_string(g.arena_bytes) +
      ",\"segment_bytes\":" + std::to_string(g.segment_bytes);
  s.push_back({"fuzz_protocol", "hello",
               frame(MessageType::kHello, R"({"pid":1234,"name":"seed","arena_bytes":65536})")});
  s.push_back({"fuzz_protocol", "status_request", frame(MessageType::kStatusRequest, "{}")});
  s.push_back({"fuzz_protocol", "error",
               frame(MessageType::kError,
                     error_body(Error(ErrorCode::kQueueFull, "pool 'cpu' ring is full")))});
  s.push_back({"fuzz_protocol", "map_client",
               frame(MessageType::kMapClient, "{\"client\":3,\"session\":7," + geometry + "}")});
  s.push_back({"fuzz_protocol", "unmap_client",
               frame(MessageType::kUnmapClient, R"({"client":3,"session":7})")});
  // Welcome, WorkerReady and StopReply as their encoders write them (gpuq/common/messages.hpp).
  WelcomeMessage welcome;
  welcome.client = 3;
  welcome.session = 7;
  welcome.slot_count = 8;
  welcome.geometry = g;
  welcome.epoch = 0x5eed;
  welcome.queue_segment = "/gpuq-queue-seed";
  welcome.daemon_version = "0.1.0";
  welcome.job_clock = StampClock::kTsc;
  welcome.tsc_ns_per_tick = 0.5;
  welcome.pools = {{"cpu", 0, "cpu", 40, 10, true, "", -1},
                   {"gpu", 1, "gpu", 20, 5, false, "no GPU found", 0}};
  welcome.ops = {{"noop", 1}, {"echo", 2}, {"saxpy", 2000}};
  s.push_back({"fuzz_protocol", "welcome", frame(WelcomeMessage::kType, encode(welcome))});
  const CatalogReplyMessage catalog{4, welcome.pools, welcome.ops};
  s.push_back(
      {"fuzz_protocol", "catalog_reply", frame(CatalogReplyMessage::kType, encode(catalog))});
  const WorkerReadyMessage ready{2, R"({"device":"GPU-0"})", R"([[2000,"saxpy"]])"};
  s.push_back({"fuzz_protocol", "worker_ready", frame(WorkerReadyMessage::kType, encode(ready))});
  s.push_back(
      {"fuzz_protocol", "stop_reply", frame(StopReplyMessage::kType, encode(StopReplyMessage{}))});
  return s;
}

Bytes read_file(const std::filesystem::path& p, bool* ok) {
  std::ifstream in(p, std::ios::binary);
  *ok = static_cast<bool>(in);
  return Bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace
}  // namespace gpuq::fuzz

int main(int argc, char** argv) {
  using namespace gpuq::fuzz;
  const bool check = argc == 3 && std::string_view(argv[1]) == "--check";
  if (argc != 2 && !check) {
    std::fprintf(stderr, "usage: make_seed_corpus [--check] ROOT\n");
    return 2;
  }
  const std::filesystem::path root(argv[argc - 1]);
  int stale = 0;
  for (const Seed& seed : seeds()) {
    const auto path = root / seed.target / seed.name;
    if (check) {
      bool ok = false;
      if (read_file(path, &ok) != seed.bytes || !ok) {
        std::fprintf(stderr, "make_seed_corpus: %s is missing or stale\n", path.c_str());
        ++stale;
      }
      continue;
    }
    std::filesystem::create_directories(path.parent_path());
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(seed.bytes.data()),
              static_cast<std::streamsize>(seed.bytes.size()));
    if (!out) {
      std::fprintf(stderr, "make_seed_corpus: cannot write %s\n", path.c_str());
      return 1;
    }
    std::printf("wrote %s (%zu bytes)\n", path.c_str(), seed.bytes.size());
  }
  if (stale != 0) {
    std::fprintf(stderr,
                 "make_seed_corpus: %d seed files are stale; rewrite them with\n"
                 "  <build>/tests/fuzz/make_seed_corpus tests/fuzz/corpus\n",
                 stale);
    return 1;
  }
  if (check) std::printf("make_seed_corpus: every seed file is current\n");
  return 0;
}
