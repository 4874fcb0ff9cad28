#!/usr/bin/env bash
# gpuq's run command (README): installs what is missing (scripts/setup.sh), builds gpuqd, its
# workers, gpuqctl and the demo client (Release, in build/), starts the daemon with its built-in
# defaults (no config file) in a private runtime directory, runs the demo client, installs the
# Python client into a new venv (build/python-venv: pip install ./python, from PyPI nanobind,
# scikit-build-core and numpy) and runs examples/python/quickstart.py, shows the daemon's
# status, stops the daemon and checks that it exited cleanly.
#
#   bash scripts/demo.sh
#
# Environment:
#   GPUQ_DEMO_JOBS           jobs per op for the demo client (default 5000)
#   GPUQ_DEMO_START_TIMEOUT  seconds to wait for the daemon to answer (default 60: GPU workers
#                            create their CUDA contexts before the daemon is ready)
#   GPUQ_DEMO_STOP_TIMEOUT   seconds to wait for the daemon to drain and exit (default 60)
#   GPUQ_BUILD_JOBS          parallel compile jobs (default: nproc)
#   GPUQ_DEMO_PYTHON         the interpreter of the Python client's venv (default /usr/bin/python3,
#                            else python3 on PATH); "none" skips the Python part
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly ROOT="${PWD}"

# shellcheck source=scripts/setup.sh
source scripts/setup.sh

readonly JOBS="${GPUQ_DEMO_JOBS:-5000}"
readonly START_TIMEOUT="${GPUQ_DEMO_START_TIMEOUT:-60}"
readonly STOP_TIMEOUT="${GPUQ_DEMO_STOP_TIMEOUT:-60}"
readonly BUILD_JOBS="${GPUQ_BUILD_JOBS:-$(nproc)}"
readonly GPUQD="${ROOT}/build/daemon/gpuqd"
readonly WORKER="${ROOT}/build/daemon/gpuq-worker"
readonly GPUQCTL="${ROOT}/build/tools/gpuqctl"
readonly DEMO="${ROOT}/build/examples/gpuq_demo"

step() { printf '\n==> %s\n' "$*"; }

# ---- cleanup: whatever happens, no daemon outlives this script --------------------------------
tmp=""
runtime_dir=""
daemon_log=""
daemon_pid=""

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [[ -n "${daemon_pid}" ]] && kill -0 "${daemon_pid}" 2>/dev/null; then
    echo "demo: stopping gpuqd (pid ${daemon_pid})" >&2
    kill -TERM "${daemon_pid}" 2>/dev/null || true
    local deadline=$((SECONDS + 10))
    while kill -0 "${daemon_pid}" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    kill -KILL "${daemon_pid}" 2>/dev/null || true
    wait "${daemon_pid}" 2>/dev/null || true
  fi
  # A daemon that was killed cannot remove its queue segment; its runtime dir names it.
  if [[ -n "${runtime_dir}" && -f "${runtime_dir}/queue-segment" ]]; then
    local seg
    seg=$(head -c 255 "${runtime_dir}/queue-segment")
    seg="${seg#/}"
    if [[ "${seg}" =~ ^[A-Za-z0-9._-]+$ && -e "/dev/shm/${seg}" ]]; then
      rm -f "/dev/shm/${seg}"
    fi
  fi
  if ((rc != 0)); then
    if [[ -n "${daemon_log}" && -s "${daemon_log}" ]]; then
      echo "demo: last lines of the daemon log (${daemon_log}):" >&2
      tail -n 40 "${daemon_log}" | sed 's/^/  | /' >&2
    fi
    echo "demo: FAILED (exit ${rc}); files kept in ${tmp:-<none>}" >&2
  elif [[ -n "${tmp}" ]]; then
    rm -rf "${tmp}"
  fi
  exit "${rc}"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---- build -------------------------------------------------------------------------------------
step "building gpuq (Release) in build/: gpuqd, its workers, gpuqctl and the demo client"
# build/ is shared with scripts/test.sh, which builds it RelWithDebInfo with -Werror: switching
# recompiles. The demo turns -Werror off so a new compiler's warning cannot stop it, and builds
# only what it runs (not the tests and benchmarks: `cmake --build build` builds everything).
gen=()
if [[ ! -f build/CMakeCache.txt ]] && command -v ninja >/dev/null 2>&1; then gen=(-G Ninja); fi
cmake -S "${ROOT}" -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGPUQ_BUILD_EXAMPLES=ON \
  -DGPUQ_WERROR=OFF -DGPUQ_SANITIZE=
targets=(gpuqd gpuq-worker gpuqctl gpuq_demo)
# The GPU worker exists in a build with CUDA, cuBLAS and cuDNN (GPUQ_WITH_CUDA=AUTO); gpuqd runs
# it for GPU pools when the machine has a GPU. grep reads the whole list (no -q): under pipefail
# an early exit could fail cmake with SIGPIPE and hide the target.
if cmake --build build --target help | grep -w gpuq-gpu-worker >/dev/null; then
  targets+=(gpuq-gpu-worker)
fi
cmake --build build -j "${BUILD_JOBS}" --target "${targets[@]}"
for bin in "${GPUQD}" "${WORKER}" "${GPUQCTL}" "${DEMO}"; do
  [[ -x "${bin}" ]] || { echo "demo: ${bin} was not built" >&2; exit 1; }
done

# ---- start the daemon --------------------------------------------------------------------------
# A short path under /tmp: the control socket's path must fit in sockaddr_un (108 bytes).
tmp=$(mktemp -d /tmp/gpuq-demo.XXXXXX)
runtime_dir="${tmp}/run"
daemon_log="${tmp}/gpuqd.log"
ctl=("${GPUQCTL}" --runtime-dir "${runtime_dir}")

step "starting gpuqd (built-in defaults, runtime dir ${runtime_dir}, log ${daemon_log})"
"${GPUQD}" --runtime-dir "${runtime_dir}" >"${daemon_log}" 2>&1 &
daemon_pid=$!

deadline=$((SECONDS + START_TIMEOUT))
until "${ctl[@]}" status >/dev/null 2>&1; do
  if ! kill -0 "${daemon_pid}" 2>/dev/null; then
    rc=0
    wait "${daemon_pid}" || rc=$?
    daemon_pid=""
    echo "demo: gpuqd exited with status ${rc} before it answered" >&2
    exit 1
  fi
  if ((SECONDS >= deadline)); then
    echo "demo: gpuqd did not answer 'gpuqctl status' within ${START_TIMEOUT}s" >&2
    exit 1
  fi
  sleep 0.05
done
echo "gpuqd is up (pid ${daemon_pid})"

# ---- use it ------------------------------------------------------------------------------------
step "gpuq_demo --jobs ${JOBS}"
"${DEMO}" --runtime-dir "${runtime_dir}" --jobs "${JOBS}"

python="${GPUQ_DEMO_PYTHON:-}"
if [[ -z "${python}" ]]; then
  if [[ -x /usr/bin/python3 ]]; then python=/usr/bin/python3; else python=python3; fi
fi
if [[ "${python}" != none ]]; then
  step "the Python client: pip install ./python into build/python-venv, then examples/python/quickstart.py"
  venv="${ROOT}/build/python-venv"
  [[ -x "${venv}/bin/python" ]] || "${python}" -m venv "${venv}"
  CMAKE_BUILD_PARALLEL_LEVEL="${BUILD_JOBS}" PIP_DISABLE_PIP_VERSION_CHECK=1 \
    "${venv}/bin/python" -m pip install -q "${ROOT}/python"
  GPUQ_RUNTIME_DIR="${runtime_dir}" "${venv}/bin/python" "${ROOT}/examples/python/quickstart.py"
fi

step "gpuqctl status"
"${ctl[@]}" status

# ---- stop it -----------------------------------------------------------------------------------
step "gpuqctl stop"
"${ctl[@]}" stop

deadline=$((SECONDS + STOP_TIMEOUT))
while kill -0 "${daemon_pid}" 2>/dev/null; do
  if ((SECONDS >= deadline)); then
    echo "demo: gpuqd did not exit within ${STOP_TIMEOUT}s of 'gpuqctl stop'" >&2
    exit 1
  fi
  sleep 0.05
done
rc=0
wait "${daemon_pid}" || rc=$?
daemon_pid=""
if ((rc != 0)); then
  echo "demo: gpuqd exited with status ${rc}, expected 0" >&2
  exit 1
fi

step "daemon log (last 60 lines)"
tail -n 60 "${daemon_log}" | sed 's/^/  | /'
echo
echo "demo: OK (gpuqd exited with status 0)"
