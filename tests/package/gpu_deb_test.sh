#!/usr/bin/env bash
# The GPU package test (scripts/test.sh stage `package`; scripts/device_check.sh stage `deb`;
# docs/service.md, "The GPU package"):
#   1. `cpack -G DEB` in BUILD_DIR makes gpuq-gpu_*.deb beside gpuq_*.deb: gpuq-gpu-worker in
#      /usr/libexec/gpuq and gpuq-gpu-probe in /usr/bin, nothing else, depending on gpuq of the
#      same version;
#   2. both packages unpacked (dpkg-deb -x) into a scratch root: with the loader's cache ignored
#      (ld.so --inhibit-cache, so no ld.so.conf entry of this machine counts) every library the
#      two GPU binaries need resolves, the CUDA ones through their own RUNPATH;
#   3. where nvidia-smi lists a GPU: the unpacked gpuq-gpu-probe runs under that loader and sees
#      a device, and the unpacked gpuqd (no LD_LIBRARY_PATH) starts a gpu pool with the unpacked
#      gpuq-gpu-worker and runs a gemm and a conv2d on it (gpuqctl submit --pool gpu). Without
#      a GPU this step is skipped and said so; steps 1 and 2 still count.
# Exit 77 (skipped) when the build has no CUDA parts (no gpuq-gpu-worker) or dpkg-deb is missing.
#
#   bash tests/package/gpu_deb_test.sh BUILD_DIR
# Environment: GPUQ_CPACK_ARGS (word-split, e.g. "-D CPACK_DEBIAN_MAIN_PACKAGE_SHLIBDEPS=OFF"
# where dpkg-shlibdeps is missing: the lent GPU machine).
set -euo pipefail

BUILD="$(cd "${1:?usage: gpu_deb_test.sh BUILD_DIR}" && pwd)"
readonly BUILD

fail() {
  echo "gpu_deb_test: FAILED: $*" >&2
  exit 1
}
step() { echo "gpu_deb_test: $*"; }

if [[ ! -x "${BUILD}/daemon/gpuq-gpu-worker" ]]; then
  echo "gpu_deb_test: SKIPPED: ${BUILD} has no gpuq-gpu-worker (a build without the CUDA parts)"
  exit 77
fi
for tool in cpack dpkg-deb readelf; do
  command -v "${tool}" >/dev/null || { echo "gpu_deb_test: SKIPPED: no ${tool}"; exit 77; }
done
LOADER=""
for l in /lib64/ld-linux-x86-64.so.2 /lib/ld-linux-aarch64.so.1; do
  [[ -x "${l}" ]] && LOADER="${l}" && break
done
[[ -n "${LOADER}" ]] || fail "no dynamic loader found to run with --inhibit-cache"

TMP="$(mktemp -d /tmp/gpuq-gpu-deb-XXXXXX)"
readonly TMP
daemon_pid=""
cleanup() {
  local rc=$?
  if [[ -n "${daemon_pid}" ]] && kill -0 "${daemon_pid}" 2>/dev/null; then
    kill -KILL "${daemon_pid}" 2>/dev/null || true
    wait "${daemon_pid}" 2>/dev/null || true
  fi
  if ((rc != 0)) && [[ -f "${TMP}/gpuqd.log" ]]; then
    echo "---- unpacked gpuqd's log ----" >&2
    tail -n 40 "${TMP}/gpuqd.log" >&2
  fi
  rm -rf "${TMP}"
  exit "${rc}"
}
trap cleanup EXIT

# ---- 1. the packages ---------------------------------------------------------------------------
rm -f "${BUILD}"/packages/gpuq_*.deb "${BUILD}"/packages/gpuq-gpu_*.deb
step "cpack -G DEB in ${BUILD}"
# shellcheck disable=SC2086
(cd "${BUILD}" && cpack -G DEB ${GPUQ_CPACK_ARGS:-} >"${TMP}/cpack.log" 2>&1) ||
  { cat "${TMP}/cpack.log" >&2; fail "cpack -G DEB"; }
main=("${BUILD}"/packages/gpuq_*.deb)
gpu=("${BUILD}"/packages/gpuq-gpu_*.deb)
[[ -f "${main[0]}" && ${#main[@]} -eq 1 ]] || fail "cpack made no single gpuq_*.deb"
[[ -f "${gpu[0]}" && ${#gpu[@]} -eq 1 ]] || fail "cpack made no single gpuq-gpu_*.deb"
readonly MAIN="${main[0]}" GPU="${gpu[0]}"
step "built $(basename "${MAIN}") and $(basename "${GPU}") ($(du -k "${GPU}" | cut -f1) KiB)"
version=$(dpkg-deb -f "${MAIN}" Version)
[[ "$(dpkg-deb -f "${GPU}" Package)" == gpuq-gpu ]] || fail "the GPU package is not named gpuq-gpu"
[[ "$(dpkg-deb -f "${GPU}" Version)" == "${version}" ]] ||
  fail "gpuq-gpu's version $(dpkg-deb -f "${GPU}" Version) is not gpuq's ${version}"
depends=$(dpkg-deb -f "${GPU}" Depends)
[[ "${depends}" == "gpuq (= ${version})" ]] || fail "gpuq-gpu depends on '${depends}'"
files=$(dpkg-deb -c "${GPU}" | awk '{print $6}' | grep -v '/$' | sed 's|^\./|/|' | sort | tr '\n' ' ')
[[ "${files}" == "/usr/bin/gpuq-gpu-probe /usr/libexec/gpuq/gpuq-gpu-worker " ]] ||
  fail "gpuq-gpu holds ${files}"
if dpkg-deb -c "${MAIN}" | grep -q 'gpuq-gpu'; then fail "gpuq holds a GPU binary"; fi

# ---- 2. unpacked: the loader finds every library without its cache -----------------------------
readonly ROOT_DIR="${TMP}/root"
dpkg-deb -x "${MAIN}" "${ROOT_DIR}"
dpkg-deb -x "${GPU}" "${ROOT_DIR}"
for f in "${ROOT_DIR}/usr/libexec/gpuq/gpuq-gpu-worker" "${ROOT_DIR}/usr/bin/gpuq-gpu-probe"; do
  runpath=$(readelf -d "${f}" | sed -n 's/.*Library runpath: \[\(.*\)\]/\1/p')
  [[ -n "${runpath}" ]] || fail "${f##*/} from the package has no RUNPATH"
  listing=$(env -u LD_LIBRARY_PATH "${LOADER}" --inhibit-cache --list "${f}" 2>&1) ||
    fail "the loader (cache ignored) cannot load ${f##*/} from the package: ${listing}"
  if grep -q 'not found' <<<"${listing}"; then
    fail "${f##*/} from the package, cache ignored, misses: $(grep 'not found' <<<"${listing}")"
  fi
  step "${f##*/}: RUNPATH ${runpath}; cache ignored: $(grep -oE '(libcudart|libcublas|libcudnn)\.so[.0-9]* => [^ ]+' <<<"${listing}" | tr '\n' ' ')"
done

# ---- 3. on a GPU: the unpacked binaries run ------------------------------------------------------
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  step "no GPU (nvidia-smi lists none): the unpacked binaries were not run"
  step "ok (package and loader checks)"
  exit 0
fi
probe=$(env -u LD_LIBRARY_PATH "${LOADER}" --inhibit-cache "${ROOT_DIR}/usr/bin/gpuq-gpu-probe" 2>&1) ||
  fail "the unpacked gpuq-gpu-probe, cache ignored, failed: ${probe}"
step "gpuq-gpu-probe (cache ignored): $(head -n 3 <<<"${probe}" | tr '\n' ' ')"
cat >"${TMP}/gpuqd.json" <<'EOF'
{"pools": [{"name": "cpu", "kind": "cpu", "workers": 1},
           {"name": "gpu", "kind": "gpu", "gpus": "all", "workers_per_gpu": 1}]}
EOF
readonly RUNDIR="${TMP}/run"
mkdir -p "${RUNDIR}"
env -u LD_LIBRARY_PATH "${ROOT_DIR}/usr/bin/gpuqd" --config "${TMP}/gpuqd.json" \
  --runtime-dir "${RUNDIR}" >"${TMP}/gpuqd.log" 2>&1 &
daemon_pid=$!
ctl() { env -u LD_LIBRARY_PATH GPUQ_RUNTIME_DIR="${RUNDIR}" "${ROOT_DIR}/usr/bin/gpuqctl" "$@"; }
ready=0
for _ in $(seq 600); do
  kill -0 "${daemon_pid}" 2>/dev/null || fail "the unpacked gpuqd exited while starting"
  if ctl ready >/dev/null 2>&1; then
    ready=1
    break
  fi
  sleep 0.05
done
((ready)) || fail "the unpacked gpuqd's pools did not get ready in 30 s: $(ctl ready 2>&1)"
ctl status
head -c $((64 * 64 * 4)) /dev/urandom >"${TMP}/a.bin"
cp "${TMP}/a.bin" "${TMP}/b.bin"
out=$(ctl submit gemm --pool gpu --input "${TMP}/a.bin" --input "${TMP}/b.bin" \
  --param a=64x64 --param b=64x64 --count 20 2>&1) || fail "gemm on the gpu pool: ${out}"
step "gemm 64x64 on the unpacked gpuq-gpu-worker: ${out//$'\n'/ }"
head -c $((1 * 3 * 16 * 16 * 4)) /dev/urandom >"${TMP}/x.bin"
head -c $((8 * 3 * 3 * 3 * 4)) /dev/urandom >"${TMP}/w.bin"
out=$(ctl submit conv2d --pool gpu --input "${TMP}/x.bin" --input "${TMP}/w.bin" \
  --param x=1x3x16x16 --param w=8x3x3x3 --param pad=1x1 2>&1) || fail "conv2d on the gpu pool: ${out}"
step "conv2d on the unpacked gpuq-gpu-worker: ${out//$'\n'/ }"
pids=$(ctl status --json | python3 -c 'import json, sys
d = json.load(sys.stdin)
print(" ".join(str(w["pid"]) for p in d["pools"] if p["name"] == "gpu" for w in p["workers"]))')
[[ -n "${pids}" ]] || fail "the gpu pool has no worker in gpuqctl status --json"
for pid in ${pids}; do
  exe=$(readlink "/proc/${pid}/exe")
  [[ "${exe}" == "${ROOT_DIR}/usr/libexec/gpuq/gpuq-gpu-worker" ]] ||
    fail "gpu worker ${pid} runs ${exe}, not the unpacked gpuq-gpu-worker"
  if tr '\0' '\n' <"/proc/${pid}/environ" | grep -q '^LD_LIBRARY_PATH='; then
    fail "gpu worker ${pid} has an LD_LIBRARY_PATH"
  fi
done
step "gpu workers ${pids} run ${ROOT_DIR##*/}/usr/libexec/gpuq/gpuq-gpu-worker, no LD_LIBRARY_PATH"
ctl stop >/dev/null || fail "gpuqctl stop"
rc=0
wait "${daemon_pid}" || rc=$?
daemon_pid=""
((rc == 0)) || fail "the unpacked gpuqd exited with status ${rc} after gpuqctl stop"
step "ok (package, loader, and a gemm and a conv2d on the GPU through the unpacked binaries)"
