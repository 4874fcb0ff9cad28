"""The Python-pool module of the pattern examples (docs/python/patterns/README.md).

gpuqd imports this module in every worker of the pools of gpuqd-patterns.json
(``"modules": ["pattern_ops"]``, ``"path"``: this folder). Its ``on_start`` builds the two small
models once per worker, before the worker reports ready:

* a character-level text generator (an order-2 Markov chain trained on ``CORPUS``), for
  textgen_executor.py;
* a small multi-layer perceptron with fixed, seeded weights, whose ``embed`` and ``classify``
  ops serve fork_pool.py and shared_gpu.py, and ``classify_batched`` (``classify`` with dynamic
  batching on) shared_gpu_batched.py.

On a gpu pool (``gpuq.context().gpu``) where torch imports, the models live on the worker's GPU
as torch tensors; anywhere else (a cpu pool, no torch) they are numpy arrays. The CPU path
needs numpy only.

The examples import this module too, without gpuq running it: for the same models as plain
numpy (to check what the pool returns, and for their "before" versions, which run in loky or
multiprocessing workers), and for ``pool_workers``. Importing it registers its ops in that
process's gpuq module, which does nothing outside a gpuq worker.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

import gpuq

# ---- the text generator -------------------------------------------------------------------------

# What the generator learns from. Any text works; this is a few lines about the library itself.
CORPUS = """\
a job queue keeps the workers busy and the callers waiting only as long as they must.
the daemon starts its workers once, loads the model once, and serves every client that asks.
a worker that holds the gpu holds it for many callers, so no caller needs a context of its own.
the callers fork, spawn and come and go; the workers stay warm and the model stays loaded.
when the queue is full the caller waits, and when a worker dies the daemon starts another.
small jobs and large jobs share the same ring, and each job knows the pool it belongs to.
the model reads the prompt, picks the next letter, and the next, until the line is long enough.
"""

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,\n"
_CODE = {c: i for i, c in enumerate(ALPHABET)}


def encode(text: str) -> np.ndarray:
    """``text`` as letter codes (letters not in ALPHABET become spaces)."""
    return np.array([_CODE.get(c, _CODE[" "]) for c in text.lower()], dtype=np.int64)


def train_text_model(corpus: str = CORPUS, smoothing: float = 0.01) -> Dict[str, Any]:
    """An order-2 character Markov chain: for each pair of letters, the cumulative distribution
    of the next one (float64, one row per pair, the last column exactly 1)."""
    v = len(ALPHABET)
    codes = encode(corpus)
    counts = np.full((v * v, v), smoothing)
    np.add.at(counts, (codes[:-2] * v + codes[1:-1], codes[2:]), 1.0)
    cdf = np.cumsum(counts / counts.sum(axis=1, keepdims=True), axis=1)
    cdf[:, -1] = 1.0  # a draw in [0, 1) always lands in some column
    return {"cdf": cdf, "letters": v}


def _draws(prompt: str, seed: int, n_lines: int, length: int) -> tuple:
    """Everything random about one generation, drawn up front with numpy: the same draws on
    the CPU and on a GPU, so both produce the same lines."""
    codes = encode(prompt if len(prompt) >= 2 else (" " + prompt).rjust(2))
    rng = np.random.default_rng(seed)
    return codes, rng.random((length, n_lines))


def letters_numpy(model: Dict[str, Any], prompt: str, seed: int, n_lines: int,
                  length: int) -> Iterator[np.ndarray]:
    """The letter codes of ``n_lines`` lines that continue ``prompt``, one step at a time: the
    t-th value holds each line's t-th letter."""
    codes, u = _draws(prompt, seed, n_lines, length)
    cdf, v = model["cdf"], model["letters"]
    state = np.full(n_lines, codes[-2] * v + codes[-1], dtype=np.int64)
    for t in range(length):
        nxt = (cdf[state] < u[t][:, None]).sum(axis=1)  # the first column with cdf >= u
        yield nxt
        state = (state % v) * v + nxt


def _letters_torch(torch: Any, model: Dict[str, Any], prompt: str, seed: int, n_lines: int,
                   length: int) -> Iterator[np.ndarray]:
    """letters_numpy on the GPU: the same comparisons of the same float64 numbers, so the same
    letters (each step's brought back to the host)."""
    codes, u = _draws(prompt, seed, n_lines, length)
    cdf, v, dev = model["cdf_t"], model["letters"], model["device"]
    u_t = torch.from_numpy(u).to(dev)
    state = torch.full((n_lines,), int(codes[-2] * v + codes[-1]), dtype=torch.int64,
                       device=dev)
    for t in range(length):
        nxt = (cdf[state] < u_t[t][:, None]).sum(dim=1)
        yield nxt.cpu().numpy()
        state = (state % v) * v + nxt


def text_of(codes: np.ndarray) -> str:
    return "".join(ALPHABET[c] for c in codes)


# ---- the perceptron -----------------------------------------------------------------------------

FEATURES = 64   # input width
HIDDEN = 256
EMBED = 32      # width of an embedding
CLASSES = 10


def mlp_weights(seed: int = 2024) -> Dict[str, np.ndarray]:
    """The perceptron's weights (float32), the same in every process for the same seed."""
    rng = np.random.default_rng(seed)

    def dense(n_in: int, n_out: int) -> np.ndarray:
        return (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)

    return {"w1": dense(FEATURES, HIDDEN), "b1": np.zeros(HIDDEN, np.float32),
            "w2": dense(HIDDEN, EMBED), "w3": dense(EMBED, CLASSES),
            "b3": (0.1 * rng.standard_normal(CLASSES)).astype(np.float32)}


def embed_numpy(w: Dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` (n x FEATURES) as unit-length embeddings (n x EMBED, float32)."""
    h = np.maximum(x.astype(np.float32, copy=False) @ w["w1"] + w["b1"], 0.0)
    e = h @ w["w2"]
    return e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)


def logits_numpy(w: Dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The class scores of the rows of ``x`` (n x CLASSES, float32)."""
    return embed_numpy(w, x) @ w["w3"] + w["b3"]


def _embed_torch(torch: Any, m: Dict[str, Any], x: np.ndarray) -> Any:
    # x is a read-only view of the caller's shared memory (page-locked on a gpu pool, so the
    # copy to the GPU is a direct DMA). torch warns that it cannot honour read-only-ness; it
    # only reads it here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        xt = torch.from_numpy(x).to(m["device"], dtype=torch.float32, non_blocking=True)
    h = torch.relu(xt @ m["w1"] + m["b1"])
    e = h @ m["w2"]
    return e / e.norm(dim=1, keepdim=True).clamp_min(1e-12)


# ---- the worker: models built once, by on_start -------------------------------------------------

_models: Dict[str, Any] = {}


def _torch_on_gpu() -> Optional[Any]:
    """torch, when this process is a gpuq worker of a gpu pool and torch imports; else None."""
    if not gpuq.context().gpu:
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch


@gpuq.on_start
def load_models() -> None:
    """Builds the models in this process (gpuq runs it once per worker, before the worker is
    ready; the examples' loky and multiprocessing workers call it themselves)."""
    torch = _torch_on_gpu()
    text = train_text_model()
    mlp = mlp_weights()
    _models.clear()
    _models.update(text=text, mlp=mlp, backend="numpy", device="cpu", torch=None)
    if torch is None:
        return
    # gpuq makes its own stream current and applies the pool's memory_limit once on_start
    # returns (torch was not loaded before it). These copies use the default stream, so wait
    # for them here: the ops run on gpuq's stream.
    dev = torch.device("cuda", gpuq.context().device)  # 0: its one GPU
    text = dict(text, cdf_t=torch.from_numpy(text["cdf"]).to(dev), device=dev)
    mlp_t = {k: torch.from_numpy(a).to(dev) for k, a in mlp.items()}
    mlp_t["device"] = dev
    torch.cuda.synchronize(dev)
    _models.update(text=text, mlp_t=mlp_t, backend="torch", device=str(dev), torch=torch)


def models() -> Dict[str, Any]:
    """This process's models, built on first use where on_start did not run."""
    if not _models:
        load_models()
    return _models


# ---- what the pools run -------------------------------------------------------------------------


def generate_lines(prompt: str, seed: int, n_lines: int, length: int) -> List[str]:
    """``n_lines`` generated lines that start with ``prompt`` (for gpuq.Executor and loky:
    a plain function, pickled by reference, that uses the model of the process it runs in)."""
    out = np.stack(list(_letters(prompt, seed, n_lines, length)))
    return [prompt + text_of(line) for line in out.T]


def _letters(prompt: str, seed: int, n_lines: int, length: int) -> Iterator[np.ndarray]:
    """letters_numpy, or on the GPU where this process's model is there."""
    m = models()
    if m["torch"] is not None:
        return _letters_torch(m["torch"], m["text"], prompt, seed, n_lines, length)
    return letters_numpy(m["text"], prompt, seed, n_lines, length)


@gpuq.op("generate_text")
def generate_text(prompt: str, seed: int, n_lines: int = 5, length: int = 120) -> Dict[str, Any]:
    """generate_lines as a named op (for a pool that does not allow callables)."""
    return {"lines": generate_lines(prompt, seed, n_lines, length)}


@gpuq.op("generate_text_stream")
def generate_text_stream(prompt: str, seed: int, n_lines: int = 5, length: int = 120,
                         step: int = 20) -> Iterator[List[str]]:
    """generate_lines as a stream (docs/python.md, "Streaming"): every ``step`` letters, each
    line's next ``step`` letters, as soon as they are made. The caller sees the first part
    while the rest is still being generated."""
    pending: List[np.ndarray] = []
    for codes in _letters(prompt, seed, n_lines, length):
        pending.append(codes)
        if len(pending) == step:
            yield [text_of(line) for line in np.stack(pending).T]
            pending = []
    if pending:
        yield [text_of(line) for line in np.stack(pending).T]


def _chunk_start(prompt: str, seed: int, n_lines: int = 5, length: int = 120,
                 step: int = 20) -> Dict[str, Any]:
    """A chunk's sequence for generate_text_steps: its draws (those of generate_lines) and
    where it is."""
    codes, u = _draws(prompt, seed, n_lines, length)
    v = models()["text"]["letters"]
    return {"u": u, "t": 0, "step": step,
            "state": np.full(n_lines, codes[-2] * v + codes[-1], dtype=np.int64)}


@gpuq.step_op("generate_text_steps", start=_chunk_start, max_batch_size=64)
def generate_text_steps(chunks: List[Dict[str, Any]]) -> List[tuple]:
    """generate_text_stream with step-level batching (docs/python.md, "Step-level batching"):
    each step makes the next ``step`` letters of every line of every live chunk, from any
    caller, in one set of array operations (numpy), and a chunk leaves when its lines are
    complete. The same letters as generate_lines."""
    cdf, v = models()["text"]["cdf"], models()["text"]["letters"]
    n = min(min(c["step"], len(c["u"]) - c["t"]) for c in chunks)  # letters all can take
    state = np.concatenate([c["state"] for c in chunks])
    made = []
    for k in range(n):
        u = np.concatenate([c["u"][c["t"] + k] for c in chunks])
        nxt = (cdf[state] < u[:, None]).sum(axis=1)
        made.append(nxt)
        state = (state % v) * v + nxt
    letters = np.stack(made)  # (n, every line of every chunk)
    out, at = [], 0
    for c in chunks:
        lines = len(c["state"])
        c["state"] = state[at:at + lines]
        c["t"] += n
        out.append(([text_of(line) for line in letters[:, at:at + lines].T],
                     c["t"] == len(c["u"])))
        at += lines
    return out


@gpuq.op("embed")
def embed(x: np.ndarray) -> np.ndarray:
    """Unit-length embeddings (n x 32, float32) of the rows of ``x`` (n x 64)."""
    m = models()
    if m["torch"] is not None:
        return _embed_torch(m["torch"], m["mlp_t"], x).cpu().numpy()
    return embed_numpy(m["mlp"], x)


@gpuq.op("classify")
def classify(x: np.ndarray) -> tuple:
    """(labels int64, confidence float32) of the rows of ``x`` (n x 64)."""
    m = models()
    torch = m["torch"]
    if torch is not None:
        t = m["mlp_t"]
        probs = torch.softmax(_embed_torch(torch, t, x) @ t["w3"] + t["b3"], dim=1)
        conf, labels = probs.max(dim=1)
        return labels.cpu().numpy(), conf.cpu().numpy()
    z = logits_numpy(m["mlp"], x)
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    return p.argmax(axis=1), p.max(axis=1)


@gpuq.op("classify_batched", max_batch_size=64, max_queue_delay_us=500)
def classify_batched(x: np.ndarray) -> tuple:
    """classify, batched: one call for the rows of many callers' jobs (up to 64 rows)."""
    # The worker gathers queued jobs of this op from every client, up to 64 rows or until
    # 500 us have passed, and calls it once with their arrays concatenated along axis 0: x is
    # (their rows together) x 64. The same model as classify, and the same answer: two arrays
    # of one row per input row, which the worker splits back into each caller's rows.
    return classify(x)


@gpuq.op("model_info")
def model_info() -> Dict[str, Any]:
    """Where this worker keeps its models, and on a GPU how much device memory it has used."""
    m = models()
    ctx = gpuq.context()
    info: Dict[str, Any] = {
        "worker": ctx.worker_id, "pid": os.getpid(), "backend": m["backend"],
        "device": m["device"],
        "model_bytes": int(m["text"]["cdf"].nbytes + sum(a.nbytes for a in m["mlp"].values())),
    }
    torch = m["torch"]
    if torch is not None:
        free, total = torch.cuda.mem_get_info()
        info.update(peak_allocated=int(torch.cuda.max_memory_allocated()),
                    reserved=int(torch.cuda.memory_reserved()), device_free=int(free),
                    device_total=int(total), gpu=torch.cuda.get_device_name())
    return info


# ---- for the examples' client side --------------------------------------------------------------


def pool_workers(client: Any, pool: str) -> int:
    """How many workers run ``pool``'s jobs: its own, or, for a gpu pool that is unavailable
    and falls back to a cpu pool, that pool's."""
    pools = {p["name"]: p for p in client.status()["pools"]}
    if pool not in pools:
        raise SystemExit(f"this daemon has no pool {pool!r} (it has {sorted(pools)}); start "
                         "gpuqd with examples/python/patterns/gpuqd-patterns.json or pass --pool")
    p = pools[pool]
    if p.get("workers_total", 0) == 0 and p.get("fallback"):
        p = pools[p["fallback"]]
    return max(1, int(p.get("workers_total", 0)))


def default_pool() -> str:
    """The pool the examples use unless given --pool: $GPUQ_PATTERNS_POOL, else
    "patterns-gpu" (gpuqd-patterns.json's gpu pool; without a GPU it sends its jobs to the
    cpu Python pool "patterns")."""
    return os.environ.get("GPUQ_PATTERNS_POOL") or "patterns-gpu"
