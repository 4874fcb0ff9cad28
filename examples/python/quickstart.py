"""Quickstart: connect, put an array in the shared segment, run echo and a gemm, read status().

Needs a running gpuqd whose cpu workers have oneDNN (scripts/setup.sh installs it); the client
finds it through $GPUQ_RUNTIME_DIR, else the rule of docs/service.md. Run:

    python examples/python/quickstart.py
"""
import numpy as np

import gpuq

# wait=30: a daemon started just before (`gpuqd & python examples/python/quickstart.py`) may not
# have its socket yet; without it, a missing daemon raises gpuq.Disconnected at once.
with gpuq.connect(name="quickstart", wait=30) as client:
    print("pools:", [p["name"] for p in client.pools], "ops:", client.ops)

    # An array in this client's segment: workers read and write it in place.
    x = client.array(np.arange(12, dtype=np.float32).reshape(3, 4))
    assert client.in_segment(x)

    # echo copies the input bytes to `out`; the result is `out` itself.
    y = client.submit("echo", x, out=client.empty_like(x)).result()
    assert np.array_equal(y, x)

    # A tensor op: y = a @ b, a new array in the segment.
    rng = np.random.default_rng(0)
    a = client.array(rng.standard_normal((64, 32), dtype=np.float32))
    b = client.array(rng.standard_normal((32, 16), dtype=np.float32))
    fut = client.gemm(a, b)
    c = fut.result()
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    print("gemm", c.shape, "ran on worker", fut.info.worker_id,
          "in", fut.info.run_ns / 1000, "us")

    # The daemon's status document, as `gpuqctl status --json` prints it.
    st = client.status()
    pool = st["pools"][0]
    print(f"daemon {st['version']} {st['state']}: pool {pool['name']}, "
          f"{pool['workers_ready']}/{pool['workers_total']} workers ready, "
          f"{pool['jobs_completed']} jobs completed")
    assert st["ready"]
print("ok")
