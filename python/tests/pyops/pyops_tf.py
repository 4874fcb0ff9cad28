"""TensorFlow ops of test_tensorflow.py's pools (python/tests/test_tensorflow.py): TensorFlow
imported at the module's top, as a gpu pool needs it (the worker configures it before
on_start)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import gpuq  # noqa: E402


@gpuq.op("tf_square")
def tf_square(x):
    """An EagerTensor: x squared."""
    return tf.square(tf.convert_to_tensor(x))


@gpuq.op("tf_variable")
def tf_variable():
    """A tf.Variable itself."""
    return tf.Variable([[1.0, 2.0], [3.0, 4.0]])


@gpuq.op("tf_pair")
def tf_pair(x):
    """A tuple of tensors of two dtypes: each row's sum and the index of its largest value."""
    t = tf.convert_to_tensor(x)
    return tf.reduce_sum(t, axis=1), tf.cast(tf.argmax(t, axis=1), tf.int32)


@gpuq.op("tf_relu_batched", max_batch_size=64, max_queue_delay_us=2000)
def tf_relu_batched(x):
    """Batched, answering a tensor: split back into each job's rows."""
    return tf.nn.relu(tf.convert_to_tensor(x))


@gpuq.op("tf_raise_oom")
def tf_raise_oom(msg):
    """TensorFlow's own out-of-memory exception, raised as TensorFlow raises it."""
    raise tf.errors.ResourceExhaustedError(None, None, msg)


@gpuq.op("tf_alloc")
def tf_alloc(rows, cols):
    """A rows x cols uint8 tensor of ones, allocated by TensorFlow on its default device (past
    what it can get: a real ResourceExhaustedError, "OOM when allocating tensor ...")."""
    t = tf.ones([int(rows), int(cols)], tf.uint8)
    return int(tf.size(t, out_type=tf.int64).numpy())


@gpuq.op("tf_gpu_config")
def tf_gpu_config():
    """What the worker made of TensorFlow's GPU: its memory growth and logical devices."""
    gpus = tf.config.list_physical_devices("GPU")
    out = {"gpus": len(gpus), "memory_growth": None, "memory_limit_mib": None,
           "logical_gpus": len(tf.config.list_logical_devices("GPU"))}
    if gpus:
        out["memory_growth"] = bool(tf.config.experimental.get_memory_growth(gpus[0]))
        out["memory_limit_mib"] = [c.memory_limit for c in
                                   tf.config.get_logical_device_configuration(gpus[0]) or []]
    return out


@gpuq.op("tf_numpy_ok")
def tf_numpy_ok(x):
    """A plain numpy answer from a TensorFlow pool (the common path)."""
    return np.asarray(x) + 1
