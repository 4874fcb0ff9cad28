#!/usr/bin/env python3
"""clang-tidy ratchet: the files listed in scripts/tidy-clean.txt stay clean under .clang-tidy.

    python3 scripts/tidy.py                       # the ratchet, as `scripts/test.sh` stage tidy
    python3 scripts/tidy.py --files a.cpp b.hpp   # only these files (e.g. before listing them)
    python3 scripts/tidy.py --all                 # every C++ file of the build, report only

Runs clang-tidy 14 with the root .clang-tidy, one process per translation unit, -j at a time,
on the compile commands of a CMake build directory (-p, default build/). The directory is
configured first (cmake -S . -B DIR, which keeps its cache and refreshes
compile_commands.json with files added since; --no-configure skips it); a new one is
configured with CMAKE_EXPORT_COMPILE_COMMANDS=ON and the arguments after `--`. Nothing is
compiled: the tree has no generated headers. Put /usr/local/cuda/bin on PATH before a new
directory is configured (`source scripts/setup.sh` does), or daemon/gpu/ is not in it.

What is checked:
  ratchet   the .cpp files matched by the list; then each listed header that none of them
            includes (seen through clang's -H), on its own
  --files   the given files: a .cpp as a translation unit, a header on its own
  --all     every .cpp of compile_commands.json in the project's folders
A .cpp that the build does not compile (cpu_tensor_ops_none.cpp beside oneDNN) is checked with
the flags clang infers from its nearest neighbour in compile_commands.json; one in a folder of
which nothing is compiled (daemon/gpu/ without CUDA) is skipped, with a note. CUDA sources
(.cu) are never checked.

A file is not run again while nothing it read has changed (the clang-tidy version, .clang-tidy,
its compile command, its own and its headers' contents): its last result is reused from
DIR/tidy-cache.json, which also orders the run slowest first. --no-cache runs everything.

Which findings count: in the ratchet and --files, those in the checked files and in the listed
ones (headers included); findings in other headers are counted and not shown. With --all,
every finding in the project. A translation unit that clang cannot parse is a failure in every
mode: it was not checked.

Exit status: 0 clean; 1 findings (each printed as file:line:col: warning: message [check]) or
a translation unit clang-tidy could not process (with --all only the latter: it is a report);
2 usage or set-up error.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIST_FILE = ROOT / "scripts" / "tidy-clean.txt"
CONFIG = ROOT / ".clang-tidy"
SOURCE_EXTS = (".cpp", ".cc", ".cxx")
HEADER_EXTS = (".hpp", ".h", ".hh", ".hxx")
# The folders --all covers (the old `tidy` stage's run-clang-tidy filter).
ALL_DIRS = ("common", "daemon", "libclient", "tools", "examples", "bench", "tests")
# In the build directory: each file's result, time and inputs from the last run (see Cache).
CACHE_FILE = "tidy-cache.json"

DIAG = re.compile(r"^(?P<file>/[^:]+):(?P<line>\d+):(?P<col>\d+): "
                  r"(?P<sev>warning|error|note): (?P<msg>.*?)(?: \[(?P<check>[^\]]+)\])?$")
INCLUDE = re.compile(r"^\.+ (?P<path>/.+)$")


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A repository-relative glob: `*` and `?` within one folder, `**/` any folders."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def read_list(path: Path) -> list[str]:
    patterns = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            patterns.append(line)
    return patterns


def tree_files() -> list[str]:
    """Repository-relative C++ files: tracked or new and not ignored (as the format stage)."""
    exts = SOURCE_EXTS + HEADER_EXTS + (".cu",)
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], check=True, capture_output=True).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = []
        for d, subdirs, files in os.walk(ROOT):
            rel = os.path.relpath(d, ROOT)
            subdirs[:] = [s for s in subdirs if not (rel == "." and s.startswith(("build", ".")))]
            names += [os.path.normpath(os.path.join(rel, f)) for f in files]
    return sorted({n for n in names if n.endswith(exts) and (ROOT / n).is_file()})


def rel(path: str) -> str:
    p = os.path.realpath(path)
    r = os.path.relpath(p, ROOT)
    return p if r.startswith("..") else r


def configure(build: Path, cmake_args: list[str]) -> None:
    fresh = not (build / "CMakeCache.txt").is_file()
    cmd = ["cmake", "-S", str(ROOT), "-B", str(build)]
    if fresh:
        if shutil.which("ninja"):
            cmd += ["-G", "Ninja"]
        cmd += ["-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"] + cmake_args
    print("tidy: " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout + r.stderr)
        sys.exit(f"tidy: configuring {build} failed")
    if not (build / "compile_commands.json").is_file():
        sys.exit(f"tidy: {build} has no compile_commands.json "
                 "(configure it with -DCMAKE_EXPORT_COMPILE_COMMANDS=ON)")


@dataclass
class Finding:
    file: str          # repository-relative when inside the tree
    line: int
    col: int
    severity: str
    check: str
    message: str
    text: list[str] = field(default_factory=list)  # the diagnostic, its snippet and notes

    def key(self) -> tuple:
        return (self.file, self.line, self.col, self.check, self.message)


@dataclass
class Result:
    unit: str
    rc: int
    seconds: float
    findings: list[Finding]
    includes: set[str]
    stderr_tail: list[str]


def run_one(clang_tidy: str, build: Path, unit: str) -> Result:
    cmd = [clang_tidy, "-p", str(build), f"--config-file={CONFIG}", "--quiet",
           "--extra-arg=-H", str(ROOT / unit)]
    start = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    seconds = time.monotonic() - start
    findings: list[Finding] = []
    current = None
    for line in r.stdout.splitlines():
        m = DIAG.match(line)
        if m and m["sev"] != "note":
            current = Finding(rel(m["file"]), int(m["line"]), int(m["col"]), m["sev"],
                              m["check"] or ("clang-diagnostic-error" if m["sev"] == "error"
                                             else "clang-diagnostic-warning"), m["msg"], [line])
            findings.append(current)
        elif current is not None:
            current.text.append(line)
    includes = set()
    tail = []
    for line in r.stderr.splitlines():
        m = INCLUDE.match(line)
        if m:
            includes.add(rel(m["path"]))
        elif line.strip() and "warnings generated" not in line and not line.startswith(
                ("Suppressed ", "Use -header-filter", "Use -system-headers")):
            tail.append(line)
    return Result(unit, r.returncode, seconds, findings, includes, tail[-20:])


class Cache:
    """The last run's result of each file, reused while nothing it read has changed.

    A file's key hashes the clang-tidy version, .clang-tidy, its compile command (for a file
    not in compile_commands.json, the whole of it), and every file the last run saw it read
    (clang's -H list, itself included): the contents of files in the tree, the size and
    modification time of others (system headers, CUDA). A result with a compile error or a
    failed clang-tidy is not kept. --no-cache runs everything."""

    def __init__(self, path: Path, salt: str, enabled: bool):
        self.path, self.salt, self.enabled = path, salt, enabled
        self.fingerprints: dict[str, str] = {}
        try:
            self.entries = json.loads(path.read_text()).get("units", {})
        except (OSError, ValueError, AttributeError):
            self.entries = {}

    def fingerprint(self, f: str) -> str:
        if f not in self.fingerprints:
            p = Path(f) if os.path.isabs(f) else ROOT / f
            try:
                if os.path.isabs(f):
                    st = p.stat()
                    self.fingerprints[f] = f"{st.st_size}:{st.st_mtime_ns}"
                else:
                    self.fingerprints[f] = hashlib.sha256(p.read_bytes()).hexdigest()
            except OSError:
                self.fingerprints[f] = "missing"
        return self.fingerprints[f]

    def key(self, unit: str, command: str, inputs: list[str]) -> str:
        h = hashlib.sha256(self.salt.encode())
        h.update(command.encode())
        for f in sorted(set(inputs) | {unit}):
            h.update(f"\0{f}\0{self.fingerprint(f)}".encode())
        return h.hexdigest()

    def seconds(self, unit: str) -> float:
        return self.entries.get(unit, {}).get("seconds", 1e9)

    def lookup(self, unit: str, command: str) -> Result | None:
        e = self.entries.get(unit)
        if not self.enabled or not e or e.get("key") != self.key(unit, command, e["includes"]):
            return None
        return Result(unit, 0, 0.0, [Finding(**f) for f in e["findings"]], set(e["includes"]),
                      [])

    def store(self, r: Result, command: str) -> None:
        if r.rc != 0 or any(f.severity == "error" for f in r.findings):
            self.entries.pop(r.unit, None)
            return
        inputs = sorted(r.includes)
        self.entries[r.unit] = {"seconds": round(r.seconds, 1), "includes": inputs,
                                "key": self.key(r.unit, command, inputs),
                                "findings": [asdict(f) for f in r.findings]}

    def save(self) -> None:
        try:
            self.path.write_text(json.dumps({"units": self.entries}, sort_keys=True))
        except OSError:
            pass


def run_all(clang_tidy: str, build: Path, units: list[str], jobs: int, cache: Cache,
            commands: dict[str, str]) -> list[Result]:
    results, todo = [], []
    for u in units:
        r = cache.lookup(u, commands[u])
        if r is None:
            todo.append(u)
        else:
            results.append(r)
    if results:
        print(f"tidy: {len(results)} of {len(units)} files unchanged since their last check "
              f"(results from {rel(str(cache.path))})", flush=True)
    # Slowest first (last run's timings), so that one long unit does not run alone at the end.
    todo.sort(key=lambda u: -cache.seconds(u))
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_one, clang_tidy, build, u) for u in todo]
        for done, f in enumerate(concurrent.futures.as_completed(futures), 1):
            r = f.result()
            results.append(r)
            cache.store(r, commands[r.unit])
            print(f"tidy: [{done}/{len(todo)}] {r.unit} ({r.seconds:.1f}s)", flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Arguments after `--` go to cmake when it configures "
                                 "a new build directory.")
    ap.add_argument("-p", "--build-dir", default=str(ROOT / "build"),
                    help="CMake build directory (default: build/)")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                    help="clang-tidy processes at a time (default: all cores)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--files", nargs="+", metavar="FILE", help="check these files only")
    mode.add_argument("--all", action="store_true",
                      help="every C++ file of the build; lists the clean ones not yet listed")
    ap.add_argument("--list", default=str(LIST_FILE), help="the ratchet list")
    ap.add_argument("--no-cache", action="store_true",
                    help="check every file again, even one whose inputs did not change")
    ap.add_argument("--no-configure", action="store_true",
                    help="use the build directory's compile_commands.json as it is")
    ap.add_argument("--clang-tidy", default=os.environ.get("CLANG_TIDY", "clang-tidy"),
                    help="clang-tidy binary (default: $CLANG_TIDY or clang-tidy)")
    argv = sys.argv[1:]
    cmake_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmake_args = argv[:i], argv[i + 1:]
    args = ap.parse_args(argv)

    clang_tidy = shutil.which(args.clang_tidy)
    if clang_tidy is None:
        print(f"tidy: {args.clang_tidy} not found (scripts/setup.sh installs clang-tidy)",
              file=sys.stderr)
        return 2
    version = subprocess.run([clang_tidy, "--version"], capture_output=True, text=True).stdout
    print("tidy: " + " ".join(version.split())[:80])

    build = Path(args.build_dir).resolve()
    if not args.no_configure:
        configure(build, cmake_args)
    elif not (build / "compile_commands.json").is_file():
        print(f"tidy: {build}/compile_commands.json not found", file=sys.stderr)
        return 2
    db_text = (build / "compile_commands.json").read_text()
    commands: dict[str, str] = {}
    for entry in json.loads(db_text):
        path = entry["file"]
        if not os.path.isabs(path):
            path = os.path.join(entry["directory"], path)
        commands[rel(path)] = json.dumps(entry, sort_keys=True)
    db_units = set(commands)
    db_dirs = {os.path.dirname(u) for u in db_units}
    list_path = Path(args.list)
    patterns = read_list(list_path)
    listed_re = [glob_regex(p) for p in patterns]

    def listed(f: str) -> bool:
        return any(r.match(f) for r in listed_re)

    notes = []
    if args.all:
        units = sorted(u for u in db_units if u.endswith(SOURCE_EXTS) and u.split("/")[0]
                       in ALL_DIRS)
        headers: list[str] = []
        counts: set[str] = set()  # --all counts every project file (counted())
    else:
        if args.files:
            chosen = []
            for f in args.files:
                r = rel(f if os.path.isabs(f) else os.path.join(os.getcwd(), f))
                if not (ROOT / r).is_file():
                    print(f"tidy: {f}: no such file", file=sys.stderr)
                    return 2
                chosen.append(r)
        else:
            tree = tree_files()
            chosen = []
            for p, rx in zip(patterns, listed_re):
                hits = [f for f in tree if rx.match(f)]
                if not hits:
                    notes.append(f"pattern '{p}' matches no file (allowed)")
                chosen += hits
            chosen = sorted(set(chosen))
        units, headers = [], []
        for f in chosen:
            if f.endswith(".cu"):
                notes.append(f"{f}: CUDA source, not checked")
            elif f.endswith(HEADER_EXTS):
                headers.append(f)
            elif not f.endswith(SOURCE_EXTS):
                notes.append(f"{f}: not a C++ source or header, not checked")
            elif f in db_units:
                units.append(f)
            elif os.path.dirname(f) in db_dirs:
                notes.append(f"{f}: not compiled in {rel(str(build))}; "
                             "flags inferred from a neighbour")
                units.append(f)
            else:
                notes.append(f"{f}: nothing in its folder is compiled in {rel(str(build))} "
                             "(that part of the build is off): skipped")
        counts = set(chosen)

    config = CONFIG.read_text() if CONFIG.is_file() else ""
    cache = Cache(build / CACHE_FILE, version + "\0" + config, not args.no_cache)
    # A file not in compile_commands.json gets its flags from a neighbour: any entry may matter.
    whole_db = hashlib.sha256(db_text.encode()).hexdigest()
    for f in units + headers:
        commands.setdefault(f, "inferred:" + whole_db)
    jobs = max(1, args.jobs)
    start = time.monotonic()
    what = "--all" if args.all else ("--files" if args.files else f"list {rel(str(list_path))}")
    print(f"tidy: {len(units)} translation units, {len(headers)} headers ({what}); "
          f"{jobs} jobs; build dir {rel(str(build))}", flush=True)
    results = run_all(clang_tidy, build, units, jobs, cache, commands)

    # Headers: through the checked units that include them; the rest on their own (clang
    # infers their flags from a neighbour in compile_commands.json).
    seen = set().union(*(r.includes for r in results)) if results else set()
    alone = [h for h in headers if h not in seen]
    if alone:
        if args.files:
            print(f"tidy: {len(alone)} headers on their own", flush=True)
        else:
            print(f"tidy: {len(alone)} listed headers that no checked unit includes, on their "
                  f"own: {' '.join(alone)}", flush=True)
        results += run_all(clang_tidy, build, alone, jobs, cache, commands)
    elapsed = time.monotonic() - start

    cache.save()

    def counted(f: Finding) -> bool:
        if args.all:
            return not os.path.isabs(f.file) and f.file.split("/")[0] in ALL_DIRS
        return f.file in counts or listed(f.file)

    shown: dict[tuple, Finding] = {}
    ignored: set[tuple] = set()
    failed_units = []
    for r in results:
        for f in r.findings:
            # A compile error anywhere means the unit was not checked: it always counts.
            if f.severity == "error" or counted(f):
                shown.setdefault(f.key(), f)
            else:
                ignored.add(f.key())
        if r.rc != 0 and not any(f.severity == "error" for f in r.findings):
            failed_units.append(r)

    for n in notes:
        print(f"tidy: note: {n}")
    by_file: dict[str, int] = {}
    for f in sorted(shown.values(), key=lambda f: (f.file, f.line, f.col)):
        by_file[f.file] = by_file.get(f.file, 0) + 1
        text = list(f.text)
        text[0] = f"{f.file}:{f.line}:{f.col}: {f.severity}: {f.message} [{f.check}]"
        print("\n".join(text))
    for r in failed_units:
        print(f"tidy: clang-tidy exited {r.rc} on {r.unit}:", file=sys.stderr)
        for line in r.stderr_tail:
            print(f"  | {line}", file=sys.stderr)

    errors = sum(1 for f in shown.values() if f.severity == "error")
    print(f"tidy: {len(results)} files checked in {elapsed:.0f}s; "
          f"{len(shown)} findings ({errors} compile errors) in {len(by_file)} files"
          + ("" if args.all else f"; {len(ignored)} in files outside the list ignored"))
    if args.all:
        with_findings = set(by_file)
        clean = sorted(u for u in units if u not in with_findings and not listed(u))
        if clean:
            print(f"tidy: {len(clean)} translation units are clean but not in "
                  f"{rel(str(list_path))} (their headers may not be):")
            for u in clean:
                print(f"  {u}")
    # --all is a report: only what stopped a unit from being checked fails it.
    ok = not (errors if args.all else shown) and not failed_units
    if not args.all and not args.files:
        if ok:
            print("tidy: the listed files are clean")
        else:
            print("tidy: fix the findings above (a false positive gets "
                  "`// NOLINT(check-name): why` on its line, sparingly)")
    print(f"tidy: to add a file to the ratchet: python3 scripts/tidy.py --files <file.cpp> "
          f"[<header>...] -p {rel(str(build))}, and when it reports nothing add the path (or a "
          f"glob) to {rel(str(list_path))}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
