#!/usr/bin/env bash
# The wheel of scripts/build_wheel.sh as a user meets it, with nothing but a Python: a new venv,
# `pip install WHEEL` (numpy and cloudpickle from PyPI), then
#   1. `gpuqd --help` and `python -m gpuq.daemon --version`, straight after the install;
#   2. the README's two commands: `gpuqd &` (built-in defaults: one CPU pool, the tensor ops on
#      the wheel's oneDNN) and examples/python/quickstart.py, then `gpuqctl status`, and
#      `gpuqctl stop`, after which gpuqd must exit 0;
#   3. a Python pool with an `@gpuq.op` function, batched, through gpuq.testing.Daemon, which
#      must find the wheel's gpuqd with no build tree and no GPUQ_GPUQD; the pool's interpreter
#      is the default one ("python3" on gpuqd's PATH, which gpuq.daemon points at the venv);
#   4. the README's first path: `gpuq serve wheel_ops` in the module's folder, a client calling
#      its op with gpuq.connect() and no setting, then Ctrl-C (SIGINT), after which the command
#      must exit 0.
# scripts/fresh.sh runs it in a clean Debian 12 root that has only python3 and python3-venv
# (docs/testing.md); it runs as well on any machine, as any user.
#
#   bash tests/package/wheel_test.sh build-wheel/dist/gpuq-0.1.0-cp311-*.whl
#
# The daemon runs with XDG_RUNTIME_DIR in a temporary folder, so its default runtime directory
# (and the clients' way to it) is a private one. Prints `wheel_test: installed in S s` and, last,
# `wheel_test: OK`. Exit status 0 passed, 1 failed, 2 bad usage.
#
# Environment:
#   GPUQ_PYTHON   the interpreter of the venv (default /usr/bin/python3, else python3)
#   GPUQ_WHEEL_TEST_KEEP=1  keep the temporary folder (venv, logs)
set -euo pipefail

if (($# != 1)) || [[ ! -f "$1" ]]; then
  echo "usage: wheel_test.sh WHEEL (a gpuq-*.whl of scripts/build_wheel.sh)" >&2
  exit 2
fi
wheel=$(readlink -f "$1")
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
quickstart="${here}/../../examples/python/quickstart.py"
[[ -f "${quickstart}" ]] || { echo "wheel_test: ${quickstart} not found" >&2; exit 2; }

py="${GPUQ_PYTHON:-}"
if [[ -z "${py}" ]]; then
  if [[ -x /usr/bin/python3 ]]; then py=/usr/bin/python3; else py=python3; fi
fi

tmp=$(mktemp -d /tmp/gpuq-wheel.XXXXXX)
daemon_pid=""
cleanup() {
  local rc=$?
  if [[ -n "${daemon_pid}" ]] && kill -0 "${daemon_pid}" 2>/dev/null; then
    kill -KILL "${daemon_pid}" 2>/dev/null || true
    wait "${daemon_pid}" 2>/dev/null || true
  fi
  if ((rc != 0)); then
    echo "wheel_test: FAILED (exit ${rc})" >&2
    [[ ! -s "${tmp}/gpuqd.log" ]] || { echo "wheel_test: gpuqd's log:" >&2; sed 's/^/  | /' "${tmp}/gpuqd.log" >&2; }
  fi
  if [[ "${GPUQ_WHEEL_TEST_KEEP:-0}" == 1 ]]; then
    echo "wheel_test: kept ${tmp}"
  else
    rm -rf "${tmp}"
  fi
}
trap cleanup EXIT

step() { printf '\n==> %s\n' "$*"; }

# No build tree, no daemon of the caller's: only what the wheel brings.
unset GPUQ_GPUQD GPUQ_RUNTIME_DIR
export XDG_RUNTIME_DIR="${tmp}/xdg"
mkdir -m 700 "${XDG_RUNTIME_DIR}"
cd "${tmp}"

step "a venv of $("${py}" --version 2>&1), then pip install $(basename "${wheel}") ($(du -h "${wheel}" | cut -f1))"
"${py}" -m venv "${tmp}/venv"
venv="${tmp}/venv"
t0=$(date +%s.%N)
"${venv}/bin/python" -m pip install -q --disable-pip-version-check "${wheel}"
t1=$(date +%s.%N)
install_s=$(awk -v a="${t0}" -v b="${t1}" 'BEGIN { printf "%.1f", b - a }')
echo "wheel_test: installed in ${install_s} s ($("${venv}/bin/python" -m pip list \
  --disable-pip-version-check --format=freeze 2>/dev/null | grep -iE '^(gpuq|numpy|cloudpickle)=' |
  tr '\n' ' '))"

step "gpuqd --help, python -m gpuq.daemon --version"
"${venv}/bin/gpuqd" --help | head -3
"${venv}/bin/python" -m gpuq.daemon --version

step "gpuqd & (built-in defaults), then examples/python/quickstart.py"
# As the README types it: the quickstart right behind `gpuqd &`, no wait for readiness in
# between (it connects with wait=30: the daemon's socket may not be there yet).
"${venv}/bin/gpuqd" >"${tmp}/gpuqd.log" 2>&1 &
daemon_pid=$!
"${venv}/bin/python" "${quickstart}" || {
  echo "wheel_test: the quickstart failed; gpuqd's log:" >&2
  cat "${tmp}/gpuqd.log" >&2
  exit 1
}
"${venv}/bin/gpuqctl" ready
"${venv}/bin/gpuqctl" status
"${venv}/bin/gpuqctl" stop
rc=0
wait "${daemon_pid}" || rc=$?
daemon_pid=""
((rc == 0)) || { echo "wheel_test: gpuqd exited with status ${rc} after gpuqctl stop" >&2; exit 1; }
echo "gpuqd drained and exited 0"

step "a Python pool with an @gpuq.op, through gpuq.testing.Daemon (the wheel's gpuqd)"
mkdir -p "${tmp}/ops"
cat >"${tmp}/ops/wheel_ops.py" <<'EOF'
import os

import numpy as np

import gpuq


@gpuq.op("scale", max_batch_size=16)
def scale(x, *, factor=2.0):
    # The rows of every queued job of this op, concatenated: one row out per row in.
    return np.asarray(x, dtype=np.float32) * np.float32(factor)


@gpuq.op("where")
def where():
    import sys
    return np.frombuffer(f"{os.getpid()} {sys.executable}".encode(), dtype=np.uint8).copy()
EOF
cat >"${tmp}/pool_test.py" <<'EOF'
import sys

import numpy as np

import gpuq
import gpuq.testing

ops_dir = sys.argv[1]
gpuqd = gpuq.testing.find_gpuqd()
assert gpuqd.endswith("/gpuq/bin/gpuqd"), gpuqd
print("gpuq.testing found", gpuqd)
config = {"pools": [{"name": "py", "kind": "cpu", "workers": 1,
                     "python": {"modules": ["wheel_ops"], "path": [ops_dir]}}]}
with gpuq.testing.Daemon(config) as d, gpuq.connect(d.runtime_dir) as client:
    assert "scale" in client.ops, client.ops
    xs = [client.array(np.full((4, 3), i, dtype=np.float32)) for i in range(32)]
    futs = [client.submit_call("scale", x, factor=0.5) for x in xs]
    for i, f in enumerate(futs):
        np.testing.assert_array_equal(f.result(timeout=60), np.full((4, 3), i * 0.5))
    pid, exe = bytes(client.call("where", timeout=60)).decode().split(" ", 1)
    print(f"32 scale jobs ok; the pool's worker is pid {pid}, {exe}")
    assert exe.startswith(sys.prefix), (exe, sys.prefix)  # the venv's interpreter
print("ok")
EOF
"${venv}/bin/python" "${tmp}/pool_test.py" "${tmp}/ops"

step "gpuq serve wheel_ops (the README's first path), a client, then Ctrl-C"
(cd "${tmp}/ops" && exec "${venv}/bin/gpuq" serve wheel_ops --gpus none --workers 1) \
  >"${tmp}/serve.out" 2>"${tmp}/gpuqd.log" &
daemon_pid=$!
"${venv}/bin/python" - <<'EOF'
import numpy as np

import gpuq

with gpuq.connect(wait=60) as client:  # the daemon's default directory: no setting
    y = client.call("scale", np.ones((2, 3), np.float32), factor=3.0, timeout=120)
    np.testing.assert_array_equal(y, np.full((2, 3), 3.0, np.float32))
print("gpuq serve answered scale")
EOF
for _ in $(seq 300); do grep -q "Ctrl-C drains" "${tmp}/serve.out" && break; sleep 0.1; done
kill -INT "${daemon_pid}"
rc=0
wait "${daemon_pid}" || rc=$?
daemon_pid=""
cat "${tmp}/serve.out"
((rc == 0)) || { echo "wheel_test: gpuq serve exited with status ${rc} after SIGINT" >&2; exit 1; }
grep -q "ops: scale, where" "${tmp}/serve.out" ||
  { echo "wheel_test: gpuq serve did not print its ops" >&2; exit 1; }

echo
echo "wheel_test: OK ($(basename "${wheel}"), $(stat -c %s "${wheel}") bytes, installed in ${install_s} s)"
