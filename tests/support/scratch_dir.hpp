// ScratchDir: a temporary folder of a test's own, removed with the object, and executable shell
// scripts in it (stand-in interpreters for a Python pool's listing: python_pool_test.cpp,
// op_listing_test.cpp).
#pragma once

#include <doctest/doctest.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace gpuq::test {

struct ScratchDir {
  std::string dir;
  ScratchDir() {
    char pattern[] = "/tmp/gpuq-scratch-XXXXXX";
    REQUIRE(::mkdtemp(pattern) != nullptr);
    dir = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  // An executable shell script `name` with `body`; its path.
  std::string script(const std::string& name, const std::string& body) const {
    std::string path = dir + "/" + name;
    std::ofstream(path) << "#!/bin/sh\n" << body;
    ::chmod(path.c_str(), 0755);
    return path;
  }
};

}  // namespace gpuq::test
