#!/usr/bin/env python3
"""Checks that gpuq's layers point one way: no source file includes a header of a layer above it.

    common/     building blocks; includes only common/
    libclient/  the client library; common/ and itself
    daemon/     gpuqd and the workers, by process; of libclient/ only the public plug-in ABI
                (gpuq/plugin.h and the C header it includes), which workers implement:
      shared/       what both processes use; common/ and itself
      supervisor/   gpuqd; common/, daemon/shared/ and itself
      worker/       the worker runtime and the CPU worker; common/, daemon/shared/ and itself
      gpu/          the GPU worker; common/, daemon/shared/, daemon/worker/ and itself
    tools/      gpuqctl; common/, libclient/ and itself

daemon/ and libclient/ never include each other otherwise, and the supervisor and the workers
share only daemon/shared/ (docs/design/architecture.md). Each
#include of a C/C++/CUDA file in those folders is resolved the way the build resolves it: a
quoted name next to the including file first, then the include roots of every layer
(common/include, libclient/include, daemon/shared, ...); a name found nowhere is a system or
third-party header and is not checked.

    python3 scripts/check_layers.py [--root DIR]   # exit 0: clean; 1: violations, each printed
    python3 scripts/check_layers.py --self-test    # the check finds a planted violation

ctest runs both (tests/CMakeLists.txt, test layer_includes).
"""

import argparse
import pathlib
import re
import sys
import tempfile

# Layer (a folder) -> the layers its files may include. A file belongs to the longest layer
# folder that contains it.
ALLOWED = {
    "common": {"common"},
    "libclient": {"common", "libclient"},
    "daemon/shared": {"common", "daemon/shared"},
    "daemon/supervisor": {"common", "daemon/shared", "daemon/supervisor"},
    "daemon/worker": {"common", "daemon/shared", "daemon/worker"},
    "daemon/gpu": {"common", "daemon/shared", "daemon/worker", "daemon/gpu"},
    "tools": {"common", "libclient", "tools"},
}
# Single headers of another layer that a layer may include, with the reason.
# ("daemon" stands for every daemon/ layer.)
EXCEPTIONS = {
    ("daemon", "libclient/include/gpuq/plugin.h"): "the public plug-in ABI the workers implement",
}
# Where the build looks for headers, lowest layer first (the layer is the first path component).
INCLUDE_ROOTS = [
    "common/include",
    "libclient/include",
    "libclient/src",
    "daemon/shared",
    "daemon/supervisor",
    "daemon/worker",
    "daemon/gpu",
    "tools",
]
SOURCE_SUFFIXES = {".c", ".h", ".cpp", ".hpp", ".cu", ".cuh"}
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')


def resolve(root: pathlib.Path, including: pathlib.Path, name: str, quoted: bool):
    """The file `#include name` in `including` names, relative to root, or None."""
    if quoted:
        here = (including.parent / name).resolve()
        if here.is_file():
            try:
                return here.relative_to(root)
            except ValueError:
                return None
    for inc in INCLUDE_ROOTS:
        candidate = root / inc / name
        if candidate.is_file():
            return candidate.resolve().relative_to(root)
    return None


def layer_of(rel: pathlib.Path):
    """The layer folder (an ALLOWED key) that holds `rel`, or None."""
    best = None
    for layer in ALLOWED:
        parts = tuple(layer.split("/"))
        if rel.parts[: len(parts)] == parts and (best is None or len(parts) > len(best.split("/"))):
            best = layer
    return best


def violations(root: pathlib.Path):
    root = root.resolve()
    found = []
    for layer, allowed in ALLOWED.items():
        base = root / layer
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            if path.suffix not in SOURCE_SUFFIXES or not path.is_file():
                continue
            rel = path.relative_to(root)
            if layer_of(rel) != layer:
                continue  # checked as part of the deeper layer that holds it
            for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                m = INCLUDE_RE.match(line)
                if not m:
                    continue
                target = resolve(root, path, m.group(2), m.group(1) == '"')
                if target is None:
                    continue
                target_layer = layer_of(target)
                if target_layer is None or target_layer in allowed:
                    continue
                if (layer.split("/")[0], target.as_posix()) in EXCEPTIONS:
                    continue
                found.append(
                    f"{rel}:{lineno}: includes {m.group(2)} ({target.as_posix()}): "
                    f"{layer}/ may include only {', '.join(sorted(allowed))}/"
                )
    return found


def self_test() -> int:
    """Plants one violation per rule in a small tree and checks that each one is reported."""
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        files = {
            "common/include/gpuq/error.hpp": "#pragma once\n",
            "common/include/gpuq/common/ring.hpp": '#include "gpuq/error.hpp"\n'
            '#include "gpuq/client.hpp"\n',
            "libclient/include/gpuq/client.hpp": '#include "gpuq/error.hpp"\n',
            "libclient/include/gpuq/plugin.h": "#include <stdint.h>\n",
            "libclient/src/client.cpp": '#include "gpuq/client.hpp"\n#include "supervisor.hpp"\n',
            "daemon/supervisor/supervisor.hpp": '#include "gpuq/common/ring.hpp"\n'
            '#include "ops.hpp"\n',
            "daemon/supervisor/main.cpp": '#include "worker_loop.hpp"\n',
            "daemon/shared/ops.hpp": '#include "gpuq/error.hpp"\n',
            "daemon/shared/plugins.cpp": '#include "gpuq/plugin.h"\n#include <vector>\n',
            "daemon/worker/worker_loop.hpp": '#include "ops.hpp"\n',
            "daemon/worker/worker_loop.cpp": '#include "../../libclient/src/client.cpp"\n',
            "daemon/gpu/gpu_backend.cpp": '#include "worker_loop.hpp"\n#include "gpuq/plugin.h"\n'
            '#include "supervisor.hpp"\n',
            "tools/gpuqctl.cpp": '#include "gpuq/client.hpp"\n#include "supervisor.hpp"\n',
        }
        for name, text in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        got = violations(root)
        expected = [
            "common/include/gpuq/common/ring.hpp:2:",  # common -> libclient
            "daemon/gpu/gpu_backend.cpp:3:",  # gpu -> supervisor
            "daemon/supervisor/main.cpp:1:",  # supervisor -> worker
            "daemon/worker/worker_loop.cpp:1:",  # daemon -> libclient, by a relative path
            "libclient/src/client.cpp:2:",  # libclient -> daemon
            "tools/gpuqctl.cpp:2:",  # tools -> daemon
        ]
        ok = len(got) == len(expected) and all(
            g.startswith(e) for g, e in zip(sorted(got), expected)
        )
        if not ok:
            print("check_layers self-test FAILED: expected violations at", expected, file=sys.stderr)
            print("got:", *got, sep="\n  ", file=sys.stderr)
            return 1
        print(f"check_layers self-test: all {len(expected)} planted violations found, nothing else")
        return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=pathlib.Path(__file__).resolve().parent.parent,
                        type=pathlib.Path, help="the source tree (default: this script's)")
    parser.add_argument("--self-test", action="store_true",
                        help="check that planted violations are found")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    found = violations(args.root)
    for v in found:
        print(v, file=sys.stderr)
    if found:
        print(f"check_layers: {len(found)} include(s) point up or across the layers "
              "(scripts/check_layers.py's docstring lists what each layer may include)",
              file=sys.stderr)
        return 1
    print("check_layers: every include points down or within its layer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
