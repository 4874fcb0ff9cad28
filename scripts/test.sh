#!/usr/bin/env bash
# gpuq's one test command (README, CI): installs what is missing, then runs the stages below in
# order and stops at the first failure with a non-zero exit status.
#
#   format  clang-format --dry-run -Werror over every tracked (or new, not ignored) C++/CUDA file
#   fresh   the README's run command on a clean Debian 12 root (scripts/fresh.sh): mmdebstrap
#           root (base tarball cached outside the tree), a clean clone of HEAD, then inside it
#           `bash scripts/setup.sh` and `bash scripts/demo.sh`, whose output must hold no warning,
#           and `bash scripts/build_wheel.sh`, whose wheel then runs in a second root that has
#           only python3 and python3-venv; needs root (skipped otherwise)
#   build   RelWithDebInfo build with -Werror and oneDNN (GPUQ_WITH_ONEDNN=ON) in build/, ctest
#           for every label (tests labelled `gpu` report Skipped on a machine without a GPU)
#   tidy    the clang-tidy ratchet (scripts/tidy.py): clang-tidy with the root .clang-tidy on the
#           files listed in scripts/tidy-clean.txt, from build/'s compile_commands.json (configured
#           here if the build stage did not run; nothing is compiled); any finding in a listed
#           file fails the stage. docs/testing.md
#   package install build/ into a temporary prefix and build and run examples/consumer against it
#           (CMake and pkg-config); build the .deb (cpack), dpkg -i it, run the installed
#           daemon, dpkg -r and -P it (as root; skipped otherwise); the gpuq-gpu .deb's contents,
#           and its binaries' libraries found with the loader's cache ignored (a build with
#           CUDA). tests/package/, docs/service.md
#   python  the Python client: a venv in build-python/venv (the system python3 -m venv),
#           `pip install ./python[test]` into it (pip's own isolated build, nanobind and
#           scikit-build-core from PyPI), then pytest python/tests against the daemon of build/
#           (gpuqd and gpuq-worker built here if the build stage did not run); the tests also run
#           every script of examples/python. Then the peers' own suites on gpuq's drop-ins
#           (tests/compat/run.py: joblib's test_parallel.py, CPython's
#           test_concurrent_futures.py; tests/compat/requirements.txt). Before the tests, ruff
#           check and ruff format --check on python/gpuq (python/lint-requirements.txt, pinned).
#           docs/python.md
#   tf      TensorFlow in Python pools: a venv of its own outside the tree (GPUQ_TF_VENV) with
#           the pinned tests/tf/requirements.txt (tensorflow-cpu from PyPI, about 1.4 GB
#           installed), made again only when that file or the interpreter changes (a hash in the
#           venv); ./python in it (pip, without build isolation: its CMake tree kept in
#           build-python/tf-cmake), redone only when its sources change; then pytest
#           python/tests/test_tensorflow.py
#           against the daemon of build/, which also runs the TensorFlow pattern examples
#           (examples/python/patterns/tf_*.py). docs/testing.md
#   web     web apps in front of gpuq (docs/web.md): a venv in build-web/venv with
#           tests/web/requirements.txt (Flask, gunicorn, FastAPI, uvicorn, httpx, pinned) and
#           ./python (pip, without build isolation: its CMake tree kept in build-web/cmake), each
#           redone only when a hash of its inputs changes (stamps in the venv); then pytest
#           tests/web against the daemon of build/: examples/web's Flask app under gunicorn
#           --preload and its FastAPI app under uvicorn, 8 workers each, 32 concurrent clients
#   scaleout  gpuq under Ray and Dask, one gpuqd per node (docs/scale-out.md): a venv in
#           build-scaleout/venv with tests/scaleout/requirements.txt (Ray, Dask, joblib,
#           kubernetes-validate from PyPI) and ./python[test], then pytest tests/scaleout in
#           network and PID namespaces of its own (tests/scaleout/netns.sh): two gpuqd of build/
#           standing in for two nodes, a two-node Ray cluster and a two-worker Dask cluster whose
#           node N reaches daemon N, one daemon killed mid-run; packaging/kubernetes validated
#   asan    ASan+UBSan build in build-asan/, ctest labels unit|stress|integration
#   tsan    TSan build in build-tsan/, ctest labels unit|stress|integration
#   fuzz    clang libFuzzer build (ASan+UBSan) in build-fuzz/; runs each fuzz target of tests/fuzz
#           for GPUQ_FUZZ_SECONDS on a copy of its seed corpus and regression inputs (in
#           build-fuzz/fuzz-corpus/); any crash, leak or timeout fails the stage
#   tidy-all  (not run by default) clang-tidy over every C++ file of build/, a report: it fails
#           only on a file clang cannot parse, and lists clean files not yet in the ratchet
#
# The cheap format check runs first so a formatting slip fails in seconds, not after the builds;
# then `fresh`, so that a set-up step missing from scripts/setup.sh (a package installed by hand
# on the machine that runs CI) fails before this machine's own builds can hide it.
#
# Environment:
#   GPUQ_TEST_STAGES   stages to run, in this order (default "format fresh build tidy package
#                      python tf web scaleout asan tsan fuzz");
#                      "sanitize" stands for "asan tsan", "all" for the default list
#   GPUQ_BUILD_JOBS    parallel compile jobs (default: nproc)
#   GPUQ_CTEST_JOBS    parallel tests (default: nproc)
#   GPUQ_CTEST_TIMEOUT per-test limit in seconds for tests that set none (default 900)
#   GPUQ_CTEST_ARGS    extra ctest arguments for every stage, e.g. "-R ring"
#   GPUQ_FUZZ_SECONDS  how long the fuzz stage runs each fuzz target (default 60)
#   GPUQ_PYTHON        the interpreter the python stage makes its venv with (default
#                      /usr/bin/python3, else python3 on PATH)
#   GPUQ_PYTEST_ARGS   extra pytest arguments for the python stage, e.g. "-k fork"
#   GPUQ_TF_VENV       the tf stage's venv (default ${XDG_CACHE_HOME:-~/.cache}/gpuq-tf/venv)
#   GPUQ_FRESH_*       the fresh stage's settings (scripts/fresh.sh's header)
#   CXX / CC           compilers, as CMake reads them (a build dir keeps its first choice)
#   ASAN_OPTIONS, UBSAN_OPTIONS, TSAN_OPTIONS  appended to this script's defaults (later wins)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly ROOT="${PWD}"

# shellcheck source=scripts/setup.sh
source scripts/setup.sh

readonly BUILD_JOBS="${GPUQ_BUILD_JOBS:-$(nproc)}"
readonly CTEST_JOBS="${GPUQ_CTEST_JOBS:-$(nproc)}"
readonly CTEST_TIMEOUT="${GPUQ_CTEST_TIMEOUT:-900}"
readonly SANITIZER_LABELS='^(unit|stress|integration)$'
readonly DEFAULT_STAGES=(format fresh build tidy package python tf web scaleout asan tsan fuzz)

# ---- stage selection ---------------------------------------------------------------------------
stages=()
for s in ${GPUQ_TEST_STAGES:-${DEFAULT_STAGES[*]}}; do
  case "${s}" in
    all) stages+=("${DEFAULT_STAGES[@]}") ;;
    sanitize) stages+=(asan tsan) ;;
    format | fresh | build | tidy | package | python | tf | web | scaleout | asan | tsan | fuzz | tidy-all)
      stages+=("${s}")
      ;;
    *)
      echo "test.sh: unknown stage '${s}' (known: format fresh build tidy package python tf web scaleout asan tsan fuzz tidy-all sanitize all)" >&2
      exit 2
      ;;
  esac
done

# ---- reporting ---------------------------------------------------------------------------------
summary=()        # one line per finished stage
current_stage=""  # the stage running now (named in the summary if it fails)
stage_start=0
tests_passed=0
tests_failed=0
tests_skipped=0
stage_counts=""   # "(N passed, N failed, N skipped)" of the last ctest run

banner() {
  local line="================================================================================"
  printf '\n%s\n== %s\n%s\n' "${line}" "$*" "${line}"
}

finish() {
  local rc=$?
  trap - EXIT
  banner "summary"
  local l
  for l in "${summary[@]}"; do echo "  ${l}"; done
  if [[ -n "${current_stage}" ]]; then
    printf '  %-7s FAILED after %ds %s\n' "${current_stage}" $((SECONDS - stage_start)) \
      "${stage_counts}"
    ((rc != 0)) || rc=1
  fi
  if ((rc == 0)); then
    echo "test.sh: all stages passed (${stages[*]})"
  else
    echo "test.sh: FAILED (exit ${rc})${current_stage:+ in stage ${current_stage}}"
  fi
  # The closing line: test counts over every ctest run of this invocation.
  echo "tests: ${tests_passed} passed, ${tests_failed} failed, ${tests_skipped} skipped"
  exit "${rc}"
}
trap finish EXIT

# ---- helpers -----------------------------------------------------------------------------------

# configure DIR BUILD_TYPE [cmake args...]: (re)configures DIR. A new DIR uses Ninja when it is
# installed; an existing one keeps the generator it was made with.
configure() {
  local dir="$1" type="$2"
  shift 2
  local -a gen=()
  if [[ ! -f "${dir}/CMakeCache.txt" ]] && command -v ninja >/dev/null 2>&1; then
    gen=(-G Ninja)
  fi
  cmake -S "${ROOT}" -B "${dir}" "${gen[@]}" -DCMAKE_BUILD_TYPE="${type}" "$@"
}

build() {
  cmake --build "$1" -j "${BUILD_JOBS}"
}

# run_ctest DIR LABEL_REGEX [command prefix...]: runs the tests of DIR (all of them when the regex
# is empty), adds their counts to the totals. An empty selection is an error: a test stage that
# ran no test must not pass.
run_ctest() {
  local dir="$1" labels="$2"
  shift 2
  local junit="${ROOT}/${dir}/ctest-junit.xml"
  rm -f "${junit}"
  local -a args=(--test-dir "${ROOT}/${dir}" --output-on-failure --no-tests=error
    -j "${CTEST_JOBS}" --timeout "${CTEST_TIMEOUT}" --output-junit "${junit}")
  [[ -z "${labels}" ]] || args+=(-L "${labels}")
  local -a extra=()
  [[ -z "${GPUQ_CTEST_ARGS:-}" ]] || read -r -a extra <<<"${GPUQ_CTEST_ARGS}"
  local rc=0
  "$@" ctest "${args[@]}" "${extra[@]}" || rc=$?
  count_results "${junit}"
  return "${rc}"
}

# Adds the counts of a ctest JUnit file to the totals and sets stage_counts.
count_results() {
  stage_counts=""
  [[ -f "$1" ]] || return 0
  local counts
  counts=$(python3 - "$1" <<'EOF'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
# ctest's root is the <testsuite>; pytest's is <testsuites> around one or more of them.
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
n = lambda k: sum(int(s.get(k, "0") or 0) for s in suites)
skipped = n("skipped") + n("disabled")
failed = n("failures") + n("errors")
print(n("tests") - failed - skipped, failed, skipped)
EOF
  ) || return 0
  local p f k
  read -r p f k <<<"${counts}"
  tests_passed=$((tests_passed + p))
  tests_failed=$((tests_failed + f))
  tests_skipped=$((tests_skipped + k))
  stage_counts="(${p} passed, ${f} failed, ${k} skipped)"
}

# sanitizer_prefix FLAGS: compiles and runs a tiny threaded program with -fsanitize=FLAGS and
# sets `run_prefix` to what the tests must run under. Some kernels map memory where the
# sanitizer runtimes cannot work with full ASLR ("FATAL: ThreadSanitizer: unexpected memory
# mapping"); then the tests run under `setarch -R` (ASLR off for that process tree).
run_prefix=()
sanitizer_prefix() {
  local flags="$1" dir
  dir=$(mktemp -d)
  cat >"${dir}/probe.cpp" <<'EOF'
#include <atomic>
#include <mutex>
#include <thread>
int main() {
  std::mutex m;
  std::atomic<int> n{0};
  int x = 0;
  std::thread t([&] { std::lock_guard<std::mutex> g(m); ++x; n.fetch_add(1); });
  { std::lock_guard<std::mutex> g(m); ++x; }
  t.join();
  return (x == 2 && n.load() == 1) ? 0 : 1;
}
EOF
  local cxx="${CXX:-c++}"
  if ! "${cxx}" -std=c++20 -fsanitize="${flags}" -pthread -o "${dir}/probe" "${dir}/probe.cpp"; then
    echo "test.sh: ${cxx} cannot build a -fsanitize=${flags} program (runtime missing?)" >&2
    rm -rf "${dir}"
    return 1
  fi
  run_prefix=()
  if "${dir}/probe" >"${dir}/out" 2>&1; then
    echo "test.sh: -fsanitize=${flags} probe runs as is"
  elif setarch "$(uname -m)" -R "${dir}/probe" >"${dir}/out2" 2>&1; then
    echo "test.sh: -fsanitize=${flags} probe fails with ASLR on; tests run under setarch -R:"
    sed 's/^/  | /' "${dir}/out" | head -5
    run_prefix=(setarch "$(uname -m)" -R)
  else
    echo "test.sh: a trivial -fsanitize=${flags} program fails even under setarch -R:" >&2
    sed 's/^/  | /' "${dir}/out2" >&2
    echo "test.sh: on such kernels 'sysctl vm.mmap_rnd_bits=28' (as root) may help" >&2
    rm -rf "${dir}"
    return 1
  fi
  rm -rf "${dir}"
}

# Sanitizer builds leave out CUDA, benchmarks and examples: they test the host code. No -Werror
# there: GCC's -Wtsan warns that TSan does not model std::atomic_thread_fence (EventCount's
# Dekker fence), which is worth seeing but not a build failure.
# The build stage's configuration of build/, which package and tidy reuse. CMakeLists.txt turns
# on CMAKE_EXPORT_COMPILE_COMMANDS, so build/compile_commands.json is there for tidy.
readonly BUILD_CMAKE_ARGS=(-DGPUQ_WERROR=ON -DGPUQ_SANITIZE= -DGPUQ_BUILD_TESTS=ON
  -DGPUQ_BUILD_BENCH=ON -DGPUQ_BUILD_EXAMPLES=ON -DGPUQ_WITH_ONEDNN=ON)

readonly SANITIZER_CMAKE_ARGS=(-DGPUQ_WITH_CUDA=OFF -DGPUQ_BUILD_BENCH=OFF
  -DGPUQ_BUILD_EXAMPLES=OFF -DGPUQ_BUILD_TESTS=ON -DGPUQ_WERROR=OFF)

# ---- stages ------------------------------------------------------------------------------------

stage_format() {
  command -v clang-format >/dev/null || { echo "clang-format not found" >&2; return 1; }
  clang-format --version
  local -a files=()
  if git -C "${ROOT}" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    local f
    while IFS= read -r -d '' f; do
      [[ -f "${f}" ]] && files+=("${f}")  # skip tracked files deleted in the work tree
    done < <(git -C "${ROOT}" ls-files -z --cached --others --exclude-standard -- \
      '*.cpp' '*.hpp' '*.h' '*.cu' | sort -zu)
  else
    echo "not a git checkout: checking every source file outside build*/"
    mapfile -d '' files < <(find . -path './build*' -prune -o -type f \
      \( -name '*.cpp' -o -name '*.hpp' -o -name '*.h' -o -name '*.cu' \) -print0 | sort -z)
  fi
  echo "checking ${#files[@]} files"
  ((${#files[@]} > 0)) || return 0
  if ! printf '%s\0' "${files[@]}" | xargs -0 -n 50 clang-format --dry-run -Werror; then
    echo "test.sh: files above are not formatted; fix with:" >&2
    echo "  git ls-files -z '*.cpp' '*.hpp' '*.h' '*.cu' | xargs -0 clang-format -i" >&2
    return 1
  fi
}

# scripts/fresh.sh: one test, counted as skipped when it exits 77 (not root, no namespaces).
stage_fresh() {
  local rc=0
  bash scripts/fresh.sh || rc=$?
  case "${rc}" in
    0) tests_passed=$((tests_passed + 1)) stage_counts="(1 passed, 0 failed, 0 skipped)" ;;
    77) tests_skipped=$((tests_skipped + 1)) stage_counts="(0 passed, 0 failed, 1 skipped)" ;;
    *)
      tests_failed=$((tests_failed + 1))
      stage_counts="(0 passed, 1 failed, 0 skipped)"
      return 1
      ;;
  esac
}

stage_build() {
  configure build RelWithDebInfo "${BUILD_CMAKE_ARGS[@]}"
  build build
  run_ctest build ""
}

# Install and package, from build/ (the build stage's tree; configured and built here if that
# stage did not run): tests/package/install_test.sh, deb_test.sh and gpu_deb_test.sh (the
# gpuq-gpu package; its run on a GPU where there is one). Each cleans up after itself;
# deb_test.sh purges a gpuq package an earlier run left installed, and exits 77 (counted as
# skipped) when not run as root; gpu_deb_test.sh exits 77 in a build without CUDA.
stage_package() {
  [[ -f build/CMakeCache.txt ]] || configure build RelWithDebInfo "${BUILD_CMAKE_ARGS[@]}"
  build build
  local t rc passed=0 skipped=0
  for t in install_test deb_test gpu_deb_test; do
    rc=0
    GPUQ_BUILD_JOBS="${BUILD_JOBS}" bash "tests/package/${t}.sh" build || rc=$?
    if ((rc == 77)); then
      skipped=$((skipped + 1))
    elif ((rc != 0)); then
      stage_counts="(${passed} passed, 1 failed, ${skipped} skipped)"
      tests_passed=$((tests_passed + passed))
      tests_failed=$((tests_failed + 1))
      tests_skipped=$((tests_skipped + skipped))
      echo "test.sh: tests/package/${t}.sh failed (exit ${rc})" >&2
      return 1
    else
      passed=$((passed + 1))
    fi
  done
  tests_passed=$((tests_passed + passed))
  tests_skipped=$((tests_skipped + skipped))
  stage_counts="(${passed} passed, 0 failed, ${skipped} skipped)"
}

# The interpreter the Python stages make their venvs with: GPUQ_PYTHON, else /usr/bin/python3,
# else python3 on PATH.
python_interpreter() {
  if [[ -n "${GPUQ_PYTHON:-}" ]]; then
    echo "${GPUQ_PYTHON}"
  elif [[ -x /usr/bin/python3 ]]; then
    echo /usr/bin/python3
  else
    echo python3
  fi
}

# kept_venv LABEL VENV PY REQUIREMENTS: a venv of PY with the pinned REQUIREMENTS, kept between
# runs and made again only when the interpreter or that file changes (a hash of both in
# VENV/venv.stamp).
kept_venv() {
  local label=$1 venv=$2 py=$3 requirements=$4 hash t0=${SECONDS}
  local -a pip=("${venv}/bin/python" -m pip --disable-pip-version-check)
  hash=$({
    "${py}" -VV
    readlink -f "$(command -v "${py}")"
    cat "${requirements}"
  } | sha256sum | cut -d' ' -f1)
  if [[ -x "${venv}/bin/python" && "$(cat "${venv}/venv.stamp" 2>/dev/null)" == "${hash}" ]]; then
    echo "${label}: ${venv} is up to date (the interpreter and ${requirements#"${ROOT}/"} unchanged)"
    return 0
  fi
  rm -rf "${venv}"
  mkdir -p "$(dirname "${venv}")"
  "${py}" -m venv "${venv}"
  "${pip[@]}" install -q --upgrade pip
  "${pip[@]}" install -q -r "${requirements}"
  echo "${hash}" >"${venv}/venv.stamp"
  echo "${label}: ${venv} made in $((SECONDS - t0))s"
}

# kept_gpuq LABEL VENV CMAKE_DIR: gpuq installed into VENV by pip from ./python, as a user's
# install is, but without build isolation (the venv's requirements bring scikit-build-core and
# nanobind), so that its CMake tree (CMAKE_DIR) is kept and a change recompiles only what
# changed; skipped when the tracked sources it is built from (python/, common/, libclient/) are
# those of the last install (a hash in VENV/gpuq.stamp).
kept_gpuq() {
  local label=$1 venv=$2 cmake_dir=$3 hash t0=${SECONDS}
  hash=$(git -C "${ROOT}" ls-files -z -co --exclude-standard -- python common libclient |
    (cd "${ROOT}" && xargs -0 sha256sum 2>/dev/null || true) | sha256sum | cut -d' ' -f1)
  if [[ "$(cat "${venv}/gpuq.stamp" 2>/dev/null)" == "${hash}" ]]; then
    echo "${label}: gpuq in ${venv} is up to date (python/, common/, libclient/ unchanged)"
    return 0
  fi
  rm -f "${venv}/gpuq.stamp"
  CMAKE_BUILD_PARALLEL_LEVEL="${BUILD_JOBS}" "${venv}/bin/python" -m pip \
    --disable-pip-version-check install -q --no-build-isolation --no-deps --force-reinstall \
    -C build-dir="${cmake_dir}" "${ROOT}/python"
  echo "${hash}" >"${venv}/gpuq.stamp"
  echo "${label}: gpuq installed in $((SECONDS - t0))s"
}

# The Python client (python/, docs/python.md), installed as a user would: `pip install` of the
# source folder into a new venv, the package's build isolated by pip. Its pytest suite runs
# against the real daemon of build/; JUnit counts go to the totals.
stage_python() {
  [[ -f build/CMakeCache.txt ]] || configure build RelWithDebInfo "${BUILD_CMAKE_ARGS[@]}"
  cmake --build build -j "${BUILD_JOBS}" --target gpuqd gpuq-worker gpuqctl gpuq_fake_nvml
  local py
  py=$(python_interpreter)
  local venv="${ROOT}/build-python/venv"
  rm -rf "${venv}"
  "${py}" -m venv "${venv}"
  local -a pip=("${venv}/bin/python" -m pip --disable-pip-version-check)
  "${pip[@]}" install -q --upgrade pip
  CMAKE_BUILD_PARALLEL_LEVEL="${BUILD_JOBS}" "${pip[@]}" install "${ROOT}/python[test]"
  # The package's lint, format and types (python/pyproject.toml [tool.ruff], [tool.mypy]; ruff,
  # mypy and nanobind pinned in python/lint-requirements.txt), and the committed stub of its
  # native module against the module just built (scripts/native_stub.sh): a finding fails the
  # stage before its tests run.
  "${pip[@]}" install -q -r "${ROOT}/python/lint-requirements.txt"
  (cd "${ROOT}/python" && "${venv}/bin/ruff" check gpuq && "${venv}/bin/ruff" format --check gpuq) ||
    return 1
  (cd "${ROOT}/python" &&
    "${venv}/bin/mypy" --cache-dir "${ROOT}/build-python/mypy-cache") || return 1
  bash "${ROOT}/scripts/native_stub.sh" --check --python "${venv}/bin/python" || return 1
  local junit="${ROOT}/build-python/pytest-junit.xml"
  rm -f "${junit}"
  local -a extra=()
  [[ -z "${GPUQ_PYTEST_ARGS:-}" ]] || read -r -a extra <<<"${GPUQ_PYTEST_ARGS}"
  local rc=0
  GPUQ_GPUQD="${ROOT}/build/daemon/gpuqd" "${venv}/bin/pytest" -ra -p no:cacheprovider \
    --junitxml="${junit}" "${ROOT}/python/tests" "${extra[@]}" || rc=$?
  count_results "${junit}"
  local counts="${stage_counts}"
  # The peers' own suites on gpuq's drop-ins (tests/compat/run.py): joblib's test_parallel.py
  # from the pinned release's source and CPython's test_concurrent_futures.py; a test that does
  # not pass is listed in tests/compat/differences.txt with its reason.
  "${pip[@]}" install -q -r "${ROOT}/tests/compat/requirements.txt"
  local compat_junit="${ROOT}/build-python/compat-junit.xml"
  rm -f "${compat_junit}"
  GPUQ_GPUQD="${ROOT}/build/daemon/gpuqd" "${venv}/bin/python" "${ROOT}/tests/compat/run.py" \
    -ra -p no:logging --junitxml="${compat_junit}" || rc=$?
  count_results "${compat_junit}"
  stage_counts="${counts} + compat ${stage_counts}"
  return "${rc}"
}

# TensorFlow in Python pools (docs/python.md; python/tests/test_tensorflow.py, which the python
# stage skips: its venv has no TensorFlow). tensorflow-cpu from PyPI, pinned in
# tests/tf/requirements.txt, in a venv outside the tree (CI's fresh clone would download the
# ~1.4 GB again on every run), kept as kept_venv says; gpuq in it as kept_gpuq says.
stage_tf() {
  [[ -f build/CMakeCache.txt ]] || configure build RelWithDebInfo "${BUILD_CMAKE_ARGS[@]}"
  cmake --build build -j "${BUILD_JOBS}" --target gpuqd gpuq-worker
  local venv="${GPUQ_TF_VENV:-${XDG_CACHE_HOME:-${HOME:-/var/tmp}/.cache}/gpuq-tf/venv}"
  kept_venv tf "${venv}" "$(python_interpreter)" "${ROOT}/tests/tf/requirements.txt"
  kept_gpuq tf "${venv}" "${ROOT}/build-python/tf-cmake"
  local junit="${ROOT}/build-python/tf-junit.xml"
  mkdir -p "${ROOT}/build-python"
  rm -f "${junit}"
  local rc=0
  GPUQ_GPUQD="${ROOT}/build/daemon/gpuqd" "${venv}/bin/python" -m pytest -ra -p no:cacheprovider \
    --timeout 300 --junitxml="${junit}" "${ROOT}/python/tests/test_tensorflow.py" || rc=$?
  count_results "${junit}"
  return "${rc}"
}

# Web apps in front of gpuq (docs/web.md, examples/web): the pinned tests/web/requirements.txt
# in build-web/venv, kept as kept_venv says, and gpuq in it as kept_gpuq says.
stage_web() {
  [[ -f build/CMakeCache.txt ]] || configure build RelWithDebInfo "${BUILD_CMAKE_ARGS[@]}"
  cmake --build build -j "${BUILD_JOBS}" --target gpuqd gpuq-worker
  local dir="${ROOT}/build-web"
  local venv="${dir}/venv"
  kept_venv web "${venv}" "$(python_interpreter)" "${ROOT}/tests/web/requirements.txt"
  kept_gpuq web "${venv}" "${dir}/cmake"
  local junit="${dir}/pytest-junit.xml"
  rm -f "${junit}"
  local rc=0
  GPUQ_GPUQD="${ROOT}/build/daemon/gpuqd" "${venv}/bin/python" -m pytest -ra -p no:cacheprovider \
    --timeout 300 --junitxml="${junit}" "${ROOT}/tests/web" || rc=$?
  count_results "${junit}"
  return "${rc}"
}

# Beyond one machine (docs/scale-out.md, "Testing"): Ray and Dask from PyPI, pinned, in a venv
# of their own with the Python client installed as the python stage installs it; the tests run
# against the gpuqd of build/, in network and PID namespaces of their own, where Ray and Dask
# listen on 127.0.0.1 only and every process they start ends with the namespace.
stage_scaleout() {
  [[ -f build/CMakeCache.txt ]] || configure build RelWithDebInfo "${BUILD_CMAKE_ARGS[@]}"
  cmake --build build -j "${BUILD_JOBS}" --target gpuqd gpuq-worker
  local py
  py=$(python_interpreter)
  local venv="${ROOT}/build-scaleout/venv"
  rm -rf "${venv}"
  "${py}" -m venv "${venv}"
  local -a pip=("${venv}/bin/python" -m pip --disable-pip-version-check)
  "${pip[@]}" install -q --upgrade pip
  "${pip[@]}" install -q -r "${ROOT}/tests/scaleout/requirements.txt"
  CMAKE_BUILD_PARALLEL_LEVEL="${BUILD_JOBS}" "${pip[@]}" install -q "${ROOT}/python[test]"
  local junit="${ROOT}/build-scaleout/pytest-junit.xml"
  rm -f "${junit}"
  local rc=0
  GPUQ_GPUQD="${ROOT}/build/daemon/gpuqd" bash "${ROOT}/tests/scaleout/netns.sh" \
    "${venv}/bin/python" "${venv}/bin/pytest" -ra -p no:cacheprovider --junitxml="${junit}" \
    "${ROOT}/tests/scaleout" || rc=$?
  count_results "${junit}"
  return "${rc}"
}

stage_asan() {
  sanitizer_prefix "address,undefined"
  configure build-asan RelWithDebInfo "-DGPUQ_SANITIZE=address;undefined" \
    "${SANITIZER_CMAKE_ARGS[@]}"
  build build-asan
  ASAN_OPTIONS="halt_on_error=1:abort_on_error=0:detect_leaks=1:check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=1:print_stacktrace=1${ASAN_OPTIONS:+:${ASAN_OPTIONS}}" \
  UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:report_error_type=1${UBSAN_OPTIONS:+:${UBSAN_OPTIONS}}" \
    run_ctest build-asan "${SANITIZER_LABELS}" "${run_prefix[@]}"
}

stage_tsan() {
  sanitizer_prefix "thread"
  configure build-tsan RelWithDebInfo -DGPUQ_SANITIZE=thread "${SANITIZER_CMAKE_ARGS[@]}"
  build build-tsan
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:print_stacktrace=1${TSAN_OPTIONS:+:${TSAN_OPTIONS}}" \
    run_ctest build-tsan "${SANITIZER_LABELS}" "${run_prefix[@]}"
}

# The fuzz targets (tests/fuzz/CMakeLists.txt). Each runs for GPUQ_FUZZ_SECONDS on a copy of its
# seed corpus and regression inputs in build-fuzz/fuzz-corpus/<target>/ (inputs it finds are kept
# there for the next run; the source tree is never written). A crash, a sanitizer report, a leak,
# or one input running longer than 10 s fails the stage; the input lands in
# build-fuzz/fuzz-artifacts/<target>/ and its path is printed.
readonly FUZZ_TARGETS=(fuzz_descriptor fuzz_params fuzz_protocol)
readonly FUZZ_SECONDS="${GPUQ_FUZZ_SECONDS:-60}"

stage_fuzz() {
  command -v clang++ >/dev/null || { echo "clang++ not found (scripts/setup.sh)" >&2; return 1; }
  CXX=clang++ sanitizer_prefix "address,undefined"
  CC=clang CXX=clang++ configure build-fuzz RelWithDebInfo -DGPUQ_FUZZ=ON -DGPUQ_SANITIZE= \
    -DGPUQ_WITH_CUDA=OFF -DGPUQ_BUILD_TESTS=ON -DGPUQ_BUILD_BENCH=OFF -DGPUQ_BUILD_EXAMPLES=OFF \
    -DGPUQ_WERROR=ON
  cmake --build build-fuzz -j "${BUILD_JOBS}" --target "${FUZZ_TARGETS[@]}"
  local t failed=0 runs=0
  for t in "${FUZZ_TARGETS[@]}"; do
    local corpus="${ROOT}/build-fuzz/fuzz-corpus/${t}"
    local artifacts="${ROOT}/build-fuzz/fuzz-artifacts/${t}"
    local log="${ROOT}/build-fuzz/fuzz-logs/${t}.log"
    mkdir -p "${corpus}" "${artifacts}" "$(dirname "${log}")"
    rm -f "${artifacts}"/*
    # Seeds and regressions (not the .gitkeep of an empty directory); earlier finds stay.
    find "${ROOT}/tests/fuzz/corpus/${t}" "${ROOT}/tests/fuzz/regressions/${t}" -maxdepth 1 \
      -type f ! -name '.*' -exec cp -f {} "${corpus}/" \;
    local -a args=(-max_total_time="${FUZZ_SECONDS}" -timeout=10 -print_final_stats=1
      -artifact_prefix="${artifacts}/")
    [[ ! -f "${ROOT}/tests/fuzz/${t}.dict" ]] || args+=(-dict="${ROOT}/tests/fuzz/${t}.dict")
    echo "fuzz: ${t} for ${FUZZ_SECONDS}s on $(find "${corpus}" -type f | wc -l) inputs (log: ${log})"
    local rc=0
    ASAN_OPTIONS="detect_leaks=1:print_stacktrace=1${ASAN_OPTIONS:+:${ASAN_OPTIONS}}" \
    UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:report_error_type=1${UBSAN_OPTIONS:+:${UBSAN_OPTIONS}}" \
      "${run_prefix[@]}" "${ROOT}/build-fuzz/tests/fuzz/${t}" "${args[@]}" "${corpus}" \
      >"${log}" 2>&1 || rc=$?
    grep -E '^#[0-9]+[[:space:]]+DONE' "${log}" | tail -1 | sed "s/^/  ${t}: /" || true
    local n
    n=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "${log}" | tail -1)
    runs=$((runs + ${n:-0}))
    local -a crash=()
    mapfile -t crash < <(find "${artifacts}" -type f | sort)
    if ((rc != 0 || ${#crash[@]} > 0)); then
      failed=$((failed + 1))
      echo "fuzz: ${t} FAILED (exit ${rc}); the end of its log:" >&2
      tail -n 60 "${log}" | sed 's/^/  | /' >&2
      local f
      for f in "${crash[@]}"; do
        echo "fuzz: crashing input: ${f}" >&2
        echo "  replay: build-fuzz/tests/fuzz/${t} ${f}" >&2
        echo "  keep it: cp ${f} tests/fuzz/regressions/${t}/<what-it-does>" >&2
      done
    fi
  done
  stage_counts="(${#FUZZ_TARGETS[@]} targets x ${FUZZ_SECONDS}s, ${runs} inputs run, ${failed} failed)"
  ((failed == 0))
}

# The clang-tidy ratchet (scripts/tidy.py, docs/testing.md "Lint"). Reuses build/ as the build
# stage left it (a file added since is picked up by the configure); makes it without building
# when that stage did not run. Findings in files outside scripts/tidy-clean.txt do not count.
stage_tidy() {
  configure build RelWithDebInfo "${BUILD_CMAKE_ARGS[@]}"
  python3 scripts/tidy.py --no-configure -p build -j "${BUILD_JOBS}"
}

# The whole tree (every .cpp of build/'s compile_commands.json), as a report.
stage_tidy-all() {
  configure build RelWithDebInfo "${BUILD_CMAKE_ARGS[@]}"
  python3 scripts/tidy.py --all --no-configure -p build -j "${BUILD_JOBS}"
}

# ---- main --------------------------------------------------------------------------------------
echo "test.sh: stages: ${stages[*]}; ${BUILD_JOBS} build jobs, ${CTEST_JOBS} test jobs"
for s in "${stages[@]}"; do
  banner "stage ${s}"
  current_stage="${s}"
  stage_start=${SECONDS}
  stage_counts=""
  "stage_${s}"
  summary+=("$(printf '%-7s ok in %ds %s' "${s}" $((SECONDS - stage_start)) "${stage_counts}")")
  current_stage=""
done
