"""joblib.Parallel over a PyTorch function: joblib's "gpuq" backend in place of loky.

The naive version runs the function in loky's workers (joblib's default backend)::

    def features(seed):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        x = torch.from_numpy(signals(seed)).to(device)
        ...
    results = Parallel(n_jobs=8)(delayed(features)(seed) for seed in range(48))

loky starts 8 fresh processes; each imports torch and, on a GPU machine, creates a CUDA context
of its own on its first call (seconds each, and some hundreds of MiB of GPU memory each, with
nothing that limits their memory together). They run on the GPU all at once, each in its own
context, time-sliced by the driver.

With ``joblib.parallel_backend("gpuq", pool=...)`` the same ``Parallel`` call runs each batch of
calls as one ``gpuq.Executor`` task in a Python pool's warm workers: torch is imported and the
CUDA context made once per worker, when gpuqd starts it; on a gpu pool the function finds the
worker's device in ``gpuq.context()`` (and runs on the stream gpuq made current, within the
pool's ``memory_limit``). The function travels by value (cloudpickle: it is defined in
``__main__``), so the pool needs ``"allow_callables": true``.

The function uses torch where it imports and numpy where it does not (the CPU path needs numpy
only). The script runs it with loky twice (the first call starts the workers, the second reuses
them) and once through gpuq, checks all three against numpy, and prints the timings.

Run, with gpuqd serving the pools of gpuqd-patterns.json (edit its paths first)::

    gpuqd --config examples/python/patterns/gpuqd-patterns.json
    python examples/python/patterns/joblib_torch.py [--pool NAME] [--n-jobs 8]

The pool is --pool, else $GPUQ_PATTERNS_POOL, else "patterns-gpu". The page:
docs/python/patterns/joblib_torch.md.
"""
import argparse
import os
import time

import joblib
import numpy as np

import gpuq  # registers joblib's "gpuq" backend
import pattern_ops  # this folder is on sys.path: it is the script's own

SIGNALS, SAMPLES, BANDS = 64, 4096, 16


def signals(seed):
    """SIGNALS noisy sums of sines of SAMPLES samples (float32), the same for the same seed."""
    rng = np.random.default_rng(seed)
    t = np.arange(SAMPLES) / SAMPLES
    freqs = rng.uniform(1, SAMPLES / 2, size=(SIGNALS, 3, 1))
    x = np.sin(2 * np.pi * freqs * t).sum(axis=1) + 0.1 * rng.standard_normal((SIGNALS, SAMPLES))
    return x.astype(np.float32)


def features_numpy(x):
    """Log band energies of each signal's spectrum (SIGNALS x BANDS, float32)."""
    spec = np.abs(np.fft.rfft(x, axis=1)) ** 2
    return np.log1p(spec[:, 1:].reshape(len(x), BANDS, -1).mean(axis=2)).astype(np.float32)


def torch_device(torch):
    """In a gpuq worker of a gpu pool: its GPU (gpuq made its stream current). Anywhere else
    what naive code does: the GPU when this process sees one."""
    ctx = gpuq.context()
    if ctx.gpu and ctx.torch_device is not None:
        return ctx.torch_device
    return "cuda" if torch.cuda.is_available() else "cpu"


def features(seed):
    """The function the Parallel calls run: features_numpy in torch, where torch imports.
    Returns (the process, what computed it, the features)."""
    x = signals(seed)
    try:
        import torch
    except ImportError:
        return os.getpid(), "numpy", features_numpy(x)
    t = torch.from_numpy(x).to(torch_device(torch))
    spec = torch.fft.rfft(t, dim=1).abs() ** 2
    f = torch.log1p(spec[:, 1:].reshape(len(x), BANDS, -1).mean(dim=2))
    return os.getpid(), f"torch on {t.device}", f.cpu().numpy()


def timed_parallel(n_jobs, items):
    t0 = time.perf_counter()
    out = joblib.Parallel(n_jobs=n_jobs)(joblib.delayed(features)(seed) for seed in items)
    where = sorted({w for _, w, _ in out})
    return time.perf_counter() - t0, [f for _, _, f in out], {pid for pid, _, _ in out}, where


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", default=pattern_ops.default_pool(),
                        help="the gpuq Python pool (default: $GPUQ_PATTERNS_POOL, else "
                             "patterns-gpu)")
    parser.add_argument("--n-jobs", type=int, default=8, help="joblib's n_jobs")
    parser.add_argument("--items", type=int, default=48, help="calls of the function")
    args = parser.parse_args()
    items = range(args.items)

    # Before: joblib's default backend, loky.
    t_cold, by_loky, loky_pids, loky_where = timed_parallel(args.n_jobs, items)
    t_warm, again, _, _ = timed_parallel(args.n_jobs, items)

    # After: the same call in the gpuq pool's workers.
    with joblib.parallel_backend("gpuq", pool=args.pool):
        t_gpuq, by_gpuq, gpuq_pids, gpuq_where = timed_parallel(args.n_jobs, items)

    with gpuq.connect(name="joblib_torch") as client:
        runs_on = next(p["runs_on"] for p in client.pools if p["name"] == args.pool)
        pool_pids = {w["pid"] for p in client.status()["pools"] if p["name"] == runs_on
                     for w in p["workers"]}

    for seed in items:
        want = features_numpy(signals(seed))
        for name, got in (("loky", by_loky), ("loky again", again), ("gpuq", by_gpuq)):
            np.testing.assert_allclose(got[seed], want, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{name}, seed {seed}")
    assert gpuq_pids <= pool_pids, "the gpuq calls should run in the pool's workers"
    assert not loky_pids & pool_pids

    print(f"{args.items} calls, joblib.Parallel(n_jobs={args.n_jobs}); computed with "
          f"{', '.join(loky_where)} in loky's workers, {', '.join(gpuq_where)} in gpuq's:")
    rows = [(f"loky, first call (starts {len(loky_pids)} workers)", t_cold),
            ("loky, second call (reuses them)", t_warm),
            (f"gpuq backend, pool {args.pool!r} ({len(pool_pids)} warm workers of "
             f"{runs_on!r})", t_gpuq)]
    width = max(len(label) for label, _ in rows) + 1
    for label, seconds in rows:
        print(f"  {label + ':':<{width}} {seconds:6.2f} s")
    print("  the three agree with numpy")
    print("ok")


if __name__ == "__main__":
    main()
