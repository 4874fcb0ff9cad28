"""The Python-pool module of the TensorFlow pattern examples (docs/python/patterns/tensorflow.md).

gpuqd imports this module in every worker of the pools of gpuqd-tf-patterns.json
(``"modules": ["tf_ops"]``, ``"path"``: this folder). Its ``on_start`` builds a small
``tf.keras`` model once per worker, before the worker reports ready: the perceptron of
pattern_ops.py (the same seeded weights), whose ``tf_embed`` and ``tf_classify`` ops serve
tf_fork_pool.py and tf_shared_gpu.py. The ops return TensorFlow tensors; the worker turns them
into numpy arrays for the caller, who needs no TensorFlow at all.

TensorFlow is imported at the top of the module, not in ``on_start``: on a gpu pool the worker
turns on TensorFlow's memory growth and gives it one logical GPU of the pool's
``memory_limit`` right after the pool's modules are imported, and TensorFlow accepts that only
before it has initialised its GPUs (docs/python.md, "In the worker"). On a cpu pool, or with
``tensorflow-cpu``, the model runs on the CPU.

The weights are made here with the same numpy draws as pattern_ops.mlp_weights, rather than
imported from pattern_ops: importing that module would register its ops and its ``on_start``
(which loads torch on a gpu pool) in these workers too. The clients check the answers against
pattern_ops's numpy model, so the two cannot drift apart unnoticed.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's info lines: not in the log

from typing import Any, Dict  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import gpuq  # noqa: E402

FEATURES = 64   # input width
HIDDEN = 256
EMBED = 32      # width of an embedding
CLASSES = 10


def mlp_weights(seed: int = 2024) -> Dict[str, np.ndarray]:
    """pattern_ops.mlp_weights: the same float32 weights for the same seed."""
    rng = np.random.default_rng(seed)

    def dense(n_in: int, n_out: int) -> np.ndarray:
        return (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)

    return {"w1": dense(FEATURES, HIDDEN), "b1": np.zeros(HIDDEN, np.float32),
            "w2": dense(HIDDEN, EMBED), "w3": dense(EMBED, CLASSES),
            "b3": (0.1 * rng.standard_normal(CLASSES)).astype(np.float32)}


def build_model(w: Dict[str, np.ndarray]) -> Any:
    """The perceptron as a tf.keras model: rows (n x 64) to (unit-length embeddings n x 32,
    class probabilities n x 10)."""
    x = tf.keras.Input(shape=(FEATURES,), dtype="float32")
    h = tf.keras.layers.Dense(HIDDEN, activation="relu", name="hidden")(x)
    e = tf.keras.layers.Dense(EMBED, use_bias=False, name="embed")(h)
    e = tf.keras.layers.UnitNormalization(name="unit")(e)
    logits = tf.keras.layers.Dense(CLASSES, name="logits")(e)
    model = tf.keras.Model(x, [e, tf.keras.layers.Softmax(name="probs")(logits)])
    model.get_layer("hidden").set_weights([w["w1"], w["b1"]])
    model.get_layer("embed").set_weights([w["w2"]])
    model.get_layer("logits").set_weights([w["w3"], w["b3"]])
    return model


# ---- the worker: the model built once, by on_start -----------------------------------------------

_model: Dict[str, Any] = {}


@gpuq.on_start
def load_model() -> None:
    """Builds the model and traces its call once (any number of rows), so that the first job
    pays for neither."""
    model = build_model(mlp_weights())
    infer = tf.function(lambda x: model(x, training=False),
                        input_signature=[tf.TensorSpec([None, FEATURES], tf.float32)])
    infer(tf.zeros([1, FEATURES], tf.float32))
    _model.update(model=model, infer=infer)


def _infer(x: np.ndarray) -> Any:
    if not _model:
        load_model()
    # x is a read-only view of the caller's shared memory: convert_to_tensor copies it.
    return _model["infer"](tf.convert_to_tensor(x, dtype=tf.float32))


@gpuq.op("tf_embed")
def tf_embed(x: np.ndarray) -> Any:
    """Unit-length embeddings (n x 32, float32) of the rows of ``x`` (n x 64), as a TensorFlow
    tensor: the caller gets a numpy array."""
    embedding, _ = _infer(x)
    return embedding


@gpuq.op("tf_classify")
def tf_classify(x: np.ndarray) -> tuple:
    """(labels int64, confidence float32) of the rows of ``x`` (n x 64), as TensorFlow
    tensors."""
    _, probs = _infer(x)
    return tf.argmax(probs, axis=1), tf.reduce_max(probs, axis=1)


@gpuq.op("tf_model_info")
def tf_model_info() -> Dict[str, Any]:
    """Where this worker's model lives, and on a GPU what TensorFlow was given and has used."""
    if not _model:
        load_model()
    device = _model["model"].weights[0].value.device
    gpus = tf.config.list_physical_devices("GPU")
    info: Dict[str, Any] = {
        "worker": gpuq.context().worker_id, "pid": os.getpid(), "backend": "tensorflow",
        "tensorflow": tf.__version__, "device": device.split("/")[-1] if device else "CPU:0",
        "model_bytes": int(sum(np.prod(v.shape) * 4 for v in _model["model"].weights)),
        "gpus": len(gpus)}
    if gpus:
        logical = tf.config.get_logical_device_configuration(gpus[0]) or []
        used = tf.config.experimental.get_memory_info("GPU:0")
        info.update(memory_growth=bool(tf.config.experimental.get_memory_growth(gpus[0])),
                    memory_limit_mib=[c.memory_limit for c in logical],
                    peak_allocated=int(used["peak"]), current_allocated=int(used["current"]))
    return info

