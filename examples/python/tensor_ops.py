"""The six tensor helpers (docs/ops.md), each checked against a numpy reference.

cpu pools run them in float32 with oneDNN. Run (gpuqd running, $GPUQ_RUNTIME_DIR if needed):

    python examples/python/tensor_ops.py
"""
import functools

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

import gpuq

rng = np.random.default_rng(0)
client = gpuq.connect()
close = functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-4)


def arr(*shape):  # a random float32 array in the segment
    return client.array(rng.standard_normal(shape, dtype=np.float32))


def windows(x, k, stride):  # N x C x OH x OW x k x k
    return sliding_window_view(x, (k, k), axis=(2, 3))[:, :, ::stride, ::stride]


x, w, b = arr(2, 3, 9, 9), arr(4, 3, 3, 3), arr(4)              # N x C x H x W, K x C x R x S, K
# conv2d reference: the 3x3 windows of x padded by 1, at stride 2, times w
conv = np.einsum("nchwrs,kcrs->nkhw", windows(np.pad(x, [(0, 0)] * 2 + [(1, 1)] * 2), 3, 2), w)
close(client.conv2d(x, w, b, stride=2, padding=1, relu=True).result(),
      np.maximum(conv + b[None, :, None, None], 0))
for mode, ref in [("relu", lambda v: np.maximum(v, 0)), ("tanh", np.tanh),
                  ("sigmoid", lambda v: 1 / (1 + np.exp(-v)))]:
    close(client.activation(x, mode).result(), ref(x))
s = arr(4, 10)                                                  # softmax over dimension 1
p = np.exp(s) / np.exp(s).sum(axis=1, keepdims=True)
close(client.softmax(s).result(), p)
close(client.softmax(s, log=True).result(), np.log(p))
close(client.pool2d(x, 3, stride=2).result(), windows(x, 3, 2).max(axis=(4, 5)))
close(client.pool2d(x, 3, mode="avg").result(), windows(x, 3, 3).mean(axis=(4, 5)))
scale, bias, mean = arr(3), arr(3), arr(3)
var = client.array(rng.uniform(0.5, 2.0, 3).astype(np.float32))
ch = (None, slice(None), None, None)                            # per channel of N x C x H x W
close(client.batchnorm(x, scale, bias, mean, var, eps=1e-3).result(),
      scale[ch] * (x - mean[ch]) / np.sqrt(var[ch] + 1e-3) + bias[ch])
a, bt, c = arr(8, 5), arr(6, 8), arr(5, 6)                      # y = 0.5 a^T bt^T + 2 c: 5 x 6
y = client.empty((5, 6))                                        # out=: an array of your own
assert client.gemm(a, bt, c, trans_a=True, trans_b=True, alpha=0.5, beta=2.0, out=y).result() is y
close(y, 0.5 * a.T @ bt.T + 2 * c)
print("ok: conv2d, activation, softmax, pool2d, batchnorm, gemm match numpy")
