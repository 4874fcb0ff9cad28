#!/usr/bin/env bash
# Debian package test (scripts/test.sh stage `package`; docs/service.md):
#   1. `cpack -G DEB` in BUILD_DIR, and the package's metadata (dependencies, conffiles,
#      maintainer scripts);
#   2. `dpkg -i` on this machine, which need not run systemd (CI containers do not): the gpuq
#      user and group exist, the unit is enabled, `gpuqd --version` runs from /usr/bin, the
#      shipped /etc/gpuq/gpuqd.json passes `gpuqd --check-config` unchanged, and
#      `systemd-analyze verify` accepts the installed unit;
#   3. the installed daemon run as the unit runs it (user and group gpuq, the shipped config, a
#      runtime directory made as RuntimeDirectory= makes it): socket and queue segment are
#      0660 gpuq:gpuq, a client whose group is gpuq is served (gpuqctl, and examples/consumer
#      built with the package's gpuq.pc and libgpuq.so from the system paths), one outside the
#      group is refused;
#   4. `dpkg -r` removes every file but the conffile; `dpkg -P` leaves nothing: no file of the
#      package, no /etc/gpuq, no enablement symlink or deb-systemd-helper state.
# Needs root (dpkg); otherwise it says so and exits 77 (skipped). Idempotent: a gpuq package
# left installed (by an earlier run) is purged first, and a trap purges it again on any failure.
# The gpuq user and group stay after a purge, as Debian keeps system users.
#
#   bash tests/package/deb_test.sh BUILD_DIR
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="$(cd "${1:?usage: deb_test.sh BUILD_DIR}" && pwd)"
readonly ROOT BUILD
readonly UNIT=gpuqd.service

if ((EUID != 0)); then
  echo "deb_test: SKIPPED: installing a .deb needs root (CI runs as root)"
  exit 77
fi
for tool in cpack dpkg dpkg-deb setpriv; do
  command -v "${tool}" >/dev/null || { echo "deb_test: FAILED: ${tool} not found" >&2; exit 1; }
done

TMP="$(mktemp -d /tmp/gpuq-deb-XXXXXX)"
readonly TMP
daemon_pid=""
# True while dpkg knows gpuq in any state but "not-installed" (installed, or removed with its
# conffiles, or half-configured).
installed() {
  local status
  status=$(dpkg-query -W -f='${db:Status-Status}' gpuq 2>/dev/null || true)
  [[ -n "${status}" && "${status}" != "not-installed" ]]
}
cleanup() {
  local rc=$?
  if [[ -n "${daemon_pid}" ]] && kill -0 "${daemon_pid}" 2>/dev/null; then
    kill -KILL "${daemon_pid}" 2>/dev/null || true
    wait "${daemon_pid}" 2>/dev/null || true
  fi
  if ((rc != 0)); then
    [[ -f "${TMP}/gpuqd.log" ]] && { echo "---- gpuqd log ----" >&2; tail -n 40 "${TMP}/gpuqd.log" >&2; }
    if installed; then
      echo "deb_test: purging the gpuq package after the failure" >&2
      dpkg -P gpuq >/dev/null 2>&1 || true
    fi
  fi
  rm -rf "${TMP}"
  exit "${rc}"
}
trap cleanup EXIT

fail() {
  echo "deb_test: FAILED: $*" >&2
  exit 1
}
step() { echo "deb_test: $*"; }

# ---- 1. build the package ----------------------------------------------------------------------
rm -f "${BUILD}"/packages/gpuq_*.deb
step "cpack -G DEB in ${BUILD}"
(cd "${BUILD}" && cpack -G DEB >"${TMP}/cpack.log" 2>&1) ||
  { cat "${TMP}/cpack.log" >&2; fail "cpack -G DEB"; }
debs=("${BUILD}"/packages/gpuq_*.deb)
[[ -f "${debs[0]}" && ${#debs[@]} -eq 1 ]] || fail "cpack made no single gpuq_*.deb"
readonly DEB="${debs[0]}"
step "built $(basename "${DEB}") ($(du -k "${DEB}" | cut -f1) KiB)"
depends=$(dpkg-deb -f "${DEB}" Depends)
for dep in libc6 libstdc++6 libsystemd0 adduser; do
  grep -q "${dep}" <<<"${depends}" || fail "Depends lacks ${dep}: ${depends}"
done
# A gpuq-worker built with oneDNN (GPUQ_WITH_ONEDNN) needs its library package.
if readelf -d "${BUILD}/daemon/gpuq-worker" 2>/dev/null | grep -q 'NEEDED.*libdnnl'; then
  grep -q libdnnl <<<"${depends}" || fail "Depends lacks libdnnl (oneDNN build): ${depends}"
fi
dpkg-deb -e "${DEB}" "${TMP}/control"
for f in postinst prerm postrm; do
  [[ -x "${TMP}/control/${f}" ]] || fail "the package has no executable ${f}"
done
grep -qx /etc/gpuq/gpuqd.json "${TMP}/control/conffiles" || fail "gpuqd.json is not a conffile"
grep -q '^libgpuq ' "${TMP}/control/shlibs" || fail "the package has no shlibs entry for libgpuq"
# The package's paths: its files and links, and the directories that are gpuq's own.
# (Directories shared with other packages, /usr/bin and the like, are skipped in the checks.)
dpkg-deb -c "${DEB}" | awk '{print $6}' | sed 's|^\./|/|; s|/$||' | grep -v '^$' >"${TMP}/paths"
own_dirs=(/etc/gpuq /usr/include/gpuq /usr/lib/cmake/gpuq /usr/libexec/gpuq /usr/share/doc/gpuq)

# ---- 2. install ------------------------------------------------------------------------------
if installed; then
  step "a gpuq package is installed (an earlier run?): purging it first"
  dpkg -P gpuq >/dev/null
fi
if [[ -d /run/systemd/system ]]; then
  step "note: systemd is running here; the postinst will start ${UNIT}"
fi
step "dpkg -i"
dpkg -i "${DEB}" >"${TMP}/dpkg-i.log" 2>&1 || { cat "${TMP}/dpkg-i.log" >&2; fail "dpkg -i"; }
getent passwd gpuq >/dev/null || fail "dpkg -i made no gpuq user"
getent group gpuq >/dev/null || fail "dpkg -i made no gpuq group"
[[ "$(id -gn gpuq)" == gpuq ]] || fail "the gpuq user's group is $(id -gn gpuq), not gpuq"
version=$(/usr/bin/gpuqd --version) || fail "/usr/bin/gpuqd --version"
[[ "${version}" == "gpuqd $(dpkg-deb -f "${DEB}" Version)" ]] ||
  fail "/usr/bin/gpuqd --version says '${version}'"
step "${version}"
[[ -x /usr/libexec/gpuq/gpuq-worker ]] || fail "no /usr/libexec/gpuq/gpuq-worker"
check=$(/usr/bin/gpuqd --check-config --config /etc/gpuq/gpuqd.json 2>&1) ||
  fail "the shipped /etc/gpuq/gpuqd.json does not pass --check-config: ${check}"
wants=/etc/systemd/system/multi-user.target.wants/${UNIT}
[[ -L "${wants}" ]] || fail "the unit is not enabled (no ${wants})"
[[ "$(readlink -f "${wants}")" == "$(readlink -f /usr/lib/systemd/system/${UNIT})" ]] ||
  fail "${wants} points to $(readlink "${wants}")"
# A client built against the installed package alone: gpuq.pc and libgpuq.so from system paths.
make -s -C "${ROOT}/examples/consumer" OUT="${TMP}" >"${TMP}/consumer.log" 2>&1 ||
  { cat "${TMP}/consumer.log" >&2; fail "building examples/consumer with the package's gpuq.pc"; }
grep -qE '=> (/usr)?/lib/libgpuq\.so' <<<"$(ldd "${TMP}/gpuq_consumer")" ||
  fail "the consumer does not load /usr/lib/libgpuq.so: $(ldd "${TMP}/gpuq_consumer")"
if command -v systemd-analyze >/dev/null; then
  out=$(systemd-analyze verify /usr/lib/systemd/system/${UNIT} 2>&1) ||
    fail "systemd-analyze verify: ${out}"
  [[ -z "${out}" ]] || fail "systemd-analyze verify warns about the installed unit: ${out}"
fi

# ---- 3. run it as the unit does ------------------------------------------------------------------
chmod 0755 "${TMP}"
readonly RUNDIR="${TMP}/run"
install -d -o gpuq -g gpuq -m 0750 "${RUNDIR}"  # what RuntimeDirectory=gpuq makes
step "running /usr/bin/gpuqd as gpuq:gpuq with /etc/gpuq/gpuqd.json"
setpriv --reuid=gpuq --regid=gpuq --init-groups /usr/bin/gpuqd --config /etc/gpuq/gpuqd.json \
  --runtime-dir "${RUNDIR}" >"${TMP}/gpuqd.log" 2>&1 &
daemon_pid=$!
ready=0
for _ in $(seq 200); do
  kill -0 "${daemon_pid}" 2>/dev/null || fail "gpuqd exited while starting"
  if GPUQ_RUNTIME_DIR="${RUNDIR}" /usr/bin/gpuqctl ready >/dev/null 2>&1; then
    ready=1
    break
  fi
  sleep 0.05
done
((ready)) || fail "gpuqd (as gpuq) did not get ready in 10 s"
[[ "$(stat -c '%a %U %G' "${RUNDIR}/gpuqd.sock")" == "660 gpuq gpuq" ]] ||
  fail "the socket is $(stat -c '%a %U %G' "${RUNDIR}/gpuqd.sock"), not 660 gpuq gpuq"
[[ "$(stat -c '%a %U %G' "${RUNDIR}")" == "750 gpuq gpuq" ]] ||
  fail "the runtime directory is $(stat -c '%a %U %G' "${RUNDIR}"), not 750 gpuq gpuq"
segment=$(head -n 1 "${RUNDIR}/queue-segment")
[[ "$(stat -c '%a %U %G' "/dev/shm/${segment}")" == "660 gpuq gpuq" ]] ||
  fail "the queue segment is $(stat -c '%a %U %G' "/dev/shm/${segment}"), not 660 gpuq gpuq"
# root is in allowed_users; a process whose group is gpuq is served; nobody:nogroup is not.
GPUQ_RUNTIME_DIR="${RUNDIR}" /usr/bin/gpuqctl status >/dev/null || fail "gpuqctl status as root"
GPUQ_RUNTIME_DIR="${RUNDIR}" setpriv --reuid=nobody --regid=gpuq --clear-groups \
  /usr/bin/gpuqctl submit echo --count 100 >"${TMP}/member.log" 2>&1 ||
  { cat "${TMP}/member.log" >&2; fail "a client with group gpuq was not served"; }
GPUQ_RUNTIME_DIR="${RUNDIR}" setpriv --reuid=nobody --regid=gpuq --clear-groups \
  "${TMP}/gpuq_consumer" --jobs 200 || fail "the consumer, with group gpuq, failed"
if GPUQ_RUNTIME_DIR="${RUNDIR}" setpriv --reuid=nobody --regid=nogroup --clear-groups \
  /usr/bin/gpuqctl status >"${TMP}/outsider.log" 2>&1; then
  fail "a client outside the gpuq group was served"
fi
grep -qi permission "${TMP}/outsider.log" ||
  fail "an outsider's refusal does not say why: $(cat "${TMP}/outsider.log")"
GPUQ_RUNTIME_DIR="${RUNDIR}" /usr/bin/gpuqctl stop >/dev/null || fail "gpuqctl stop"
rc=0
wait "${daemon_pid}" || rc=$?
daemon_pid=""
((rc == 0)) || fail "gpuqd exited with status ${rc} after gpuqctl stop"
[[ ! -e "/dev/shm/${segment}" ]] || fail "gpuqd left its queue segment behind"

# ---- 4. remove, purge ------------------------------------------------------------------------
step "dpkg -r"
dpkg -r gpuq >"${TMP}/dpkg-r.log" 2>&1 || { cat "${TMP}/dpkg-r.log" >&2; fail "dpkg -r"; }
while read -r p; do
  [[ "${p}" == /etc/gpuq/gpuqd.json ]] && continue  # a conffile stays until purge
  [[ -d "${p}" && ! -L "${p}" ]] && continue          # shared directories (/usr/bin...)
  [[ ! -e "${p}" && ! -L "${p}" ]] || fail "dpkg -r left ${p}"
done <"${TMP}/paths"
[[ -f /etc/gpuq/gpuqd.json ]] || fail "dpkg -r removed the conffile (only purge may)"

step "dpkg -P"
dpkg -P gpuq >"${TMP}/dpkg-p.log" 2>&1 || { cat "${TMP}/dpkg-p.log" >&2; fail "dpkg -P"; }
installed && fail "dpkg -P left the package installed"
while read -r p; do
  [[ -d "${p}" && ! -L "${p}" ]] && continue
  [[ ! -e "${p}" && ! -L "${p}" ]] || fail "dpkg -P left ${p}"
done <"${TMP}/paths"
for d in "${own_dirs[@]}"; do
  [[ ! -e "${d}" ]] || fail "dpkg -P left ${d}"
done
left=$(find /etc/systemd /var/lib/systemd/deb-systemd-helper-enabled \
  /var/lib/systemd/deb-systemd-helper-masked -name "${UNIT}*" 2>/dev/null || true)
[[ -z "${left}" ]] || fail "dpkg -P left systemd state: ${left}"
step "ok"
