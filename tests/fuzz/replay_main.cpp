// The replay driver: a main() for a fuzz target built without libFuzzer (GPUQ_FUZZ=OFF). It runs
// LLVMFuzzerTestOneInput once on every file named on the command line, and on every file of every
// directory named there (not recursive; names starting with '.' are skipped, so an empty
// directory can hold a .gitkeep). ctest runs it over the seed corpus and the regression inputs of
// each target, so every input that once crashed a target runs again in every build, sanitizer
// builds included.
//
// Exit status: 0 when every input ran; 1 when a path cannot be read or no input was found (a
// crash inside the target aborts the process instead, with the sanitizer's or assert's report).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);  // NOLINT

namespace {

bool replay_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "replay: cannot read %s\n", path.c_str());
    return false;
  }
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  // A copy of exactly the input's size on the heap, so ASan sees a read past its end.
  std::vector<uint8_t> input(bytes.begin(), bytes.end());
  std::fprintf(stderr, "replay: %s (%zu bytes)\n", path.c_str(), input.size());
  LLVMFuzzerTestOneInput(input.data(), input.size());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  size_t replayed = 0;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path arg(argv[i]);
    std::error_code ec;
    if (std::filesystem::is_directory(arg, ec)) {
      std::vector<std::filesystem::path> files;
      for (const auto& e : std::filesystem::directory_iterator(arg, ec)) {
        if (e.is_regular_file() && e.path().filename().string().front() != '.') {
          files.push_back(e.path());
        }
      }
      if (ec) {
        std::fprintf(stderr, "replay: cannot list %s: %s\n", argv[i], ec.message().c_str());
        return 1;
      }
      std::sort(files.begin(), files.end());
      for (const auto& f : files) {
        if (!replay_file(f)) return 1;
        ++replayed;
      }
    } else {
      if (!replay_file(arg)) return 1;
      ++replayed;
    }
  }
  if (replayed == 0) {
    std::fprintf(stderr, "replay: no input found in the %d paths given\n", argc - 1);
    return 1;
  }
  std::printf("replay: %zu inputs ran without a finding\n", replayed);
  return 0;
}
