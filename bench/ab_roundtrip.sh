#!/usr/bin/env bash
# A/B of gpuq's round trip: a base commit against the working tree, on a lent machine without
# the build's Debian packages (scripts/device_check.sh's configure and its carried headers).
#
#   bash bench/ab_roundtrip.sh prepare BASE   # here: build-ab/base.tgz (git archive BASE),
#                                             # build-device-deps/ (scripts/device_deps.sh)
#   bash bench/ab_roundtrip.sh run            # there, carrying build-device-deps and build-ab:
#                                             # builds both, alternates 3 rounds of each
#
# AB_ROUNDS=N: rounds (default 3; base first in odd rounds, the new tree first in even ones);
# AB_CONFIG=FILE: a gpuqd config for both daemons (default: none, gpuqd's defaults).
#
# Output: a summary on stdout; every run's full output in $OUT/ab.txt (default build-ab/ab.txt).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
case "${1:-}" in
  prepare)
    base="${2:?usage: ab_roundtrip.sh prepare BASE}"
    mkdir -p build-ab
    git archive "${base}" | gzip >build-ab/base.tgz
    [[ -d build-device-deps ]] || bash scripts/device_deps.sh
    echo "build-ab/base.tgz: ${base}; carry build-device-deps and build-ab"
    ;;
  run)
    OUT="${OUT:-${ROOT}/build-ab}"
    mkdir -p "${OUT}" /tmp/ab-base
    : >"${OUT}/ab.txt"
    tar xzf build-ab/base.tgz -C /tmp/ab-base
    cp scripts/device_check.sh /tmp/ab-base/scripts/  # the base may predate it
    export GPUQ_DEVICE_DEPS="${ROOT}/build-device-deps"
    for tree in /tmp/ab-base "${ROOT}"; do
      name=$([[ ${tree} == /tmp/ab-base ]] && echo base || echo new)
      GPUQ_DEVICE_STAGES=configure OUT="${tree}/build-device/out" \
        bash "${tree}/scripts/device_check.sh" >"${OUT}/configure-${name}.log" 2>&1 ||
        echo "configure failed: ${name}"
      ninja -C "${tree}/build-device" gpuqd gpuq-worker gpuq_bench_roundtrip \
        >"${OUT}/build-${name}.log" 2>&1 || echo "build failed: ${name}"
    done
    rounds="${AB_ROUNDS:-3}"
    config=()
    [[ -n ${AB_CONFIG:-} ]] && config=(--daemon-config "${AB_CONFIG}")
    for ((i = 1; i <= rounds; i++)); do
      # ABBA: the base first in odd rounds, the new tree first in even ones.
      order=(/tmp/ab-base "${ROOT}")
      ((i % 2 == 0)) && order=("${ROOT}" /tmp/ab-base)
      for tree in "${order[@]}"; do
        echo "=== round ${i} $([[ ${tree} == /tmp/ab-base ]] && echo base || echo new)" |
          tee -a "${OUT}/ab.txt"
        "${tree}/build-device/bench/gpuq_bench_roundtrip" --systems gpuq,uds --clients 1,4 \
          --rounds 1 --duration 1 --jobs 20000 --warmup-jobs 2000 --sleeping-jobs 500 \
          "${config[@]}" --no-json 2>&1 | grep -v "^gpuqd\[" | tee -a "${OUT}/ab.txt" |
          grep -E "^(Round|Throughput|  gpuq|  uds)"
      done
    done
    python3 bench/ab_summary.py "${OUT}/ab.txt"
    ;;
  *)
    echo "usage: ab_roundtrip.sh prepare BASE | run" >&2
    exit 2
    ;;
esac
