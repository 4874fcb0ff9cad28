"""multiprocessing with the fork, spawn and forkserver start methods: each child submits jobs.

The children use gpuq.submit, the module's default client. A forked child that inherited the
parent's connection gets one of its own on first use; the parent's jobs are not touched. A
spawned child connects on first use; $GPUQ_RUNTIME_DIR passes down in the environment. Run:

    python examples/python/multiprocessing_fork.py
"""
import multiprocessing as mp
import os

import numpy as np

import gpuq


def checksum_job(i):
    data = np.full(1000, i, np.uint8)            # a plain array: copied into this process's segment
    crc = gpuq.submit("checksum", data).result()
    return os.getpid(), i, crc


if __name__ == "__main__":
    want = {i: gpuq.submit("checksum", np.full(1000, i, np.uint8)).result() for i in range(8)}
    running = gpuq.submit("sleep", us=300_000)   # the parent's, in flight across the forks
    for method in ("fork", "spawn", "forkserver"):
        with mp.get_context(method).Pool(2) as pool:
            results = pool.map(checksum_job, range(8))
        assert {i: crc for _, i, crc in results} == want
        pids = sorted({pid for pid, _, _ in results})
        assert os.getpid() not in pids
        print(f"{method:10} 8 checksums right, from child processes {pids}")
    assert running.result() == 300_000           # the parent's job, unharmed
    print("ok")
