#!/usr/bin/env bash
# Install-and-consume test (scripts/test.sh stage `package`; docs/service.md):
#   1. `cmake --install BUILD --prefix <temp>` and check the layout (binaries, libexec worker,
#      shared and static library, headers, CMake package, gpuq.pc, unit, sysusers.d, config);
#   2. build examples/consumer against that prefix with CMake (find_package(gpuq), shared and
#      static) and with pkg-config (its Makefile);
#   3. start the installed gpuqd (installed config minus its gpuq-group keys, --runtime-dir in
#      the temp dir), run the three consumers against it, check `gpuqctl status`, stop it with
#      `gpuqctl stop` and require exit status 0.
# Leaves nothing behind (a trap removes the temp dir and stops the daemon).
#
#   bash tests/package/install_test.sh BUILD_DIR
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="$(cd "${1:?usage: install_test.sh BUILD_DIR}" && pwd)"
readonly ROOT BUILD
readonly JOBS="${GPUQ_BUILD_JOBS:-$(nproc)}"

TMP="$(mktemp -d /tmp/gpuq-install-XXXXXX)"
readonly TMP
daemon_pid=""
cleanup() {
  local rc=$?
  if [[ -n "${daemon_pid}" ]] && kill -0 "${daemon_pid}" 2>/dev/null; then
    kill -TERM "${daemon_pid}" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "${daemon_pid}" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "${daemon_pid}" 2>/dev/null || true
  fi
  if ((rc != 0)) && [[ -f "${TMP}/gpuqd.log" ]]; then
    echo "---- installed gpuqd's log ----" >&2
    tail -n 50 "${TMP}/gpuqd.log" >&2
  fi
  rm -rf "${TMP}"
  exit "${rc}"
}
trap cleanup EXIT

fail() {
  echo "install_test: FAILED: $*" >&2
  exit 1
}
step() { echo "install_test: $*"; }

# ---- 1. install into a temporary prefix ----------------------------------------------------------
readonly PREFIX="${TMP}/prefix"
step "cmake --install ${BUILD} --prefix ${PREFIX}"
cmake --install "${BUILD}" --prefix "${PREFIX}" >"${TMP}/install.log" ||
  { cat "${TMP}/install.log" >&2; fail "cmake --install"; }

# The directories as the build tree's GNUInstallDirs chose them.
cache_value() { sed -n "s/^$1:[A-Z]*=//p" "${BUILD}/CMakeCache.txt"; }
LIBDIR="${PREFIX}/$(cache_value CMAKE_INSTALL_LIBDIR)"
LIBEXECDIR="${PREFIX}/$(cache_value CMAKE_INSTALL_LIBEXECDIR)"
readonly LIBDIR LIBEXECDIR
for f in bin/gpuqd bin/gpuqctl; do
  [[ -x "${PREFIX}/${f}" ]] || fail "${f} is not installed"
done
[[ -x "${LIBEXECDIR}/gpuq/gpuq-worker" ]] || fail "gpuq-worker is not in ${LIBEXECDIR}/gpuq"
for f in "${LIBDIR}/libgpuq.so" "${LIBDIR}/libgpuq.a" "${LIBDIR}/cmake/gpuq/gpuqConfig.cmake" \
  "${LIBDIR}/cmake/gpuq/gpuqConfigVersion.cmake" "${LIBDIR}/pkgconfig/gpuq.pc" \
  "${PREFIX}/include/gpuq/client.hpp" "${PREFIX}/include/gpuq/gpuq.h" \
  "${PREFIX}/lib/systemd/system/gpuqd.service" "${PREFIX}/lib/sysusers.d/gpuq.conf" \
  "${PREFIX}/etc/gpuq/gpuqd.json" "${PREFIX}/share/doc/gpuq/service.md"; do
  [[ -f "${f}" ]] || fail "${f#"${PREFIX}"/} is not installed"
done
# No internal header leaks out: only libclient/include/gpuq/ is public.
[[ ! -e "${PREFIX}/include/gpuq/common" ]] || fail "internal headers were installed"
# The unit points at the installed daemon and config.
grep -qx "ExecStart=${PREFIX}/bin/gpuqd --config ${PREFIX}/etc/gpuq/gpuqd.json" \
  "${PREFIX}/lib/systemd/system/gpuqd.service" || fail "the installed unit's ExecStart is wrong"
grep -q '^gpuqd ' <<<"$("${PREFIX}/bin/gpuqd" --version)" || fail "installed gpuqd --version"
# The static library stands alone: it holds gpuq_common's objects too.
# (Pipelines into `grep -q` are checked on captured output: with pipefail, grep's early exit
# would fail the pipeline through SIGPIPE.)
members=$(ar t "${LIBDIR}/libgpuq.a")
grep -qx 'runtime_dir.cpp.o' <<<"${members}" || fail "libgpuq.a lacks gpuq_common's objects"
# The GPU binaries (component gpu, in a build with CUDA) find CUDA, cuBLAS and cuDNN through
# their own RUNPATH, not through the build tree or an ld.so.conf entry this machine happens to
# have: each CUDA library they need is in one of their RUNPATH folders.
for f in "${LIBEXECDIR}/gpuq/gpuq-gpu-worker" "${PREFIX}/bin/gpuq-gpu-probe"; do
  [[ -e "${f}" ]] || continue
  dyn=$(readelf -d "${f}")
  runpath=$(sed -n 's/.*Library runpath: \[\(.*\)\]/\1/p' <<<"${dyn}")
  while read -r lib; do
    found=0
    IFS=: read -ra dirs <<<"${runpath}"
    for d in "${dirs[@]}"; do
      [[ -n "${d}" && -e "${d}/${lib}" ]] && found=1
    done
    ((found)) || fail "installed ${f##*/} needs ${lib}, in none of its RUNPATH folders (${runpath:-none})"
  done < <(sed -n 's/.*Shared library: \[\(lib\(cudart\|cublas\|cublasLt\|cudnn\)[^]]*\)\]/\1/p' <<<"${dyn}")
done
step "layout ok"

# ---- 2. build the consumer against the installed package -------------------------------------
step "consumer: CMake find_package(gpuq)"
cmake -S "${ROOT}/examples/consumer" -B "${TMP}/consumer-cmake" -DCMAKE_PREFIX_PATH="${PREFIX}" \
  -DCMAKE_BUILD_TYPE=Release >"${TMP}/consumer-cmake.log" 2>&1 ||
  { cat "${TMP}/consumer-cmake.log" >&2; fail "configuring examples/consumer"; }
cmake --build "${TMP}/consumer-cmake" -j "${JOBS}" >>"${TMP}/consumer-cmake.log" 2>&1 ||
  { cat "${TMP}/consumer-cmake.log" >&2; fail "building examples/consumer with CMake"; }

step "consumer: pkg-config"
mkdir -p "${TMP}/consumer-pc"
PKG_CONFIG_PATH="${LIBDIR}/pkgconfig" make -s -C "${ROOT}/examples/consumer" \
  OUT="${TMP}/consumer-pc" LDFLAGS="-Wl,-rpath,${LIBDIR}" >"${TMP}/consumer-pc.log" 2>&1 ||
  { cat "${TMP}/consumer-pc.log" >&2; fail "building examples/consumer with pkg-config"; }
# The shared builds use the installed libgpuq.so, the static one none.
grep -q "${LIBDIR}/libgpuq.so" <<<"$(ldd "${TMP}/consumer-cmake/gpuq_consumer")" ||
  fail "the CMake consumer does not load ${LIBDIR}/libgpuq.so"
grep -q "${LIBDIR}/libgpuq.so" <<<"$(ldd "${TMP}/consumer-pc/gpuq_consumer")" ||
  fail "the pkg-config consumer does not load ${LIBDIR}/libgpuq.so"
if grep -q libgpuq <<<"$(ldd "${TMP}/consumer-cmake/gpuq_consumer_static")"; then
  fail "the static consumer loads libgpuq.so"
fi

# ---- 3. run them against the installed daemon ---------------------------------------------------
# The installed config, unchanged except for its gpuq-group keys (the gpuq group exists only
# once the package made it; deb_test.sh checks the file as it is).
python3 - "${PREFIX}/etc/gpuq/gpuqd.json" "${TMP}/gpuqd.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
for k in ("group", "allowed_groups", "allowed_users"):
    c.pop(k, None)
json.dump(c, open(sys.argv[2], "w"))
PY
readonly RUNDIR="${TMP}/run"
step "starting the installed gpuqd (runtime dir ${RUNDIR})"
"${PREFIX}/bin/gpuqd" --config "${TMP}/gpuqd.json" --runtime-dir "${RUNDIR}" \
  >"${TMP}/gpuqd.log" 2>&1 &
daemon_pid=$!
export GPUQ_RUNTIME_DIR="${RUNDIR}"
ready=0
for _ in $(seq 200); do
  kill -0 "${daemon_pid}" 2>/dev/null || fail "the installed gpuqd exited while starting"
  if status=$("${PREFIX}/bin/gpuqctl" status --json 2>/dev/null) &&
    python3 -c 'import json,sys; d=json.loads(sys.argv[1]); sys.exit(0 if all(p["workers_ready"]==p["workers_total"] for p in d["pools"]) else 1)' "${status}"; then
    ready=1
    break
  fi
  sleep 0.05
done
((ready)) || fail "the installed gpuqd's workers did not get ready in 10 s"
# It runs the installed worker, not one from the build tree.
worker_pid=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["pools"][0]["workers"][0]["pid"])' "${status}")
worker_exe=$(readlink -f "/proc/${worker_pid}/exe")
[[ "${worker_exe}" == "$(readlink -f "${LIBEXECDIR}/gpuq/gpuq-worker")" ]] ||
  fail "the installed gpuqd runs ${worker_exe}, not ${LIBEXECDIR}/gpuq/gpuq-worker"

for c in consumer-cmake/gpuq_consumer consumer-cmake/gpuq_consumer_static \
  consumer-pc/gpuq_consumer; do
  step "running ${c}"
  "${TMP}/${c}" --jobs 500 || fail "${c} failed"
done
"${PREFIX}/bin/gpuqctl" status >/dev/null || fail "gpuqctl status"
"${PREFIX}/bin/gpuqctl" stop >/dev/null || fail "gpuqctl stop"
rc=0
wait "${daemon_pid}" || rc=$?
daemon_pid=""
((rc == 0)) || fail "the installed gpuqd exited with status ${rc} after gpuqctl stop"
step "ok"
