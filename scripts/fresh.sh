#!/usr/bin/env bash
# The README's run command on a clean Debian 12 (bookworm) root, as a new user would meet it:
# a minimal Debian root from Debian's packages, a clean `git clone` of the commit under test in
# /root/gpuq, and, inside the root, `bash scripts/setup.sh` and then `bash scripts/demo.sh`.
# Then the README's pip-only way in: the wheel of `bash scripts/build_wheel.sh`, built once in
# that root, installed into a venv in a second clean root that gets only python3 and
# python3-venv from apt (tests/package/wheel_test.sh: gpuqd from the venv, the quickstart, a
# Python pool with an @gpuq.op). scripts/test.sh runs it as its `fresh` stage; docs/testing.md
# describes it.
#
#   bash scripts/fresh.sh                                 # test HEAD
#   GPUQ_FRESH_REV=4a40420 bash scripts/fresh.sh          # test another commit
#   GPUQ_FRESH_TEST_STAGES="build" bash scripts/fresh.sh  # then also scripts/test.sh inside
#   GPUQ_FRESH_WHEEL=build-wheel/dist/gpuq-0.1.0-cp311-cp311-manylinux_2_34_x86_64.whl \
#     bash scripts/fresh.sh                               # only that wheel, in the second root
#
# Steps, each with its log in build-fresh/logs/<step>.log: base (the cached base tarball, made
# with mmdebstrap when missing or older than 14 days), unpack, clone, setup.sh, demo.sh, then
# warnings (the demo's output holds no compiler or CMake warning), wheel (scripts/build_wheel.sh
# in the root; its output holds no warning either), py-root (the second root: the base tarball
# unpacked anew, apt-get install python3 python3-venv), py-wheel (wheel_test.sh there) and, when
# asked, test.sh. The first step that fails is named, with the end of its log, and the roots are
# kept for a look (chroot build-fresh/root, build-fresh/py-root); after a pass they are removed.
#
# Inside the root, each step runs in its own mount and PID namespace (unshare): /proc, /sys
# (read-only), a small /dev with /dev/shm, and, in the first root only, /usr/local/cuda
# read-only when the host has it (the README assumes the CUDA toolkit there; everything else
# comes from setup.sh). Whatever a
# step starts ends with it, and its mounts vanish with the namespace. Of the host it gets only
# network settings: its resolv.conf, and its CA bundle as PIP_CERT for pip's downloads from
# PyPI (the demo's Python client), which matters where the host is behind a TLS-intercepting
# proxy.
#
# Needs root (chroot, mounts) and unshare; without them it exits 77, which test.sh counts as
# skipped. Exit status: 0 passed, 1 failed, 2 bad usage, 77 skipped.
#
# Environment:
#   GPUQ_FRESH_REV          the commit to test (default HEAD); uncommitted changes are never in it
#   GPUQ_FRESH_CACHE        base tarball and downloaded .debs, outside the tree (default
#                           ${XDG_CACHE_HOME:-$HOME/.cache}/gpuq-fresh)
#   GPUQ_FRESH_MIRROR       Debian mirror (default http://deb.debian.org/debian)
#   GPUQ_FRESH_STEP_TIMEOUT seconds each step may take (default 1200)
#   GPUQ_FRESH_TEST_STAGES  after the demo, also run `GPUQ_TEST_STAGES=... bash scripts/test.sh`
#                           inside (default: not run; `fresh` itself is refused there)
#   GPUQ_FRESH_WHEEL        a gpuq wheel (scripts/build_wheel.sh of the work tree, say) to test
#                           instead: only the steps base, py-root and py-wheel run, with
#                           wheel_test.sh and the quickstart of the work tree; a way to check a
#                           wheel before its commit exists
#   GPUQ_FRESH_KEEP=1       keep the roots after a pass too
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly ROOT="${PWD}"
readonly WORK="${ROOT}/build-fresh"
readonly ROOTFS="${WORK}/root"
readonly PYROOT="${WORK}/py-root"  # the second root: python3 and python3-venv only
readonly LOGS="${WORK}/logs"
readonly CACHE="${GPUQ_FRESH_CACHE:-${XDG_CACHE_HOME:-${HOME:-/var/tmp}/.cache}/gpuq-fresh}"
readonly MIRROR="${GPUQ_FRESH_MIRROR:-http://deb.debian.org/debian}"
readonly SUITE=bookworm
readonly BASE_TAR="${CACHE}/debian-${SUITE}-minbase.tar"
readonly BASE_MAX_AGE_DAYS=14
readonly STEP_TIMEOUT="${GPUQ_FRESH_STEP_TIMEOUT:-1200}"
readonly TEST_STAGES="${GPUQ_FRESH_TEST_STAGES:-}"
readonly GUEST_SRC=/root/gpuq
readonly GUEST_WHEEL_TEST=/root/wheel-test
given_wheel=""
if [[ -n "${GPUQ_FRESH_WHEEL:-}" ]]; then
  given_wheel=$(readlink -f "${GPUQ_FRESH_WHEEL}")
  if [[ ! -f "${given_wheel}" || "${given_wheel}" != *.whl ]]; then
    echo "fresh: GPUQ_FRESH_WHEEL '${GPUQ_FRESH_WHEEL}' is not a wheel file" >&2
    exit 2
  fi
fi
guest_pip_cert=""  # PIP_CERT in the root (the unpack step sets it)

skip() {
  echo "fresh: SKIPPED: $*" >&2
  exit 77
}

for s in ${TEST_STAGES}; do
  if [[ "${s}" == fresh || "${s}" == all ]]; then
    echo "fresh: GPUQ_FRESH_TEST_STAGES may not hold '${s}' (a fresh root inside a fresh root)" >&2
    exit 2
  fi
done

((EUID == 0)) || skip "needs root for chroot and mounts (run as root, or leave 'fresh' out of GPUQ_TEST_STAGES)"
command -v unshare >/dev/null || skip "unshare (util-linux) not found"
unshare --mount --pid --fork true 2>/dev/null ||
  skip "cannot make a mount and PID namespace here (unshare --mount --pid fails: a container without CAP_SYS_ADMIN?)"
command -v mmdebstrap >/dev/null || { echo "fresh: mmdebstrap not found: bash scripts/setup.sh installs it" >&2; exit 1; }

rev="${GPUQ_FRESH_REV:-HEAD}"
if ! sha=$(git -C "${ROOT}" rev-parse --verify --quiet "${rev}^{commit}"); then
  echo "fresh: GPUQ_FRESH_REV '${rev}' is not a commit of ${ROOT}" >&2
  exit 2
fi
if [[ -z "${given_wheel}" && "${rev}" == HEAD &&
  -n "$(git -C "${ROOT}" status --porcelain --untracked-files=no)" ]]; then
  echo "fresh: note: the work tree has uncommitted changes; they are not tested (a clean clone of HEAD is)"
fi

# ---- steps and their reports -------------------------------------------------------------------
current_step=""
step_start=0
step_pid=""  # the running in_root step (its `timeout` process)

# A step that fails names itself, shows the end of its log and leaves the root for a look.
on_exit() {
  local rc=$?
  trap - EXIT
  # Interrupted while a step runs in the root: stop it (timeout passes the signal on to unshare,
  # whose death kills the namespace's every process, --kill-child).
  if [[ -n "${step_pid}" ]] && kill -0 "${step_pid}" 2>/dev/null; then
    kill -TERM "${step_pid}" 2>/dev/null || true
    wait "${step_pid}" 2>/dev/null || true
  fi
  if ((rc != 0)) && [[ -n "${current_step}" ]]; then
    local log="${LOGS}/${current_step}.log"
    echo
    if ((rc == 130 || rc == 143)); then
      echo "fresh: interrupted in step '${current_step}' after $((SECONDS - step_start))s"
    else
      echo "fresh: FAILED in step '${current_step}' after $((SECONDS - step_start))s (exit ${rc})"
      rc=1
    fi
    if [[ -s "${log}" ]]; then
      echo "fresh: the end of its log (${log}):"
      tail -n 40 "${log}" | sed 's/^/  | /'
    fi
    local r
    for r in "${ROOTFS}" "${PYROOT}"; do
      [[ ! -d "${r}" ]] || echo "fresh: the root is kept for a look: chroot ${r}"
    done
  fi
  exit "${rc}"
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

begin() {
  current_step="$1"
  step_start=${SECONDS}
  printf 'fresh: %-9s ... ' "$1"
  : >"${LOGS}/$1.log"
}

end() {
  printf 'ok (%ds)%s\n' $((SECONDS - step_start)) "${1:+, $1}"
  current_step=""
}

# unmounted_below DIR: true when nothing is mounted at or below DIR (a root is only ever removed
# then; its mounts live in namespaces that are gone by now, but a removal through a bind mount of
# /dev or /usr/local/cuda must be impossible, not merely unlikely).
unmounted_below() {
  ! awk -v d="$1" '$5 == d || index($5, d "/") == 1 { found = 1 } END { exit !found }' \
    /proc/self/mountinfo
}

# remove_root DIR: a root of this script (ROOTFS or PYROOT).
remove_root() {
  [[ -e "$1" ]] || return 0
  if ! unmounted_below "$1"; then
    echo "fresh: something is still mounted below $1; not removing it" >&2
    return 1
  fi
  rm -rf --one-file-system "$1"
}

# unpack_root DIR LOG: the base tarball into DIR (a root left there is removed first), with the
# host's network settings.
unpack_root() {
  local r="$1" log="$2"
  remove_root "${r}"
  mkdir -p "${r}"
  tar -C "${r}" --numeric-owner -xf "${BASE_TAR}" >>"${log}" 2>&1
  # The host's resolver, so that apt-get in the root reaches the mirror.
  cp -L /etc/resolv.conf "${r}/etc/resolv.conf"
  # The host's CA bundle for pip (the demo installs the Python client's build tools from PyPI),
  # given to the steps as PIP_CERT: where the host reaches the internet through a
  # TLS-intercepting proxy, only the host's bundle holds that proxy's CA. Network settings, like
  # resolv.conf; no package comes with it. A user's machine reaches PyPI with its own.
  local host_ca="${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
  if [[ -f "${host_ca}" ]]; then
    mkdir -p "${r}/etc/gpuq-fresh"
    cp -L "${host_ca}" "${r}/etc/gpuq-fresh/host-ca.crt"
    guest_pip_cert=/etc/gpuq-fresh/host-ca.crt
  fi
}

# in_root LOG COMMAND: runs COMMAND (a bash command line) in the root, as root, in a clean
# environment and its own mount and PID namespace, appending its output to LOG.
in_root() {
  in_root_at "${ROOTFS}" "$@"
}

# in_root_at ROOT LOG COMMAND: in_root, in the root ROOT.
in_root_at() {
  local r="$1" log="$2" command="$3"
  local cuda=""
  # The host's CUDA toolkit goes to the README's root only; the python-only root gets nothing.
  [[ "${r}" != "${ROOTFS}" || ! -d /usr/local/cuda ]] || cuda=$(readlink -f /usr/local/cuda)
  # The namespace's first process sets up the mounts (private to it), then chroots.
  # shellcheck disable=SC2016
  timeout --signal=TERM --kill-after=30 "${STEP_TIMEOUT}" \
    unshare --mount --pid --fork --kill-child --propagation private -- \
    bash -euo pipefail -c '
      r="$1" cuda="$2" command="$3"
      mount -t proc -o nosuid,nodev,noexec proc "${r}/proc"
      mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "${r}/sys"
      mount -t tmpfs -o mode=755,nosuid tmpfs "${r}/dev"
      for d in null zero full random urandom tty; do
        touch "${r}/dev/${d}"
        mount --bind "/dev/${d}" "${r}/dev/${d}"
      done
      mkdir -m 1777 "${r}/dev/shm"
      mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "${r}/dev/shm"
      mkdir "${r}/dev/pts"
      mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "${r}/dev/pts"
      ln -s pts/ptmx "${r}/dev/ptmx"
      ln -s /proc/self/fd "${r}/dev/fd"
      ln -s /proc/self/fd/0 "${r}/dev/stdin"
      ln -s /proc/self/fd/1 "${r}/dev/stdout"
      ln -s /proc/self/fd/2 "${r}/dev/stderr"
      if [[ -n "${cuda}" ]]; then
        mkdir -p "${r}/usr/local/cuda"
        mount -o bind,ro "${cuda}" "${r}/usr/local/cuda"
      fi
      mount --bind "$4" "${r}/var/cache/apt/archives"
      extra=()
      [[ -z "$5" ]] || extra=("PIP_CERT=$5")
      exec chroot "${r}" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "${extra[@]}" \
        /bin/bash -c "${command}"
    ' fresh-root "${r}" "${cuda}" "${command}" "${CACHE}/archives" "${guest_pip_cert}" \
    </dev/null >>"${log}" 2>&1 &
  # In the background and waited for, so that a signal to this script is handled at once.
  step_pid=$!
  local rc=0
  wait "${step_pid}" || rc=$?
  step_pid=""
  ((rc != 124)) || echo "fresh: the step ran past GPUQ_FRESH_STEP_TIMEOUT (${STEP_TIMEOUT}s)" >>"${log}"
  return "${rc}"
}

mkdir -p "${WORK}" "${LOGS}" "${CACHE}/archives"
if [[ -n "${given_wheel}" ]]; then
  echo "fresh: the wheel ${given_wheel} in a clean Debian ${SUITE} root (${PYROOT}; cache ${CACHE})"
else
  echo "fresh: commit ${sha:0:12} in a clean Debian ${SUITE} root (${ROOTFS}; cache ${CACHE})"
fi

# ---- base: a minimal Debian 12 root, cached as a tarball ----------------------------------------
begin base
if [[ -f "${BASE_TAR}" ]] && [[ -z "$(find "${BASE_TAR}" -mtime +"${BASE_MAX_AGE_DAYS}")" ]]; then
  end "cached $(date -r "${BASE_TAR}" +%F)"
else
  # minbase: Essential and Priority required packages and apt, as in the Debian container image.
  # The sources are a Debian 12 machine's: the release, its updates and its security archive.
  security="${MIRROR%/debian}/debian-security"
  [[ "${MIRROR}" == */debian ]] || security="http://deb.debian.org/debian-security"
  mmdebstrap --variant=minbase --format=tar "${SUITE}" "${BASE_TAR}.part" \
    "deb ${MIRROR} ${SUITE} main" "deb ${MIRROR} ${SUITE}-updates main" \
    "deb ${security} ${SUITE}-security main" >>"${LOGS}/base.log" 2>&1
  mv -f "${BASE_TAR}.part" "${BASE_TAR}"
  end "made with mmdebstrap, $(du -h "${BASE_TAR}" | cut -f1)"
fi

# ---- the wheel in a second clean root: only python3 and python3-venv from apt -----------------
# wheel_steps WHEEL SRC: the steps py-root and py-wheel, with WHEEL, and wheel_test.sh and the
# quickstart from the tree SRC. Sets wheel_result (name, size, install time).
wheel_result=""
wheel_steps() {
  local wheel="$1" src="$2"
  begin py-root
  unpack_root "${PYROOT}" "${LOGS}/py-root.log"
  in_root_at "${PYROOT}" "${LOGS}/py-root.log" "set -e
    apt=(env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 -o Dpkg::Use-Pty=0)
    \"\${apt[@]}\" update -qq
    \"\${apt[@]}\" install -y -qq --no-install-recommends python3 python3-venv
    python3 --version"
  end "apt-get install python3 python3-venv: $(tail -n 1 "${LOGS}/py-root.log")"

  begin py-wheel
  local t="${PYROOT}${GUEST_WHEEL_TEST}"
  mkdir -p "${t}/tests/package" "${t}/examples/python"
  cp "${wheel}" "${t}/"
  cp "${src}/tests/package/wheel_test.sh" "${t}/tests/package/"
  cp "${src}/examples/python/quickstart.py" "${t}/examples/python/"
  # The root is what the README promises to need: no compiler, no CMake, no Boost, no oneDNN,
  # no CUDA.
  in_root_at "${PYROOT}" "${LOGS}/py-wheel.log" "set -e
    for c in cc c++ gcc g++ cmake; do
      if command -v \"\${c}\" >/dev/null; then echo \"fresh: \${c} is in the python-only root\"; exit 1; fi
    done
    if compgen -G '/usr/lib/*/libdnnl*' >/dev/null || [[ -e /usr/include/boost || -e /usr/local/cuda ]]; then
      echo 'fresh: oneDNN, Boost or CUDA is in the python-only root'; exit 1
    fi
    bash ${GUEST_WHEEL_TEST}/tests/package/wheel_test.sh ${GUEST_WHEEL_TEST}/$(basename "${wheel}")"
  local install_s
  install_s=$(sed -n 's/^wheel_test: installed in \([0-9.]*\) s.*/\1/p' "${LOGS}/py-wheel.log" | tail -1)
  wheel_result="$(basename "${wheel}"), $(stat -c %s "${wheel}") bytes ($(du -h "${wheel}" | cut -f1)), pip install ${install_s} s"
  end "${wheel_result}"
}

if [[ -n "${given_wheel}" ]]; then
  wheel_steps "${given_wheel}" "${ROOT}"
  if [[ "${GPUQ_FRESH_KEEP:-0}" == 1 ]]; then
    echo "fresh: root kept: chroot ${PYROOT}"
  else
    remove_root "${PYROOT}"
  fi
  echo "fresh: passed: on a clean Debian ${SUITE} root with only python3 and python3-venv, the wheel installs and runs (${wheel_result})"
  exit 0
fi

# ---- unpack ------------------------------------------------------------------------------------
begin unpack
unpack_root "${ROOTFS}" "${LOGS}/unpack.log"
end

# ---- clone -------------------------------------------------------------------------------------
begin clone
git clone --quiet --no-hardlinks --no-checkout "${ROOT}" "${ROOTFS}${GUEST_SRC}" \
  >>"${LOGS}/clone.log" 2>&1
git -C "${ROOTFS}${GUEST_SRC}" -c advice.detachedHead=false checkout --quiet "${sha}" \
  >>"${LOGS}/clone.log" 2>&1
end "$(git -C "${ROOTFS}${GUEST_SRC}" log -1 --format='%h %s' | cut -c1-60)"

# ---- the README's commands ---------------------------------------------------------------------
begin setup.sh
in_root "${LOGS}/setup.sh.log" "cd ${GUEST_SRC} && bash scripts/setup.sh"
end "$(grep -E '^setup: (installed|all)' "${LOGS}/setup.sh.log" | tail -1)"

begin demo.sh
in_root "${LOGS}/demo.sh.log" "cd ${GUEST_SRC} && bash scripts/demo.sh"
end "$(grep -E '^demo: OK' "${LOGS}/demo.sh.log" | tail -1)"

# A new user's run command prints no warning: a compiler's, nvcc's or CMake's.
begin warnings
readonly WARNING_RE=': warning[: ]|warning #|CMake Warning'
if grep -nE "${WARNING_RE}" "${LOGS}/demo.sh.log" >"${LOGS}/warnings.log"; then
  # The places in the tree they point at (a warning from a header names the including lines
  # just above it).
  {
    echo "demo.sh printed $(wc -l <"${LOGS}/warnings.log") warnings (${LOGS}/demo.sh.log), from:"
    grep -B12 -E "${WARNING_RE}" "${LOGS}/demo.sh.log" |
      grep -oE "${GUEST_SRC}/[^ :,]+(:[0-9]+)?" | sed "s|^${GUEST_SRC}/|  |" | sort -u
  } >>"${LOGS}/warnings.log"
  false
fi
end "none in the demo's output"

# ---- the README's pip-only way in: build the wheel once, install it in a python-only root -----
begin wheel
in_root "${LOGS}/wheel.log" "cd ${GUEST_SRC} && bash scripts/build_wheel.sh"
if grep -nE "${WARNING_RE}" "${LOGS}/wheel.log" >"${LOGS}/wheel-warnings.log"; then
  echo "fresh: scripts/build_wheel.sh printed $(wc -l <"${LOGS}/wheel-warnings.log") warnings:" \
    >>"${LOGS}/wheel.log"
  cat "${LOGS}/wheel-warnings.log" >>"${LOGS}/wheel.log"
  false
fi
built=$(sed -n 's|^wheel: \(/[^ ]*/gpuq-[^ /]*\.whl\) [0-9]*$|\1|p' "${LOGS}/wheel.log" | tail -1)
[[ -n "${built}" && -f "${ROOTFS}${built}" ]] || { echo "fresh: no wheel: line in the log" >>"${LOGS}/wheel.log"; false; }
mkdir -p "${WORK}/wheel"
rm -f "${WORK}/wheel/"*.whl
cp "${ROOTFS}${built}" "${WORK}/wheel/"
wheel="${WORK}/wheel/$(basename "${built}")"
end "$(basename "${wheel}"), $(du -h "${wheel}" | cut -f1)"

wheel_steps "${wheel}" "${ROOTFS}${GUEST_SRC}"

if [[ -n "${TEST_STAGES}" ]]; then
  begin test.sh
  in_root "${LOGS}/test.sh.log" \
    "cd ${GUEST_SRC} && GPUQ_TEST_STAGES='${TEST_STAGES}' bash scripts/test.sh"
  end "$(grep -E '^tests: ' "${LOGS}/test.sh.log" | tail -1)"
fi

echo "fresh: what the demo client printed in the root:"
sed -n '/^==> gpuq_demo/,/^==> gpuqctl status/p' "${LOGS}/demo.sh.log" | sed '$d' | sed 's/^/  | /'
grep -E '^demo: ' "${LOGS}/demo.sh.log" | tail -n 1 | sed 's/^/  | /'
echo "fresh: the wheel: ${wheel_result}"
if [[ "${GPUQ_FRESH_KEEP:-0}" == 1 ]]; then
  echo "fresh: roots kept: chroot ${ROOTFS}, chroot ${PYROOT}"
else
  remove_root "${ROOTFS}"
  remove_root "${PYROOT}"
fi
echo "fresh: passed: on a clean Debian ${SUITE} root, 'bash scripts/setup.sh && bash scripts/demo.sh' works, and so does the wheel with only python3 and python3-venv"
