#!/usr/bin/env bash
# The type stub of gpuq's native module, python/gpuq/_native.pyi: committed, shipped in the wheel
# as a source file (with python/gpuq/py.typed), and checked against a build of the module.
# nanobind's stubgen writes the stub of the module gpuq._native that an interpreter imports; the
# result is post-processed so that it holds no object address (and refused if it holds a path of
# this machine), then formatted by ruff format as the rest of python/gpuq is (so that a
# `ruff format gpuq` leaves it as it is). nanobind and ruff are pinned in
# python/lint-requirements.txt.
#
#   scripts/native_stub.sh --update    # after a change to python/src/: build the module from this
#                                      #   tree, write its stub to python/gpuq/_native.pyi
#   scripts/native_stub.sh --check     # the same build; exit 1 with the diff if the file differs
#   scripts/native_stub.sh --check --python build-python/venv/bin/python
#                                      # against the gpuq installed there, as test.sh's python
#                                      #   stage does after installing it (--update alike)
#
# Without --python the module is built from ./python into the venv build-python/venv-stub
# (python/stub-requirements.txt: the pins of lint-requirements.txt and what the build needs),
# without pip's build isolation and with its CMake tree kept in build-python/stub-cmake, so a
# rebuild compiles only what changed (the first build compiles the client library: minutes);
# the venv is made again when the interpreter or a requirements file changes.
# With --python PY, PY's environment must have gpuq, nanobind and ruff installed.
#
# Environment:
#   GPUQ_PYTHON       the interpreter of build-python/venv-stub (default /usr/bin/python3, else
#                     python3 on PATH)
#   GPUQ_BUILD_JOBS   parallel compile jobs (default: nproc)
set -euo pipefail

readonly CALLER_DIR="${PWD}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly ROOT="${PWD}"
readonly STUB="python/gpuq/_native.pyi"
readonly JOBS="${GPUQ_BUILD_JOBS:-$(nproc)}"

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
}

mode=""
py=""
while (($# > 0)); do
  case "$1" in
    --check | --update) mode="${1#--}" ;;
    --python)
      (($# >= 2)) || { echo "native_stub: --python needs an interpreter" >&2; exit 2; }
      py="$2"
      shift
      ;;
    -h | --help) usage; exit 0 ;;
    *) echo "native_stub: unknown argument '$1' (known: --check, --update, --python PY)" >&2; exit 2 ;;
  esac
  shift
done
[[ -n "${mode}" ]] || { echo "native_stub: say --check or --update (--help)" >&2; exit 2; }

# The venv of a build from this tree: made when missing or when the interpreter or a requirements
# file changed (a hash of them in venv.stamp), gpuq reinstalled when a file it is built from
# changed (a hash of them in gpuq.stamp).
build_from_tree() {
  local base="${GPUQ_PYTHON:-}"
  if [[ -z "${base}" ]]; then
    if [[ -x /usr/bin/python3 ]]; then base=/usr/bin/python3; else base=python3; fi
  fi
  local venv="${ROOT}/build-python/venv-stub" hash t0=${SECONDS}
  local -a pip=("${venv}/bin/python" -m pip --disable-pip-version-check)
  hash=$({
    "${base}" -VV
    readlink -f "$(command -v "${base}")"
    cat python/stub-requirements.txt python/lint-requirements.txt
  } | sha256sum | cut -d' ' -f1)
  if [[ ! -x "${venv}/bin/python" || "$(cat "${venv}/venv.stamp" 2>/dev/null)" != "${hash}" ]]; then
    echo "native_stub: making ${venv#"${ROOT}/"} (python/stub-requirements.txt)"
    rm -rf "${venv}" "${ROOT}/build-python/stub-cmake"  # the tree names the old nanobind
    mkdir -p "$(dirname "${venv}")"
    "${base}" -m venv "${venv}"
    "${pip[@]}" install -q --upgrade pip
    "${pip[@]}" install -q -r python/stub-requirements.txt
    echo "${hash}" >"${venv}/venv.stamp"
  fi
  hash=$(git ls-files -z -co --exclude-standard -- python ':!python/gpuq/_native.pyi' common \
    libclient daemon/shared daemon/worker CMakeLists.txt cmake |
    (xargs -0 sha256sum 2>/dev/null || true) | sha256sum | cut -d' ' -f1)
  if [[ "$(cat "${venv}/gpuq.stamp" 2>/dev/null)" != "${hash}" ]]; then
    echo "native_stub: building gpuq._native from this tree (build-python/stub-cmake)"
    rm -f "${venv}/gpuq.stamp"
    CMAKE_BUILD_PARALLEL_LEVEL="${JOBS}" "${pip[@]}" install -q --no-build-isolation --no-deps \
      --force-reinstall -C build-dir="${ROOT}/build-python/stub-cmake" "${ROOT}/python"
    echo "${hash}" >"${venv}/gpuq.stamp"
    echo "native_stub: built in $((SECONDS - t0))s"
  fi
  py="${venv}/bin/python"
}

update_args="--update"
if [[ -n "${py}" ]]; then
  [[ "${py}" != */* || "${py}" == /* ]] || py="${CALLER_DIR}/${py}"  # relative to the caller
  command -v "${py}" >/dev/null || { echo "native_stub: no interpreter '${py}'" >&2; exit 2; }
  update_args="--update --python ${py#"${ROOT}/"}"
else
  build_from_tree
fi

tmp=$(mktemp -d)
trap 'rm -rf "${tmp}"' EXIT

# From an empty folder: run from python/, `import gpuq` would find the source folder, which has
# no native module.
if ! (cd "${tmp}" && "${py}" -c 'import gpuq._native, nanobind, ruff' 2>"${tmp}/err"); then
  cat "${tmp}/err" >&2
  echo "native_stub: ${py} cannot import gpuq._native, nanobind and ruff (install gpuq, and" \
    "nanobind and ruff as pinned in python/lint-requirements.txt)" >&2
  exit 1
fi
read -r module nb_version prefix < <(cd "${tmp}" && "${py}" -c \
  'import gpuq._native as m, nanobind, sys; print(m.__file__, nanobind.__version__, sys.prefix)')
(cd "${tmp}" && "${py}" -m nanobind.stubgen -q -m gpuq._native -o "${tmp}/raw.pyi")

# Deterministic text: an object's repr in a default value loses its address, and a path of this
# machine (the module's folder, the tree, the environment, $HOME, a temporary folder) is an error
# to fix in python/src (nb::arg(...).sig("...") gives a default value a fixed spelling).
sed -E 's/ at 0x[0-9a-fA-F]+>/>/g' "${tmp}/raw.pyi" >"${tmp}/plain.pyi"
(cd python && "${py}" -m ruff format -q --stdin-filename gpuq/_native.pyi) \
  <"${tmp}/plain.pyi" >"${tmp}/_native.pyi"
paths=("$(dirname "${module}")" "${ROOT}" "${prefix}" "${TMPDIR:-/tmp}/")
[[ -z "${HOME:-}" || "${HOME}" == / ]] || paths+=("${HOME}/")
for p in "${paths[@]}"; do
  if grep -nF -- "${p}" "${tmp}/_native.pyi" >&2; then
    echo "native_stub: the stub of ${module} names the path ${p} (lines above): give that" \
      "value a fixed spelling in python/src (nb::arg(...).sig(\"...\"))" >&2
    exit 1
  fi
done

echo "native_stub: stub of ${module#"${ROOT}/"} (nanobind ${nb_version})"
if [[ "${mode}" == update ]]; then
  if cmp -s "${tmp}/_native.pyi" "${STUB}"; then
    echo "native_stub: ${STUB} is up to date"
  else
    cp "${tmp}/_native.pyi" "${STUB}"
    echo "native_stub: wrote ${STUB}"
  fi
  exit 0
fi
if ! diff -u --label "${STUB} (committed)" --label "${STUB} (of the build)" "${STUB}" \
  "${tmp}/_native.pyi"; then
  echo "native_stub: ${STUB} differs from the stub of the module just built (diff above)." >&2
  echo "native_stub: after a change to python/src/, update it and commit it:" >&2
  echo "  scripts/native_stub.sh ${update_args}" >&2
  exit 1
fi
echo "native_stub: ${STUB} matches the build"
