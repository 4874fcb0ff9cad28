// gpuq_consumer: a client built outside the gpuq tree, against an installed gpuq (CMake's
// find_package(gpuq) or pkg-config; see CMakeLists.txt and Makefile here). It connects to the
// daemon, runs --jobs echo jobs with random payloads, checks every output byte, and prints the
// daemon's version and the count. Exit status 0 only if every job came back intact.
//
//   gpuq_consumer [--runtime-dir DIR] [--jobs N]
//
// Without --runtime-dir the library finds the daemon itself: $GPUQ_RUNTIME_DIR, else the
// user's own daemon, else the system service's /run/gpuq (docs/service.md).
#include <gpuq/client.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <string_view>

int main(int argc, char** argv) {
  gpuq::ConnectOptions options;
  options.name = "gpuq_consumer";
  long jobs = 1000;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    if (a == "--runtime-dir" && i + 1 < argc) {
      options.runtime_dir = argv[++i];
    } else if (a == "--jobs" && i + 1 < argc) {
      char* end = nullptr;
      jobs = std::strtol(argv[++i], &end, 10);
      if (*end != '\0' || jobs <= 0) {
        std::fprintf(stderr, "gpuq_consumer: --jobs needs a positive integer\n");
        return 2;
      }
    } else {
      std::fprintf(stderr, "usage: gpuq_consumer [--runtime-dir DIR] [--jobs N]\n");
      return 2;
    }
  }

  auto client = gpuq::Client::connect(options);
  if (!client) {
    std::fprintf(stderr, "gpuq_consumer: connect: %s\n", client.error().to_string().c_str());
    return 1;
  }
  constexpr uint64_t kMaxBytes = 4096;
  auto in = client->allocate(kMaxBytes);
  auto out = client->allocate(kMaxBytes);
  if (!in || !out) {
    std::fprintf(stderr, "gpuq_consumer: allocate: %s\n",
                 (!in ? in.error() : out.error()).to_string().c_str());
    return 1;
  }
  std::mt19937 rng(12345);
  for (long n = 0; n < jobs; ++n) {
    const uint64_t size = 1 + rng() % kMaxBytes;
    for (uint64_t b = 0; b < size; ++b) in->data()[b] = static_cast<std::byte>(rng());
    std::memset(out->data(), 0, kMaxBytes);
    gpuq::JobSpec spec;
    spec.op = "echo";
    spec.input = in->slice(0, size);
    spec.output = out->slice(0, size);
    auto job = client->submit(spec, std::chrono::seconds(10));
    if (!job) {
      std::fprintf(stderr, "gpuq_consumer: submit: %s\n", job.error().to_string().c_str());
      return 1;
    }
    auto result = job->wait(std::chrono::seconds(10));
    if (!result || !result->ok()) {
      std::fprintf(stderr, "gpuq_consumer: job %ld: %s\n", n,
                   !result ? result.error().to_string().c_str() : result->message.c_str());
      return 1;
    }
    if (result->output_size != size || std::memcmp(in->data(), out->data(), size) != 0) {
      std::fprintf(stderr, "gpuq_consumer: job %ld: the echo output differs from its input\n", n);
      return 1;
    }
  }
  std::printf("gpuq_consumer: %ld echo jobs ok (libgpuq %s)\n", jobs,
              std::string(gpuq::version()).c_str());
  return 0;
}
