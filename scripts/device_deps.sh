#!/usr/bin/env bash
# Bundles the header-only dependencies that a lent GPU machine lacks into build-device-deps/
# (ignored by git), for scripts/device_check.sh to build with there. That machine has CUDA,
# cmake, ninja and a g++, but no internet and no Debian packages: no Boost, no nlohmann_json, no
# doctest. Run this here, where scripts/setup.sh has installed them; carry the folder along
# (docs/testing.md, "GPU tests on a lent machine").
#
#   bash scripts/device_deps.sh
#
# What goes in:
#   include/boost/     the Boost headers gpuq's translation units include: the closure of
#                      `-M` over every compile command of a scratch configure (the CUDA ones
#                      through nvcc) and over every other tracked .cpp/.cu, once more for the
#                      Boost-including ones with -std=c++17, -std=c++2b and clang++, plus the
#                      whole folder of each Boost library touched that is under
#                      GPUQ_DEPS_WHOLE_MAX_KB (boost/config always): another g++ version may pick
#                      other headers of the same library (smart_ptr's atomics, mpl's configs)
#   include/nlohmann/  all of nlohmann_json's headers
#   include/doctest/   all of doctest's headers
#   lib/cmake/{Boost,nlohmann_json,doctest}/
#                      config packages (targets Boost::headers, Boost::boost,
#                      nlohmann_json::nlohmann_json, doctest::doctest) with paths relative to
#                      themselves, so the folder works wherever it lands; device_check.sh names
#                      them with Boost_DIR, nlohmann_json_DIR and doctest_DIR. Config mode is
#                      what both CMake lookups of Boost take: FindBoost (CMake < 3.30, or
#                      CMP0167 OLD) tries BoostConfig.cmake first, and CMP0167 NEW uses only it.
#   wheels/            pure-Python wheels the device's Python lacks (loky), for the patterns stage
#   MANIFEST.txt       versions, where each came from, file counts
#
# Environment:
#   GPUQ_DEPS_DIR          output folder (default <repo>/build-device-deps; replaced each run)
#   GPUQ_DEPS_WHOLE_MAX_KB copy a touched Boost library's whole folder when it is at most this
#                          big (default 2048; 0: the exact closure plus boost/config only)
#   GPUQ_BUILD_JOBS        parallel preprocessor runs (default: nproc)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly ROOT="${PWD}"
readonly DEST="${GPUQ_DEPS_DIR:-${ROOT}/build-device-deps}"
readonly WHOLE_MAX_KB="${GPUQ_DEPS_WHOLE_MAX_KB:-2048}"
readonly JOBS="${GPUQ_BUILD_JOBS:-$(nproc)}"

step() { printf '\n==> [%3ds] %s\n' "${SECONDS}" "$*"; }

# nvcc for the scratch configure, so the .cu translation units are in its compile commands.
if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:${PATH}"
fi

work="$(mktemp -d /tmp/gpuq-device-deps.XXXXXX)"
trap 'rm -rf "${work}"' EXIT

# ---- 1. compile commands: a scratch configure with every part on -----------------------------
step "configure a scratch build for its compile commands (${work}/build)"
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
if ! cmake -S "${ROOT}" -B "${work}/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DGPUQ_BUILD_TESTS=ON -DGPUQ_BUILD_BENCH=ON -DGPUQ_BUILD_EXAMPLES=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 >"${work}/configure.log" 2>&1; then
  tail -n 40 "${work}/configure.log"
  echo "device_deps: the scratch configure failed (install the packages: bash scripts/setup.sh)" >&2
  exit 1
fi
grep -E '^-- gpuq: CUDA' "${work}/configure.log" || true

# ---- 2. every header each translation unit includes ------------------------------------------
step "preprocess every translation unit with -M (${JOBS} at a time)"
python3 - "${ROOT}" "${work}" "${JOBS}" <<'PY'
import json, os, re, shlex, shutil, subprocess, sys
from concurrent.futures import ThreadPoolExecutor

root, work, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3])
entries = json.load(open(os.path.join(work, "build", "compile_commands.json")))

def dep_command(entry):
    """The entry's compile command turned into a dependency listing (-M) on stdout."""
    args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
        elif a in ("-c", "-MD", "-MMD"):
            pass
        else:
            out.append(a)
    return out + ["-M"]

def run(cmd, cwd):
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        return None, p.stderr
    files = []
    for tok in p.stdout.replace("\\\n", " ").split():
        if tok.endswith(":"):
            continue
        files.append(os.path.normpath(os.path.join(cwd, tok)))
    return files, ""

tasks = [(dep_command(e), e["directory"], e["file"]) for e in entries]
# Tracked (or new, not ignored) sources that this configure does not compile (the oneDNN
# alternative, the Python module, fuzz drivers, ...): g++ with every include folder seen above.
seen = {os.path.normpath(os.path.join(e["directory"], e["file"])) for e in entries}
incs = []
for cmd, _, _ in tasks:
    for i, a in enumerate(cmd):
        for flag in ("-I", "-isystem"):
            if a == flag and i + 1 < len(cmd):
                pair = [flag, cmd[i + 1]]
            elif a.startswith(flag) and len(a) > len(flag) and flag == "-I":
                pair = [a]
            else:
                continue
            if pair not in incs:
                incs.append(pair)
listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                         "*.cpp", "*.cc", "*.cu"], cwd=root, capture_output=True, text=True,
                        check=True).stdout.split()
for rel in listed:
    path = os.path.normpath(os.path.join(root, rel))
    if path in seen:
        continue
    tasks.append((["g++", "-std=c++20", "-x", "c++"] + [x for p in incs for x in p] +
                  ["-M", "-MG", path], root, path))

with ThreadPoolExecutor(jobs) as pool:
    results = list(pool.map(lambda t: run(t[0], t[1]), tasks))
failed = [(t, err) for t, (files, err) in zip(tasks, results) if files is None]
for (cmd, _, f), err in failed:
    print(f"device_deps: -M failed for {f}:\n{err[-2000:]}", file=sys.stderr)
if any(t[2] in seen or os.path.normpath(os.path.join(t[1], t[2])) in seen for t, _ in failed):
    sys.exit(1)  # a configured translation unit must preprocess; the extra ones may not

boost_re = re.compile(r"^(/.+?)/boost/(.+)$")
def boost_files(files):
    return [f for f in files if boost_re.match(f) and not f.startswith(root + "/")]

all_files = set()
boost_tus = []
for (cmd, cwd, f), (files, _) in zip(tasks, results):
    if files is None:
        continue
    all_files.update(files)
    if boost_files(files) and "nvcc" not in os.path.basename(cmd[0]):
        boost_tus.append((cmd, cwd, f))
print(f"device_deps: {len(tasks)} translation units, {len(boost_tus)} include Boost: "
      + ", ".join(os.path.relpath(f, root) for _, _, f in boost_tus))

# The Boost-including ones again, as other compilers and standards would see them.
variants = []
for cmd, cwd, f in boost_tus:
    for s in ("-std=c++17", "-std=c++2b"):
        variants.append(([a if not a.startswith("-std=") else s for a in cmd], cwd))
    clang = shutil.which("clang++")
    if clang:
        variants.append(([clang] + cmd[1:], cwd))
with ThreadPoolExecutor(jobs) as pool:
    for (cmd, _), (files, err) in zip(variants, pool.map(lambda v: run(*v), variants)):
        if files is None:
            print(f"device_deps: note: variant {' '.join(cmd[:1] + [a for a in cmd if a.startswith('-std=')])}"
                  " did not preprocess (ignored)", file=sys.stderr)
        else:
            all_files.update(files)

roots, rels = set(), set()
for f in boost_files(all_files):
    m = boost_re.match(f)
    roots.add(m.group(1))
    rels.add("boost/" + m.group(2))
def root_of(suffix):
    found = {f[: -len(suffix)] for f in all_files if f.endswith(suffix)}
    found = {r for r in found if not r.startswith(root + "/")}
    if len(found) != 1:
        sys.exit(f"device_deps: expected one folder with {suffix}, found {sorted(found) or 'none'}")
    return found.pop()
if len(roots) != 1:
    sys.exit(f"device_deps: expected one Boost include folder, found {sorted(roots) or 'none'}")
with open(os.path.join(work, "roots.sh"), "w") as out:
    out.write(f"boost_root={shlex.quote(roots.pop())}\n")
    out.write(f"json_root={shlex.quote(root_of('/nlohmann/json.hpp'))}\n")
    out.write(f"doctest_root={shlex.quote(root_of('/doctest/doctest.h'))}\n")
with open(os.path.join(work, "boost_files.txt"), "w") as out:
    out.write("\n".join(sorted(rels)) + "\n")
print(f"device_deps: {len(rels)} Boost headers in the closure")
PY
boost_root="" json_root="" doctest_root=""
# shellcheck disable=SC1091
source "${work}/roots.sh"

# ---- 3. copy ---------------------------------------------------------------------------------
step "copy the headers into ${DEST}"
rm -rf "${DEST}"
mkdir -p "${DEST}/include"
(cd "${boost_root}" && xargs -a "${work}/boost_files.txt" cp --parents -t "${DEST}/include")
whole=(config)
while read -r lib; do
  [[ -d "${boost_root}/boost/${lib}" && "${lib}" != config ]] || continue
  kb="$(du -sk --apparent-size "${boost_root}/boost/${lib}" | cut -f1)"
  if ((kb <= WHOLE_MAX_KB)); then whole+=("${lib}"); fi
done < <(sed -n 's|^boost/\([^/]*\)/.*|\1|p' "${work}/boost_files.txt" | sort -u)
for lib in "${whole[@]}"; do
  cp -r "${boost_root}/boost/${lib}" "${DEST}/include/boost/"
done
echo "whole Boost folders: ${whole[*]}"
cp -r "${json_root}/nlohmann" "${DEST}/include/"
cp -r "${doctest_root}/doctest" "${DEST}/include/"

# Versions, from the headers themselves.
define_of() { sed -n "s/^[[:space:]]*#[[:space:]]*define[[:space:]]\+$1[[:space:]]\+\([0-9]\+\).*/\1/p" "$2" | head -n 1; }
boost_num="$(define_of BOOST_VERSION "${DEST}/include/boost/version.hpp")"
boost_version="$((boost_num / 100000)).$((boost_num / 100 % 1000)).$((boost_num % 100))"
json_h="$(grep -rl 'define NLOHMANN_JSON_VERSION_MAJOR' "${DEST}/include/nlohmann" | head -n 1)"
json_version="$(define_of NLOHMANN_JSON_VERSION_MAJOR "${json_h}").$(define_of \
  NLOHMANN_JSON_VERSION_MINOR "${json_h}").$(define_of NLOHMANN_JSON_VERSION_PATCH "${json_h}")"
doctest_h="${DEST}/include/doctest/doctest.h"
doctest_version="$(define_of DOCTEST_VERSION_MAJOR "${doctest_h}").$(define_of \
  DOCTEST_VERSION_MINOR "${doctest_h}").$(define_of DOCTEST_VERSION_PATCH "${doctest_h}")"

# ---- 4. CMake config packages ----------------------------------------------------------------
step "write the CMake config packages"
# write_version <file> <version> <same-major: 0|1>: a <Package>ConfigVersion.cmake.
write_version() {
  cat >"$1" <<EOF
# Written by scripts/device_deps.sh.
set(PACKAGE_VERSION "$2")
set(PACKAGE_VERSION_COMPATIBLE FALSE)
if(NOT PACKAGE_FIND_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
elseif(NOT PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION
       AND (NOT $3 OR PACKAGE_FIND_VERSION_MAJOR STREQUAL "${2%%.*}"))
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  if(PACKAGE_FIND_VERSION VERSION_EQUAL PACKAGE_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
endif()
EOF
}
# The include folder, relative to each config file (lib/cmake/<name>/).
# shellcheck disable=SC2016
readonly ROOT_FROM_CONFIG='get_filename_component(_gpuq_deps_include "${CMAKE_CURRENT_LIST_DIR}/../../../include" ABSOLUTE)'
# header_target <file> <target>: a config that defines one header-only imported target.
header_target() {
  cat >>"$1" <<EOF
if(NOT TARGET $2)
  add_library($2 INTERFACE IMPORTED)
  set_target_properties($2 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "\${_gpuq_deps_include}")
endif()
EOF
}

mkdir -p "${DEST}/lib/cmake/Boost" "${DEST}/lib/cmake/nlohmann_json" "${DEST}/lib/cmake/doctest"
cfg="${DEST}/lib/cmake/Boost/BoostConfig.cmake"
cat >"${cfg}" <<EOF
# Boost ${boost_version}, headers only (what gpuq includes), written by scripts/device_deps.sh.
${ROOT_FROM_CONFIG}
set(Boost_VERSION "${boost_version}")
set(Boost_VERSION_STRING "${boost_version}")
set(Boost_VERSION_MACRO "${boost_num}")
set(Boost_VERSION_MAJOR "${boost_version%%.*}")
set(Boost_MAJOR_VERSION "${boost_version%%.*}")
set(Boost_INCLUDE_DIR "\${_gpuq_deps_include}")
set(Boost_INCLUDE_DIRS "\${_gpuq_deps_include}")
set(Boost_LIBRARIES "")
EOF
header_target "${cfg}" Boost::headers
cat >>"${cfg}" <<'EOF'
if(NOT TARGET Boost::boost)
  add_library(Boost::boost INTERFACE IMPORTED)
  set_target_properties(Boost::boost PROPERTIES INTERFACE_LINK_LIBRARIES Boost::headers)
endif()
# Only the headers are here: a compiled component is not found.
foreach(_gpuq_comp IN LISTS Boost_FIND_COMPONENTS)
  if(_gpuq_comp STREQUAL "headers")
    set(Boost_headers_FOUND TRUE)
  else()
    set(Boost_${_gpuq_comp}_FOUND FALSE)
    if(Boost_FIND_REQUIRED_${_gpuq_comp})
      set(Boost_FOUND FALSE)
      set(Boost_NOT_FOUND_MESSAGE "build-device-deps holds Boost's headers only, not ${_gpuq_comp}")
    endif()
  endif()
endforeach()
EOF
write_version "${DEST}/lib/cmake/Boost/BoostConfigVersion.cmake" "${boost_version}" 0

cfg="${DEST}/lib/cmake/nlohmann_json/nlohmann_jsonConfig.cmake"
printf '# nlohmann_json %s, written by scripts/device_deps.sh.\n%s\n' "${json_version}" \
  "${ROOT_FROM_CONFIG}" >"${cfg}"
header_target "${cfg}" nlohmann_json::nlohmann_json
write_version "${DEST}/lib/cmake/nlohmann_json/nlohmann_jsonConfigVersion.cmake" "${json_version}" 1

cfg="${DEST}/lib/cmake/doctest/doctestConfig.cmake"
printf '# doctest %s, written by scripts/device_deps.sh.\n%s\n' "${doctest_version}" \
  "${ROOT_FROM_CONFIG}" >"${cfg}"
header_target "${cfg}" doctest::doctest
write_version "${DEST}/lib/cmake/doctest/doctestConfigVersion.cmake" "${doctest_version}" 1

# Pure-Python wheels the device's Python lacks, for the patterns stage (textgen_executor.py
# compares with loky itself): pip download, which needs PyPI here; best effort.
mkdir -p "${DEST}/wheels"
if ! python3 -m pip download -q --no-deps --only-binary=:all: -d "${DEST}/wheels" loky 2>/dev/null; then
  echo "device_deps: pip download loky failed: the patterns stage's textgen_executor will fail" >&2
fi

count() { find "$1" -type f | wc -l; }
cat >"${DEST}/MANIFEST.txt" <<EOF
Written by scripts/device_deps.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ) ($(hostname)),
for scripts/device_check.sh on a machine without these packages.
Boost         ${boost_version}  from ${boost_root}/boost  ($(count "${DEST}/include/boost") files; whole: ${whole[*]})
nlohmann_json ${json_version}  from ${json_root}/nlohmann  ($(count "${DEST}/include/nlohmann") files)
doctest       ${doctest_version}   from ${doctest_root}/doctest  ($(count "${DEST}/include/doctest") files)
wheels        $(find "${DEST}/wheels" -name '*.whl' -printf '%f ')
EOF
cat "${DEST}/MANIFEST.txt"

step "done: $(du -sh --apparent-size "${DEST}" | cut -f1) ($(du -sh "${DEST}" | cut -f1) on disk)" \
  "in ${DEST}"
