#!/usr/bin/env bash
# Installs every Debian package that gpuq's build, tests and tools need. Idempotent: when all
# packages are present it only runs dpkg-query (well under a second) and touches nothing.
#
#   bash scripts/setup.sh        # install what is missing
#   source scripts/setup.sh      # the same, and also put /usr/local/cuda/bin on this shell's PATH
#
# Runs apt-get directly as root, through sudo otherwise. `apt-get update` runs only when a
# package is missing. CUDA is never installed here: when it is present at /usr/local/cuda the
# build finds it (GPUQ_WITH_CUDA=AUTO), and a sourcing shell gets its bin/ on PATH.
#
# Environment: GPUQ_SETUP_EXTRA="pkg ..." adds packages (e.g. gdb) to the list.

# The package list: one place, one reason each.
gpuq_setup_packages=(
  cmake                # build system (3.22 or newer)
  g++                  # the default compiler; also provides libasan/libubsan/libtsan
  make                 # CMake's fallback generator
  ninja-build          # faster generator, used when present
  pkg-config           # dependency lookup (libsystemd)
  libboost-dev         # Boost.Interprocess, header-only (1.74 on Debian 12)
  nlohmann-json3-dev   # config and control-protocol JSON
  doctest-dev          # unit and integration tests
  libsystemd-dev       # sd_notify for the Type=notify unit
  libdnnl-dev          # oneDNN 2.x: the tensor ops on CPU pools (GPUQ_WITH_ONEDNN)
  ocl-icd-opencl-dev   # OpenCL headers and libOpenCL.so: Debian's oneDNN is built with an OpenCL
                       # GPU runtime, and its CMake package (dnnl-config.cmake) requires them;
                       # libdnnl-dev only Recommends it, and we install without recommends
  systemd              # systemd-analyze (unit tests), systemd-sysusers (package postinst)
  dpkg-dev             # dpkg-shlibdeps: the .deb's dependencies (cpack, stage package)
  file                 # CPack's DEB generator finds the ELF files with it
  clang                # second compiler, sanitizers and fuzzers
  clang-format         # scripts/test.sh format stage
  clang-tidy           # scripts/test.sh tidy stage (scripts/tidy.py, .clang-tidy)
  libclang-rt-14-dev   # clang's sanitizer and libFuzzer runtimes
  python3              # test helpers, scripts/test.sh result summary
  python3-venv         # the Python client's venvs (scripts/demo.sh, test.sh stage python)
  python3-dev          # Python.h for the Python client's native module (pip install ./python)
  libpython3.11-testsuite  # CPython's own test_concurrent_futures.py, run against gpuq.Executor
                       # (tests/compat, stage python); 3.11 is Debian 12's python3
  git                  # scripts/test.sh lists the tracked sources with git ls-files
  mmdebstrap           # scripts/test.sh fresh stage: a clean Debian 12 root (scripts/fresh.sh)
)

gpuq_setup_install() (
  set -euo pipefail
  local -a wanted=("${gpuq_setup_packages[@]}")
  if [[ -n "${GPUQ_SETUP_EXTRA:-}" ]]; then
    read -r -a extra <<<"${GPUQ_SETUP_EXTRA}"
    wanted+=("${extra[@]}")
  fi

  local -a missing=()
  local pkg status
  for pkg in "${wanted[@]}"; do
    status=$(dpkg-query -W -f='${db:Status-Status}' "${pkg}" 2>/dev/null || true)
    [[ "${status}" == "installed" ]] || missing+=("${pkg}")
  done
  if ((${#missing[@]} == 0)); then
    echo "setup: all ${#wanted[@]} packages present"
    return 0
  fi

  local -a as_root=()
  if ((EUID != 0)); then
    if ! command -v sudo >/dev/null 2>&1; then
      echo "setup: missing packages: ${missing[*]}" >&2
      echo "setup: not root and no sudo; install them as root: apt-get install ${missing[*]}" >&2
      return 1
    fi
    as_root=(sudo)
  fi

  echo "setup: installing ${missing[*]}"
  local -a apt=("${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get
    -o DPkg::Lock::Timeout=300 -o Dpkg::Use-Pty=0)
  "${apt[@]}" update -qq
  "${apt[@]}" install -y -qq --no-install-recommends "${missing[@]}"

  # Verify: an apt-get that "succeeds" without installing (a held package...) must not pass.
  local -a still=()
  for pkg in "${missing[@]}"; do
    status=$(dpkg-query -W -f='${db:Status-Status}' "${pkg}" 2>/dev/null || true)
    [[ "${status}" == "installed" ]] || still+=("${pkg}")
  done
  if ((${#still[@]} != 0)); then
    echo "setup: still missing after apt-get: ${still[*]}" >&2
    return 1
  fi
  echo "setup: installed ${#missing[@]} packages"
)

gpuq_setup_path() {
  if [[ -d /usr/local/cuda/bin && ":${PATH}:" != *":/usr/local/cuda/bin:"* ]]; then
    export PATH="/usr/local/cuda/bin:${PATH}"
  fi
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
  # Sourced: install (in a subshell, so its shell options stay there), then fix this PATH.
  gpuq_setup_install || return 1
  gpuq_setup_path
else
  set -euo pipefail
  gpuq_setup_install
  gpuq_setup_path
  if [[ -d /usr/local/cuda/bin ]]; then
    echo "setup: CUDA found at /usr/local/cuda (source this script to put its bin/ on PATH)"
  fi
fi
