"""The peers' own test suites against gpuq's drop-ins (docs/python.md, "Differences from the
stdlib and joblib"):

* joblib's ``joblib/test/test_parallel.py`` and its ``conftest.py``, from the released source
  (sdist) of the joblib pinned in requirements.txt, with ``"gpuq"`` added to the suite's lists
  of process backends, run with ``-k gpuq``;
* CPython's ``test/test_concurrent_futures.py`` of this interpreter (Debian's
  ``libpython3.11-testsuite``, scripts/setup.sh), its executor tests built on
  :class:`gpuq.Executor` (test_cpython_futures.py).

Both run in one pytest session against one gpuqd of build/ (gpuq_compat.py); every test passes
or is listed in differences.txt with its reason.

    python tests/compat/run.py [--out DIR] [pytest args...]

Run it with the interpreter of a venv that has ``./python[test]`` and requirements.txt (the
python stage of scripts/test.sh does). ``GPUQ_GPUQD`` names the daemon (default
build/daemon/gpuqd).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tarfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# (what the suite's source says, what it says with gpuq, how many times it must be found): a
# release whose lists changed fails here instead of quietly testing less.
JOBLIB_PATCHES = [
    ('PROCESS_BACKENDS = ["multiprocessing", "loky"]',
     'PROCESS_BACKENDS = ["multiprocessing", "loky", "gpuq"]', 1),
    ('@parametrize("backend", ["loky", "multiprocessing", "threading"])',
     '@parametrize("backend", ["loky", "multiprocessing", "threading", "gpuq"])', 1),
    ('@parametrize("backend", ["threading", "loky", "multiprocessing", "back_compat_backend"])',
     '@parametrize("backend", ["threading", "loky", "multiprocessing", "back_compat_backend", '
     '"gpuq"])', 1),
    ('@parametrize("backend", ["loky", "threading"])',
     '@parametrize("backend", ["loky", "threading", "gpuq"])', 1),
    ('(["threading"] if mp is None else ["loky", "threading"])',
     '(["threading"] if mp is None else ["loky", "threading", "gpuq"])', 1),
]


def pinned(name: str) -> str:
    for line in (HERE / "requirements.txt").read_text().splitlines():
        m = re.match(rf"^{re.escape(name)}==(\S+)", line.strip())
        if m:
            return m.group(1)
    raise SystemExit(f"run.py: requirements.txt pins no {name}")


def joblib_suite(out: pathlib.Path) -> pathlib.Path:
    """The pinned joblib's test_parallel.py (patched) and conftest.py in out/joblib/."""
    version = pinned("joblib")
    import joblib
    if joblib.__version__ != version:
        raise SystemExit(f"run.py: joblib {joblib.__version__} is installed, requirements.txt "
                         f"pins {version}: pip install -r {HERE / 'requirements.txt'}")
    dist = out / "dist"
    sdist = dist / f"joblib-{version}.tar.gz"
    if not sdist.exists():
        dist.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", f"joblib=={version}", "-d", str(dist)],
                       check=True)
    suite = out / "joblib"
    suite.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        for member, name in ((f"joblib-{version}/joblib/test/test_parallel.py",
                              "test_parallel.py"),
                             (f"joblib-{version}/conftest.py", "conftest.py")):
            f = tar.extractfile(member)
            if f is None:
                raise SystemExit(f"run.py: {sdist} has no {member}")
            text = f.read().decode()
            if name == "test_parallel.py":
                for old, new, count in JOBLIB_PATCHES:
                    if text.count(old) != count:
                        raise SystemExit(f"run.py: joblib {version}'s test_parallel.py has "
                                         f"{text.count(old)} of {old!r}, not {count}: update "
                                         "JOBLIB_PATCHES for this release")
                    text = text.replace(old, new)
            (suite / name).write_text(text)
    return suite


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "build-python" / "compat"),
                    help="where the suites are unpacked (default build-python/compat)")
    args, pytest_args = ap.parse_known_args()
    out = pathlib.Path(args.out).resolve()
    suite = joblib_suite(out)
    os.environ.setdefault("GPUQ_GPUQD", str(ROOT / "build" / "daemon" / "gpuqd"))
    # The workers import the suites' modules by name (cloudpickle sends their functions by
    # reference), from these folders (the pool's python.path, gpuq_compat.py).
    os.environ["GPUQ_COMPAT_PATH"] = os.pathsep.join([str(suite), str(HERE)])
    sys.path.insert(0, str(HERE))
    import pytest
    return int(pytest.main([
        "-p", "gpuq_compat", "-p", "no:cacheprovider", "--rootdir", str(out),
        "--timeout", "300", "-o", "addopts=",
        str(suite / "test_parallel.py"), str(HERE / "test_cpython_futures.py"),
        *pytest_args]))


if __name__ == "__main__":
    sys.exit(main())
