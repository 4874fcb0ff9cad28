#!/usr/bin/env bash
# The README's run command on a clean Debian 12 (bookworm) root, as a new user would meet it:
# a minimal Debian root from Debian's packages, a clean `git clone` of the commit under test in
# /root/gpuq, and, inside the root, `bash scripts/setup.sh` and then `bash scripts/demo.sh`.
# scripts/test.sh runs it as its `fresh` stage; docs/testing.md describes it.
#
#   bash scripts/fresh.sh                                 # test HEAD
#   GPUQ_FRESH_REV=4a40420 bash scripts/fresh.sh          # test another commit
#   GPUQ_FRESH_TEST_STAGES="build" bash scripts/fresh.sh  # then also scripts/test.sh inside
#
# Steps, each with its log in build-fresh/logs/<step>.log: base (the cached base tarball, made
# with mmdebstrap when missing or older than 14 days), unpack, clone, setup.sh, demo.sh, then
# warnings (the demo's output holds no compiler or CMake warning) and, when asked, test.sh. The
# first step that fails is named, with the end of its log, and the root is kept for a look
# (chroot build-fresh/root); after a pass it is removed.
#
# Inside the root, each step runs in its own mount and PID namespace (unshare): /proc, /sys
# (read-only), a small /dev with /dev/shm, and /usr/local/cuda read-only when the host has it
# (the README assumes the CUDA toolkit there; everything else comes from setup.sh). Whatever a
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
#   GPUQ_FRESH_KEEP=1       keep the root after a pass too
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly ROOT="${PWD}"
readonly WORK="${ROOT}/build-fresh"
readonly ROOTFS="${WORK}/root"
readonly LOGS="${WORK}/logs"
readonly CACHE="${GPUQ_FRESH_CACHE:-${XDG_CACHE_HOME:-${HOME:-/var/tmp}/.cache}/gpuq-fresh}"
readonly MIRROR="${GPUQ_FRESH_MIRROR:-http://deb.debian.org/debian}"
readonly SUITE=bookworm
readonly BASE_TAR="${CACHE}/debian-${SUITE}-minbase.tar"
readonly BASE_MAX_AGE_DAYS=14
readonly STEP_TIMEOUT="${GPUQ_FRESH_STEP_TIMEOUT:-1200}"
readonly TEST_STAGES="${GPUQ_FRESH_TEST_STAGES:-}"
readonly GUEST_SRC=/root/gpuq
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
if [[ "${rev}" == HEAD && -n "$(git -C "${ROOT}" status --porcelain --untracked-files=no)" ]]; then
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
    [[ ! -d "${ROOTFS}" ]] || echo "fresh: the root is kept for a look: chroot ${ROOTFS}"
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

remove_root() {
  [[ -e "${ROOTFS}" ]] || return 0
  if ! unmounted_below "${ROOTFS}"; then
    echo "fresh: something is still mounted below ${ROOTFS}; not removing it" >&2
    return 1
  fi
  rm -rf --one-file-system "${ROOTFS}"
}

# in_root LOG COMMAND: runs COMMAND (a bash command line) in the root, as root, in a clean
# environment and its own mount and PID namespace, appending its output to LOG.
in_root() {
  local log="$1" command="$2"
  local cuda=""
  [[ ! -d /usr/local/cuda ]] || cuda=$(readlink -f /usr/local/cuda)
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
    ' fresh-root "${ROOTFS}" "${cuda}" "${command}" "${CACHE}/archives" "${guest_pip_cert}" \
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
echo "fresh: commit ${sha:0:12} in a clean Debian ${SUITE} root (${ROOTFS}; cache ${CACHE})"

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

# ---- unpack ------------------------------------------------------------------------------------
begin unpack
remove_root
mkdir -p "${ROOTFS}"
tar -C "${ROOTFS}" --numeric-owner -xf "${BASE_TAR}" >>"${LOGS}/unpack.log" 2>&1
# The host's resolver, so that apt-get in the root reaches the mirror.
cp -L /etc/resolv.conf "${ROOTFS}/etc/resolv.conf"
# The host's CA bundle for pip (the demo installs the Python client's build tools from PyPI),
# given to the steps as PIP_CERT: where the host reaches the internet through a TLS-intercepting
# proxy, only the host's bundle holds that proxy's CA. Network settings, like resolv.conf; no
# package comes with it. A user's machine reaches PyPI with its own.
host_ca="${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
if [[ -f "${host_ca}" ]]; then
  mkdir -p "${ROOTFS}/etc/gpuq-fresh"
  cp -L "${host_ca}" "${ROOTFS}/etc/gpuq-fresh/host-ca.crt"
  guest_pip_cert=/etc/gpuq-fresh/host-ca.crt
fi
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

if [[ -n "${TEST_STAGES}" ]]; then
  begin test.sh
  in_root "${LOGS}/test.sh.log" \
    "cd ${GUEST_SRC} && GPUQ_TEST_STAGES='${TEST_STAGES}' bash scripts/test.sh"
  end "$(grep -E '^tests: ' "${LOGS}/test.sh.log" | tail -1)"
fi

echo "fresh: what the demo client printed in the root:"
sed -n '/^==> gpuq_demo/,/^==> gpuqctl status/p' "${LOGS}/demo.sh.log" | sed '$d' | sed 's/^/  | /'
grep -E '^demo: ' "${LOGS}/demo.sh.log" | tail -n 1 | sed 's/^/  | /'
if [[ "${GPUQ_FRESH_KEEP:-0}" == 1 ]]; then
  echo "fresh: root kept: chroot ${ROOTFS}"
else
  remove_root
fi
echo "fresh: passed: on a clean Debian ${SUITE} root, 'bash scripts/setup.sh && bash scripts/demo.sh' works"
