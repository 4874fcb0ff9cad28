// Integration: the client side of the tensor ops against a real daemon: the Client calls'
// refusals before submitting (a buffer of another client, f16 for a cpu pool), and gpuqctl
// submit with several --input files.
#include <fstream>
#include <iterator>
#include <random>

#include "integration/integration_support.hpp"

namespace gpuq::test {
namespace {

// A scratch directory for gpuqctl's files, removed at the end of the test case.
class ScratchDir {
 public:
  ScratchDir() {
    char dir[] = "/tmp/gpuqt-tensor-XXXXXX";
    REQUIRE(::mkdtemp(dir) != nullptr);
    path_ = dir;
  }
  ~ScratchDir() { run_command("rm -rf '" + path_ + "'"); }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void write_bytes(const std::string& path, const void* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  REQUIRE_MESSAGE(out.good(), "cannot write " << path);
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot read " << path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

CommandResult gpuqctl(const DaemonProcess& daemon, const std::string& args) {
  return run_command(std::string("'") + gpuqctl_path() + "' --runtime-dir '" +
                     daemon.runtime_dir() + "' " + args + " 2>&1");
}

Tensor make_tensor(Client& client, Shape shape, DType dtype = DType::kF32) {
  const Buffer b = allocate(client, shape_bytes(shape, dtype));
  Result<Tensor> t = Tensor::make(b, std::move(shape), dtype);
  REQUIRE_MESSAGE(t.ok(), error_text(t));
  return t.value();
}

}  // namespace

TEST_CASE("gpuqctl submit concatenates several --input files in order") {
  DaemonProcess daemon(one_pool_config(1));
  ScratchDir dir;
  const std::string first = "first file, ";
  const std::string second = "then the second";
  write_bytes(dir.file("a.bin"), first.data(), first.size());
  write_bytes(dir.file("b.bin"), second.data(), second.size());

  const CommandResult run =
      gpuqctl(daemon, "submit echo --input '" + dir.file("a.bin") + "' --input '" +
                          dir.file("b.bin") + "' --output '" + dir.file("out.bin") + "'");

  INFO("gpuqctl: " << run.output);
  REQUIRE(run.exit_code == 0);
  CHECK(read_bytes(dir.file("out.bin")) == first + second);
}

TEST_CASE("gpuqctl submit of a tensor op checks files and shapes before submitting") {
  DaemonProcess daemon(one_pool_config(1));
  ScratchDir dir;
  const std::vector<char> x(1 * 3 * 8 * 8 * 4), w_short(400);
  write_bytes(dir.file("x.bin"), x.data(), x.size());
  write_bytes(dir.file("w.bin"), w_short.data(), w_short.size());
  const std::string inputs =
      "--input '" + dir.file("x.bin") + "' --input '" + dir.file("w.bin") + "' ";

  const CommandResult short_file =
      gpuqctl(daemon, "submit conv2d " + inputs + "--param x=1x3x8x8 --param w=4x3x3x3");
  CHECK(short_file.exit_code == 2);
  CHECK_MESSAGE(short_file.output.find("conv2d: --input '" + dir.file("w.bin") +
                                       "' holds 400 bytes, operand w (4x3x3x3 f32) needs 432") !=
                    std::string::npos,
                short_file.output);

  const CommandResult bad_shape =
      gpuqctl(daemon, "submit conv2d " + inputs + "--param x=1x3x8 --param w=4x3x3x3");
  CHECK(bad_shape.exit_code == 2);
  CHECK_MESSAGE(
      bad_shape.output.find("conv2d: x: is 1x3x8 (3-D), must be 4-D") != std::string::npos,
      bad_shape.output);

  const CommandResult missing =
      gpuqctl(daemon, "submit conv2d --input '" + dir.file("none.bin") + "' --param x=1x3x8x8");
  CHECK(missing.exit_code == 1);
  CHECK_MESSAGE(missing.output.find("cannot open '" + dir.file("none.bin") +
                                    "': No such file or directory") != std::string::npos,
                missing.output);
}

TEST_CASE("Client tensor calls refuse a buffer of another client and f16 on a cpu pool") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  Client other = connect_client(daemon);
  const Tensor x = make_tensor(client, {2, 3});
  const Tensor b = make_tensor(client, {3, 4});
  const Tensor y = make_tensor(client, {2, 4});
  const Tensor foreign = make_tensor(other, {3, 4});

  Result<Job> job = client.gemm(x, foreign, std::nullopt, y);
  REQUIRE_FALSE(job.ok());
  CHECK(job.error().code() == ErrorCode::kInvalidArgument);
  CHECK_MESSAGE(job.error().message().rfind("gemm: b: its buffer (offset ", 0) == 0,
                job.error().message());

  const Tensor x16 = make_tensor(client, {2, 3}, DType::kF16);
  const Tensor b16 = make_tensor(client, {3, 4}, DType::kF16);
  const Tensor y16 = make_tensor(client, {2, 4}, DType::kF16);
  Result<Job> half = client.gemm(x16, b16, std::nullopt, y16);
  REQUIRE_FALSE(half.ok());
  CHECK(half.error().message() ==
        "gemm: dtype: f16 is not supported by pool 'cpu' (kind cpu runs f32 only)");

  // Refusals leave the client usable.
  check_echo_works(client);
}

}  // namespace gpuq::test
