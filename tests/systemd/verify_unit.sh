#!/usr/bin/env bash
# ctest test_systemd_unit (label integration; docs/service.md): installs BUILD_DIR into a
# temporary prefix, then checks the unit and the sysusers.d entry as installed:
#   - `systemd-analyze verify` accepts the unit with no warning at all (it exits 0 on unknown
#     keys and bad values, so any output fails the test);
#   - `systemd-analyze security --offline` rates its exposure at most GPUQ_UNIT_MAX_EXPOSURE
#     (default 2.0 of 10);
#   - the settings the service relies on are there (Type=notify, WatchdogSec=, User/Group gpuq,
#     RuntimeDirectory=gpuq, LimitMEMLOCK=infinity, the NVIDIA devices, ExecStart= with the
#     installed gpuqd and config), and the user, the unit and the config agree on "gpuq";
#   - `systemd-sysusers --dry-run` accepts the sysusers.d entry (as root only).
# Exits 77 (ctest: skipped) when systemd-analyze is missing.
#
#   bash tests/systemd/verify_unit.sh BUILD_DIR [HAVE_SYSTEMD]
# HAVE_SYSTEMD: ON (default) when gpuqd has sd_notify (the unit is Type=notify with a
# watchdog), OFF when the build has no libsystemd (Type=simple).
set -euo pipefail

readonly BUILD="${1:?usage: verify_unit.sh BUILD_DIR [ON|OFF]}"
readonly HAVE_SYSTEMD="${2:-ON}"
if ! command -v systemd-analyze >/dev/null; then
  echo "verify_unit: SKIPPED: systemd-analyze not found (Debian: apt-get install systemd)"
  exit 77
fi
TMP="$(mktemp -d /tmp/gpuq-unit-XXXXXX)"
readonly TMP
trap 'rm -rf "${TMP}"' EXIT
fail() {
  echo "verify_unit: FAILED: $*" >&2
  exit 1
}

readonly PREFIX="${TMP}/prefix"
cmake --install "${BUILD}" --prefix "${PREFIX}" >"${TMP}/install.log" 2>&1 ||
  { cat "${TMP}/install.log" >&2; fail "cmake --install"; }
readonly UNIT="${PREFIX}/lib/systemd/system/gpuqd.service"
readonly SYSUSERS="${PREFIX}/lib/sysusers.d/gpuq.conf"
readonly CONFIG="${PREFIX}/etc/gpuq/gpuqd.json"
for f in "${UNIT}" "${SYSUSERS}" "${CONFIG}"; do
  [[ -f "${f}" ]] || fail "${f#"${PREFIX}"/} was not installed"
done

echo "verify_unit: systemd-analyze verify ${UNIT#"${PREFIX}"/}"
out=$(systemd-analyze verify "${UNIT}" 2>&1) || fail "systemd-analyze verify: ${out}"
[[ -z "${out}" ]] || fail "systemd-analyze verify warns:"$'\n'"${out}"

max="${GPUQ_UNIT_MAX_EXPOSURE:-2.0}"
threshold=$(python3 -c "print(round(float('${max}') * 10))")
out=$(systemd-analyze security --offline=yes --threshold="${threshold}" "${UNIT}" 2>&1) ||
  fail "exposure above ${max}:"$'\n'"$(tail -n 25 <<<"${out}")"
echo "verify_unit: $(grep -o 'Overall exposure level.*' <<<"${out}")"

setting() { sed -n "s/^$1=//p" "${UNIT}"; }
type=$(setting Type)
if [[ "${HAVE_SYSTEMD}" == ON ]]; then
  [[ "${type}" == notify ]] || fail "Type=${type}, not notify"
  [[ -n "$(setting WatchdogSec)" ]] || fail "no WatchdogSec="
else
  echo "verify_unit: this build has no libsystemd: expecting Type=simple"
  [[ "${type}" == simple ]] || fail "Type=${type} in a build without sd_notify"
fi
[[ "$(setting ExecStart)" == "${PREFIX}/bin/gpuqd --config ${CONFIG}" ]] ||
  fail "ExecStart=$(setting ExecStart)"
[[ -x "${PREFIX}/bin/gpuqd" ]] || fail "ExecStart's gpuqd is not installed"
for expected in User=gpuq Group=gpuq RuntimeDirectory=gpuq RuntimeDirectoryMode=0750 \
  LimitMEMLOCK=infinity Restart=on-failure KillMode=mixed NotifyAccess=main \
  NoNewPrivileges=yes ProtectSystem=strict ProtectHome=yes PrivateTmp=yes DevicePolicy=closed \
  "DeviceAllow=char-nvidiactl rw" "DeviceAllow=char-nvidia-frontend rw" \
  "DeviceAllow=char-nvidia-uvm rw"; do
  grep -qxF "${expected}" "${UNIT}" || fail "the unit lacks ${expected}"
done
# One name throughout: the sysusers.d user and group, the unit's User/Group, and the config's
# group and allowed_groups (what makes the socket 0660 gpuq and admits the group's members).
[[ "$(awk '$1 == "u" {print $2}' "${SYSUSERS}")" == gpuq ]] || fail "sysusers.d makes no user gpuq"
python3 - "${CONFIG}" <<'PY' || fail "the installed config does not give access to group gpuq"
import json, sys
c = json.load(open(sys.argv[1]))
sys.exit(0 if c.get("group") == "gpuq" and "gpuq" in c.get("allowed_groups", []) else 1)
PY

if ((EUID == 0)) && command -v systemd-sysusers >/dev/null; then
  out=$(systemd-sysusers --dry-run "${SYSUSERS}" 2>&1) || fail "systemd-sysusers: ${out}"
fi
echo "verify_unit: ok"
