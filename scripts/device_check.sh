#!/usr/bin/env bash
# The GPU checks on a lent GPU machine, in one command: machine info, a Release build of only
# what the `gpu` ctest label and the GPU benchmark need (build-device/, sm_90), `ctest -L gpu`
# one test at a time under a time limit, and bench/gpu_bench.cpp's full run. That machine has
# CUDA, cmake, ninja, a g++ and a Python with NVIDIA's cuDNN (and cuBLAS) wheels, but no
# internet and no Boost, nlohmann_json or doctest: those come from build-device-deps/, which
# scripts/device_deps.sh fills on a machine that has them (carry it along). docs/testing.md,
# "GPU tests on a lent machine".
#
#   OUT=/some/folder bash scripts/device_check.sh      # from anywhere; works in the repo root
#
# Everything lands in $OUT (default build-device/out): summary.txt (one line per stage and per
# test, with its time and result, written as it goes), info.txt, deps.txt, configure.log,
# CMakeCache.txt, build.log, ldd.txt, test-<name>.log, LastTest-<name>.log, gpu_bench.json and
# gpu_bench.txt. Every step prints its start time and duration. A failed stage does not stop the
# later ones that can still run (ninja -k 0 builds all it can, and the tests whose binaries were
# built still run), so one call shows as much as it can. Exit status: 0 when every stage passed,
# 1 otherwise. A test or benchmark that reports skipped (no CUDA device: exit 77) counts as a
# failure when nvidia-smi lists a GPU, unless GPUQ_DEVICE_ALLOW_SKIP=1.
#
# cuDNN: the first cudnn_version.h and libcudnn.so[.N] under the Python's `nvidia` packages
# (pip's nvidia-cudnn-cu13), else whatever cmake/FindCUDNN.cmake finds (a system cuDNN).
# cuBLAS: the CUDA toolkit's, else the wheel's (nvidia/cu13/lib). Their folders also go on
# LD_LIBRARY_PATH for the tests: cuDNN dlopens its sub-libraries.
#
# Environment:
#   OUT                      output folder (default <repo>/build-device/out)
#   GPUQ_DEVICE_STAGES       stages, in order (default "info configure build test deb bench python
#                            patterns batching pybench"; deb: tests/package/gpu_deb_test.sh, the
#                            gpuq-gpu package's binaries unpacked and run without the loader's
#                            cache; python: the gpu Python pool tests, torch, in a venv of the
#                            machine's; patterns: the seed patterns on their gpu pool, in it;
#                            batching: bench/python/bench_batching.py --gpu in it; pybench:
#                            bench/python/bench_gpu_python.py, a torch model through a gpu pool
#                            against each process loading it itself; not by default: rollout,
#                            bench/python/bench_rollout.py --gpu, latency during rolling restarts
#                            of a 2-worker torch gpu pool, issue 40)
#   GPUQ_DEVICE_BUILD        build folder (default <repo>/build-device; kept, so a rerun is
#                            incremental; GPUQ_DEVICE_CLEAN=1 removes it first)
#   GPUQ_DEVICE_DEPS         the bundle (default <repo>/build-device-deps)
#   GPUQ_DEVICE_BUDGET       seconds for the whole run (default 420): the test and bench limits
#                            shrink to what is left, and a stage that cannot start in time is
#                            skipped, so the summary is complete before an outer limit kills us
#   GPUQ_DEVICE_TEST_TIMEOUT seconds per gpu test (default 180)
#   GPUQ_DEVICE_BENCH_TIMEOUT seconds for the benchmark (default 120)
#   GPUQ_CUDA_ARCH           CMAKE_CUDA_ARCHITECTURES (default 90: H100, H200)
#   GPUQ_BUILD_JOBS          parallel compile jobs (default: nproc)
#   GPUQ_DEVICE_PYTHON       the Python with torch and the nvidia wheels (default: python3, or
#                            /opt/torch/.venv/bin/python3 where only that imports torch)
#   GPUQ_PYBENCH_ARGS        extra arguments of bench_gpu_python.py (word-split)
#   GPUQ_DEVICE_CMAKE_ARGS   extra configure arguments (word-split)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly ROOT="${PWD}"
readonly BUILD="${GPUQ_DEVICE_BUILD:-${ROOT}/build-device}"
readonly DEPS="${GPUQ_DEVICE_DEPS:-${ROOT}/build-device-deps}"
OUT="${OUT:-${BUILD}/out}"
readonly STAGES="${GPUQ_DEVICE_STAGES:-info configure build test deb bench python patterns batching pybench}"
readonly BUDGET="${GPUQ_DEVICE_BUDGET:-420}"
readonly TEST_TIMEOUT="${GPUQ_DEVICE_TEST_TIMEOUT:-180}"
readonly BENCH_TIMEOUT="${GPUQ_DEVICE_BENCH_TIMEOUT:-120}"
readonly ARCH="${GPUQ_CUDA_ARCH:-90}"
readonly JOBS="${GPUQ_BUILD_JOBS:-$(nproc)}"
# The Python with torch: GPUQ_DEVICE_PYTHON, else the first of python3 and the image's torch
# venv that imports torch (a session's PATH may lead python3 elsewhere), else python3.
PY="${GPUQ_DEVICE_PYTHON:-}"
if [[ -z "${PY}" ]]; then
  PY=python3
  for candidate in python3 /opt/torch/.venv/bin/python3; do
    if command -v "${candidate}" >/dev/null && "${candidate}" -c 'import torch' 2>/dev/null; then
      PY="${candidate}"
      break
    fi
  done
fi
readonly PY

mkdir -p "${OUT}"
OUT="$(cd "${OUT}" && pwd)"
readonly OUT SUMMARY="${OUT}/summary.txt"
: >"${SUMMARY}"
failures=0

if [[ -d /usr/local/cuda/bin ]]; then export PATH="/usr/local/cuda/bin:${PATH}"; fi

log() { printf '[%3ds] %s\n' "${SECONDS}" "$*"; }
# record <what> <result> <seconds>: one line of summary.txt (and of our output). passed, skipped
# (no CUDA device, and nvidia-smi lists none either) and - (a heading) are fine; anything else
# (failed, timeout, SKIPPED: no CUDA device although nvidia-smi lists a GPU, no-time) fails.
record() {
  printf '%-28s %-8s %4ss\n' "$1" "$2" "$3" | tee -a "${SUMMARY}"
  case "$2" in passed | skipped | -) ;; *) failures=$((failures + 1)) ;; esac
}
left() { echo $((BUDGET - SECONDS)); }
# limit <seconds>: that, or what is left of the budget less a margin, whichever is less.
limit() { local l=$(($(left) - 15)); echo $(($1 < l ? $1 : l)); }
# stage <name> <function>: runs the function in a subshell with errexit, its output into
# $OUT/<name>.log and ours, and records its result and time (exit 77: skipped).
stage() {
  local name="$1" fn="$2" t0=${SECONDS} rc
  if [[ " ${STAGES} " != *" ${name} "* ]]; then return 0; fi
  if (($(left) < 20)); then
    record "${name}" "no-time" 0
    return 0
  fi
  printf '\n==> [%3ds] %s\n' "${SECONDS}" "${name}"
  set +e
  (set -e; "${fn}") 2>&1 | tee "${OUT}/${name}.log"
  rc=${PIPESTATUS[0]}
  set -e
  record "${name}" "$(result_of "${rc}")" $((SECONDS - t0))
  return 0
}
# result_of <exit status>: 0 passed; 77 skipped, or SKIPPED where nvidia-smi lists a GPU (unless
# GPUQ_DEVICE_ALLOW_SKIP=1); 124 or 137 (timeout) timeout; else failed.
result_of() {
  case "$1" in
    0) echo passed ;;
    77) if ((have_gpu)) && [[ "${GPUQ_DEVICE_ALLOW_SKIP:-0}" != 1 ]]; then echo SKIPPED; else
          echo skipped; fi ;;
    124 | 137) echo timeout ;;
    *) echo failed ;;
  esac
}

trap 'log "device_check: ${failures} failure(s); results in ${OUT}"; cat "${SUMMARY}" >&2' EXIT
echo "device_check: started $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), stages: ${STAGES}" \
  | tee -a "${SUMMARY}"

# ---- info: the machine -----------------------------------------------------------------------
have_gpu=0
if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then have_gpu=1; fi
info() {
  set +e  # best effort: a missing tool is reported, not fatal
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(hostname); $(uname -srm); $(nproc) CPUs"
    grep -E '^PRETTY_NAME=' /etc/os-release 2>/dev/null || true
    free -g | sed -n 2p
    echo; echo "--- nvidia-smi"; nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap,pci.bus_id \
      --format=csv 2>&1 || true
    echo; echo "--- tools"
    for t in nvcc g++ c++ cmake ninja; do
      printf '%s: ' "${t}"; command -v "${t}" || echo "(missing)"
    done
    nvcc --version 2>&1 | tail -n 2 || true
    g++ --version 2>&1 | head -n 1 || true
    cmake --version 2>&1 | head -n 1 || true
    echo "ninja $(ninja --version 2>&1 || true)"
    echo "${PY}: $(command -v "${PY}") $("${PY}" --version 2>&1)"
    echo; echo "--- CUDA libraries"
    ls -l /usr/local/cuda/lib64/lib{cudart,cublas,cublasLt,cudnn}.so* 2>/dev/null
    ldconfig -p 2>/dev/null | grep -E 'libcudnn\.so|libcublas\.so|libcuda\.so' || true
    echo; echo "--- the bundle"; cat "${DEPS}/MANIFEST.txt" 2>&1 || true
  } | tee "${OUT}/info.txt"
}
stage info info

# ---- where cuDNN and cuBLAS are (main shell: it sets the configure arguments and the loader
# path for the stages after it) --------------------------------------------------------------
cmake_deps=()
cudnn_dir=""  # the wheel's library folder
ld_dirs=()    # a cuBLAS wheel's
cuda_flags="-allow-unsupported-compiler"  # a host g++ newer than this nvcc knows: try anyway
find_deps() {
  local nvidia_dirs="" cudnn_h="" cudnn_lib="" cublas="" cublas_lt="" cublas_h="" dirs=()
  nvidia_dirs="$("${PY}" -c 'import nvidia; print("\n".join(nvidia.__path__))' 2>/dev/null)" \
    || nvidia_dirs=""
  if [[ -n "${nvidia_dirs}" ]]; then
    echo "python nvidia packages: ${nvidia_dirs//$'\n'/ }"
    mapfile -t dirs <<<"${nvidia_dirs}"
    cudnn_h="$(find "${dirs[@]}" -name cudnn_version.h 2>/dev/null | sort | head -n 1)"
    # libcudnn.so, else the shortest libcudnn.so.N (the wheel has no unversioned name; the
    # linker takes a full path just the same, so no symlink is needed).
    cudnn_lib="$(find "${dirs[@]}" \( -name libcudnn.so -o -name 'libcudnn.so.[0-9]*' \) \
      2>/dev/null | awk '{ print length($0) " " $0 }' | sort -n | head -n 1 | cut -d' ' -f2-)"
  fi
  if [[ -n "${cudnn_lib}" ]]; then
    echo "cuDNN: the wheel's ${cudnn_lib} (headers: ${cudnn_h:-from FindCUDNN})"
    cmake_deps+=("-DCUDNN_LIBRARY=${cudnn_lib}")
    if [[ -n "${cudnn_h}" ]]; then cmake_deps+=("-DCUDNN_INCLUDE_DIR=$(dirname "${cudnn_h}")"); fi
    cudnn_dir="$(dirname "${cudnn_lib}")"
  else
    echo "cuDNN: no wheel (import nvidia failed or has no libcudnn); FindCUDNN looks in the system"
  fi
  if compgen -G '/usr/local/cuda/lib64/libcublas.so*' >/dev/null \
      || compgen -G '/usr/local/cuda/targets/*/lib/libcublas.so*' >/dev/null; then
    echo "cuBLAS: the CUDA toolkit's (/usr/local/cuda)"
  elif [[ -n "${nvidia_dirs}" ]]; then
    cublas="$(find "${dirs[@]}" -name 'libcublas.so*' 2>/dev/null | sort | head -n 1)"
    cublas_lt="$(find "${dirs[@]}" -name 'libcublasLt.so*' 2>/dev/null | sort | head -n 1)"
    cublas_h="$(find "${dirs[@]}" -name cublas_v2.h 2>/dev/null | sort | head -n 1)"
    if [[ -n "${cublas}" ]]; then
      echo "cuBLAS: the wheel's ${cublas}"
      cmake_deps+=("-DCUDA_cublas_LIBRARY=${cublas}" "-DCUDA_cublasLt_LIBRARY=${cublas_lt}")
      if [[ -n "${cublas_h}" && ! -e /usr/local/cuda/include/cublas_v2.h ]]; then
        local inc; inc="$(dirname "${cublas_h}")"
        cmake_deps+=("-DCMAKE_CXX_FLAGS=-isystem ${inc}")
        cuda_flags+=" -isystem ${inc}"
      fi
      ld_dirs+=("$(dirname "${cublas}")")
    else
      echo "cuBLAS: not in the toolkit nor in a wheel: the configure will say so"
    fi
  fi
}
# In this shell (its arrays are the configure's arguments), best effort (errexit is off inside a
# function called with ||).
find_deps >"${OUT}/deps.txt" 2>&1 || true
cat "${OUT}/deps.txt"
# The wheel's cuDNN first (the headers built against), then the toolkit, then a cuBLAS wheel's
# folder (it holds a cudart too: the toolkit's wins).
if [[ -d /usr/local/cuda/lib64 ]]; then ld_dirs=(/usr/local/cuda/lib64 "${ld_dirs[@]}"); fi
if [[ -n "${cudnn_dir}" ]]; then ld_dirs=("${cudnn_dir}" "${ld_dirs[@]}"); fi
ld_path="$(IFS=:; echo "${ld_dirs[*]}")"
export LD_LIBRARY_PATH="${ld_path}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH}" | tee -a "${OUT}/deps.txt"

# ---- configure -------------------------------------------------------------------------------
configure() {
  if [[ ! -f "${DEPS}/lib/cmake/Boost/BoostConfig.cmake" ]]; then
    echo "no ${DEPS}: run scripts/device_deps.sh where Boost is installed, and carry it" >&2
    return 1
  fi
  if [[ "${GPUQ_DEVICE_CLEAN:-0}" == 1 ]]; then rm -rf "${BUILD}"; fi
  local generator=()
  if command -v ninja >/dev/null; then generator=(-G Ninja); fi
  local nvcc=()
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then nvcc=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc); fi
  # CMake 3.30 and later: find_package(Boost) in config mode only (CMP0167 NEW), without the
  # FindBoost deprecation warning. Older ones know no such policy (and would warn about it).
  local policy=() v
  v="$(cmake --version | sed -n 's/^cmake version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')"
  read -r -a v <<<"${v}"
  if ((v[0] > 3 || (v[0] == 3 && v[1] >= 30))); then policy=(-DCMAKE_POLICY_DEFAULT_CMP0167=NEW); fi
  # shellcheck disable=SC2086
  cmake -S "${ROOT}" -B "${BUILD}" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES="${ARCH}" "${nvcc[@]}" -DGPUQ_WITH_CUDA=ON \
    -DGPUQ_BUILD_TESTS=ON -DGPUQ_BUILD_BENCH=ON -DGPUQ_BUILD_EXAMPLES=ON \
    -DCMAKE_CUDA_FLAGS="${cuda_flags}" "${policy[@]}" -DCMAKE_SKIP_INSTALL_ALL_DEPENDENCY=ON \
    -DBoost_DIR="${DEPS}/lib/cmake/Boost" \
    -Dnlohmann_json_DIR="${DEPS}/lib/cmake/nlohmann_json" \
    -Ddoctest_DIR="${DEPS}/lib/cmake/doctest" \
    "${cmake_deps[@]}" ${GPUQ_DEVICE_CMAKE_ARGS:-} || {
      cp "${BUILD}/CMakeFiles/CMakeConfigureLog.yaml" "${BUILD}/CMakeFiles/CMakeError.log" \
        "${OUT}/" 2>/dev/null || true
      return 1
    }
  cp "${BUILD}/CMakeCache.txt" "${OUT}/"
  grep -E '^(Boost_DIR|nlohmann_json_DIR|doctest_DIR|CUDNN_LIBRARY|CUDNN_INCLUDE_DIR|CUDA_cublas_LIBRARY|CMAKE_CXX_COMPILER|CMAKE_CUDA_COMPILER|CMAKE_CUDA_HOST_COMPILER):' \
    "${BUILD}/CMakeCache.txt" || true
}
stage configure configure

# ---- build: the executables of the gpu tests and the benchmark, and what they start ----------
build() {
  # The gpu tests' executables (their file names are their targets'), as ctest lists them.
  local targets
  targets="$(ctest --test-dir "${BUILD}" -N -L gpu --show-only=json-v1 \
    | "${PY}" -c 'import json, os, sys
print("\n".join(sorted({os.path.basename(t["command"][0]) for t in json.load(sys.stdin)["tests"]
                        if t.get("command")})))')" || targets=""
  # The same by name (today's list, should the query fail), the benchmark, the daemon,
  # workers, tool and plug-ins they start (add_dependencies names them too), and libgpuq, which
  # the packages of the deb stage hold too (its cpack builds nothing itself: the configure's
  # CMAKE_SKIP_INSTALL_ALL_DEPENDENCY keeps it from building every test first).
  # shellcheck disable=SC2086
  targets="$(printf '%s\n' ${targets} gpuq-gpu-probe test_gpu_worker test_gpu_plugins \
    gpuq_bench_gpu gpuqd gpuq-worker gpuq-gpu-worker gpuqctl gpuq_example_plugin \
    gpuq_test_plugin gpuq gpuq_static_dist | sort -u | tr '\n' ' ')"
  echo "targets: ${targets}"
  local keep_going=(-k 0)
  if [[ ! -f "${BUILD}/build.ninja" ]]; then keep_going=(-k); fi
  # shellcheck disable=SC2086
  cmake --build "${BUILD}" -j "${JOBS}" --target ${targets} -- "${keep_going[@]}"
  ldd "${BUILD}/daemon/gpuq-gpu-worker" >"${OUT}/ldd.txt" 2>&1 || true
  ldd "${BUILD}/daemon/gpu/gpuq-gpu-probe" >>"${OUT}/ldd.txt" 2>&1 || true
  grep -E 'cudnn|cublas|cudart|not found' "${OUT}/ldd.txt" || true
}
stage build build

# ---- test: ctest -L gpu, one test at a time, each under a limit ------------------------------
test_one() {
  local t="$1" t0=${SECONDS} rc lim result
  lim="$(limit "${TEST_TIMEOUT}")"
  if ((lim < 10)); then
    record "  test ${t}" no-time 0
    return 0
  fi
  log "test ${t} (limit ${lim}s)"
  set +e
  timeout -k 10 "${lim}" ctest --test-dir "${BUILD}" -R "^${t}\$" --output-on-failure \
    2>&1 | tee "${OUT}/test-${t}.log"
  rc=${PIPESTATUS[0]}
  set -e
  # ctest exits 0 for a skipped test (SKIP_RETURN_CODE 77): its output says so.
  if ((rc == 0)) && grep -q '\*\*\*Skipped' "${OUT}/test-${t}.log"; then rc=77; fi
  result="$(result_of "${rc}")"
  cp "${BUILD}/Testing/Temporary/LastTest.log" "${OUT}/LastTest-${t}.log" 2>/dev/null || true
  record "  test ${t}" "${result}" $((SECONDS - t0))
}
if [[ " ${STAGES} " == *" test "* ]]; then
  printf '\n==> [%3ds] test\n' "${SECONDS}"
  t0=${SECONDS}
  mapfile -t tests < <(ctest --test-dir "${BUILD}" -N -L gpu 2>/dev/null \
    | sed -n 's/^ *Test *#[0-9]*: *//p')
  if ((${#tests[@]} == 0)); then
    echo "no test with label gpu (the configure failed, or the build has no CUDA)"
    record test failed 0
  else
    log "gpu tests: ${tests[*]}"
    for t in "${tests[@]}"; do test_one "${t}"; done
    record test - $((SECONDS - t0))
  fi
fi

# ---- deb: the gpuq and gpuq-gpu packages (cpack), unpacked; the GPU binaries load their CUDA
# libraries with the loader's cache ignored and, started by the unpacked gpuqd without
# LD_LIBRARY_PATH, run a gemm and a conv2d (tests/package/gpu_deb_test.sh) ---------------------
deb() {
  local args=""
  # No dpkg-dev here (Ubuntu's image): gpuq's dependency list is not what this stage checks.
  command -v dpkg-shlibdeps >/dev/null || args="-D CPACK_DEBIAN_MAIN_PACKAGE_SHLIBDEPS=OFF"
  GPUQ_CPACK_ARGS="${args}" timeout -k 10 "$(limit 120)" \
    bash "${ROOT}/tests/package/gpu_deb_test.sh" "${BUILD}"
}
stage deb deb

# ---- bench: the GPU benchmark, full run ------------------------------------------------------
bench() {
  local lim rc
  lim="$(limit "${BENCH_TIMEOUT}")"
  echo "gpuq_bench_gpu --json ${OUT}/gpu_bench.json (limit ${lim}s)"
  set +e
  timeout -k 10 "${lim}" "${BUILD}/bench/gpuq_bench_gpu" --json "${OUT}/gpu_bench.json" \
    >"${OUT}/gpu_bench.txt" 2>&1
  rc=$?
  set -e
  cat "${OUT}/gpu_bench.txt"
  cp "${BUILD}/bench_gpu_smoke.json" "${OUT}/" 2>/dev/null || true
  return "${rc}"
}
stage bench bench

# ---- python: the gpu Python pool tests (python/tests/test_python_gpu.py, torch), gpuq serve on
# every GPU (test_serve.py) and the gpu
# pool's metrics (test_metrics_gpu.py: worker memory, NVML figures from the sampler) -----------
# The gpuq package built into a venv that sees the machine's own packages (torch, nanobind,
# scikit-build-core; no internet), against the bundle's headers, then pytest -m gpu against the
# gpuqd of this build. Exit 77 (skipped) when torch or a device is missing.
python_gpu() {
  local venv="${BUILD}/pyvenv" lim site
  if [[ ! -x "${venv}/bin/python" ]]; then
    "${PY}" -m venv --system-site-packages "${venv}"
    # ${PY} may itself be a venv's (the image's torch is in /opt/torch/.venv), whose packages a
    # venv made from it does not see (only the base interpreter's): a .pth names them.
    site="$("${venv}/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "${PY}" -c 'import site, sysconfig
p = sysconfig.get_paths()
print("\n".join(dict.fromkeys([p["purelib"], p["platlib"], *site.getsitepackages()])))' \
      >"${site}/device-python.pth"
  fi
  echo "python: ${PY} ($("${PY}" --version 2>&1)); venv ${venv} sees: $(tr '\n' ' ' <"$(
    "${venv}/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
  )/device-python.pth")"
  "${venv}/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 77)' \
    || return $?
  if compgen -G "${DEPS}/wheels/*.whl" >/dev/null; then
    "${venv}/bin/python" -m pip install -q --no-deps --no-index "${DEPS}"/wheels/*.whl
  fi
  "${venv}/bin/python" -m pip install -q --no-build-isolation --no-deps --no-index \
    --config-settings=build-dir="${BUILD}/pybuild" \
    --config-settings=cmake.define.Boost_DIR="${DEPS}/lib/cmake/Boost" \
    --config-settings=cmake.define.nlohmann_json_DIR="${DEPS}/lib/cmake/nlohmann_json" \
    "${ROOT}/python"
  lim="$(limit "${TEST_TIMEOUT}")"
  GPUQ_GPUQD="${BUILD}/daemon/gpuqd" timeout -k 10 "${lim}" "${venv}/bin/python" -m pytest -v \
    -m gpu -p no:cacheprovider --junitxml="${OUT}/python-gpu.xml" \
    "${ROOT}/python/tests/test_python_gpu.py" "${ROOT}/python/tests/test_metrics_gpu.py" \
    "${ROOT}/python/tests/test_serve.py"
}
stage python python_gpu

# ---- patterns: the seed patterns (examples/python/patterns) on their default pool, patterns-gpu,
# in the python stage's venv: each must say it ran there with its model on cuda, not on the cpu
# fallback (python/tests/test_examples.py, GPUQ_TEST_REQUIRE_GPU=1). Output: patterns.txt ------
patterns_gpu() {
  local venv="${BUILD}/pyvenv" lim
  [[ -x "${venv}/bin/python" ]] || { echo "no venv: run the python stage first"; return 1; }
  "${venv}/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 77)' \
    || return $?
  lim="$(limit "${TEST_TIMEOUT}")"
  GPUQ_TEST_REQUIRE_GPU=1 GPUQ_GPUQD="${BUILD}/daemon/gpuqd" timeout -k 10 "${lim}" \
    "${venv}/bin/python" -m pytest -v -s -p no:cacheprovider -k "test_pattern_runs and default" \
    --junitxml="${OUT}/patterns.xml" "${ROOT}/python/tests/test_examples.py" 2>&1 \
    | tee "${OUT}/patterns.txt"
  return "${PIPESTATUS[0]}"
}
stage patterns patterns_gpu

# ---- batching: dynamic batching on a gpu Python pool (bench/python/bench_batching.py --gpu):
# 1, 8 and 32 client processes sending 1-row requests to a torch MLP on cuda, batched and not,
# in the python stage's venv. Output: batching-gpu.json and .txt.
batching_gpu() {
  local venv="${BUILD}/pyvenv" lim
  [[ -x "${venv}/bin/python" ]] || { echo "no venv: run the python stage first"; return 1; }
  "${venv}/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 77)' \
    || return $?
  lim="$(limit "${BENCH_TIMEOUT}")"
  GPUQ_GPUQD="${BUILD}/daemon/gpuqd" timeout -k 10 "${lim}" "${venv}/bin/python" \
    "${ROOT}/bench/python/bench_batching.py" --gpu --rounds 1 --duration 1.5 \
    --json "${OUT}/batching-gpu.json" 2>&1 | tee "${OUT}/batching-gpu.txt"
  return "${PIPESTATUS[0]}"
}
stage batching batching_gpu

# ---- pybench: a small torch model through a gpu Python pool from 1, 4 and 16 client processes
# against each process loading it on the GPU itself, and a torch no-op op against the same call
# in-process (bench/python/bench_gpu_python.py), in the python stage's venv. Output:
# gpu-python.json and .txt ----------------------------------------------------------------------
pybench() {
  local venv="${BUILD}/pyvenv" lim
  [[ -x "${venv}/bin/python" ]] || { echo "no venv: run the python stage first"; return 1; }
  lim="$(limit "${BENCH_TIMEOUT}")"
  # shellcheck disable=SC2086  # extra arguments, word-split on purpose
  GPUQ_GPUQD="${BUILD}/daemon/gpuqd" timeout -k 10 "${lim}" "${venv}/bin/python" \
    "${ROOT}/bench/python/bench_gpu_python.py" ${GPUQ_PYBENCH_ARGS:-} \
    --json "${OUT}/gpu-python.json" 2>&1 | tee "${OUT}/gpu-python.txt"
  return "${PIPESTATUS[0]}"
}
stage pybench pybench

# ---- rollout (named in GPUQ_DEVICE_STAGES only): p50/p99 call latency during rolling restarts of
# a 2-worker torch gpu pool (one surge seat) against steady state, and each rollout's duration
# (bench/python/bench_rollout.py --gpu), in the python stage's venv. Output: rollout-gpu.json
# and .txt ------------------------------------------------------------------------------------
rollout_gpu() {
  local venv="${BUILD}/pyvenv" lim
  [[ -x "${venv}/bin/python" ]] || { echo "no venv: run the python stage first"; return 1; }
  "${venv}/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 77)' \
    || return $?
  lim="$(limit "${BENCH_TIMEOUT}")"
  GPUQ_GPUQD="${BUILD}/daemon/gpuqd" timeout -k 10 "${lim}" "${venv}/bin/python" \
    "${ROOT}/bench/python/bench_rollout.py" --gpu --python "${venv}/bin/python" --clients 4 \
    --steady 5 --rollouts 3 --gap 2 --json "${OUT}/rollout-gpu.json" 2>&1 \
    | tee "${OUT}/rollout-gpu.txt"
  return "${PIPESTATUS[0]}"
}
stage rollout rollout_gpu

if ((failures > 0)); then exit 1; fi
