"""The Python ops of bench_steps.py's Python pool: gpuqd's Python workers import this module
(the pool's ``python.path`` is this directory).

One small autoregressive model, a GRU language model in torch (float32): 64 tokens, an
embedding of 32, ``torch.nn.GRUCell(32, 128)`` and a linear head 128 -> 64; a sequence starts
from a token and a zero hidden state, and each step feeds the last token, runs the cell once
and takes the head's argmax (greedy decoding: the tokens are a function of the start token
alone). The weights are made once per worker, in the ``on_start`` hook, from a fixed seed, so
every worker (and every op) computes the same function. Three ops serve it:

  gen_step     ``@gpuq.step_op("gen_step", start=gen_start, max_batch_size=32)``: step-level
               batching. ``gen_start(token, length)`` makes a sequence's state ({"h", "token",
               "left"}); each step stacks the live sequences' hidden states and tokens, runs
               the cell once for all of them and returns each sequence's new token, done when
               it has made ``length``. A sequence joins at the next step and leaves when done.
  gen_batched  ``@gpuq.op("gen_batched", max_batch_size=32, max_queue_delay_us=500)``:
               request-level batching. A job's arguments are two int64 arrays of one row each,
               ``tokens`` (the start token) and ``lengths``; the worker concatenates the rows of
               the jobs it gathers, and the function runs every row until the longest sequence
               of the call has ended (a short one waits for it), returning an int64 array
               (rows, longest length), each row its sequence's tokens padded with -1 (the caller
               keeps its own length).
  gen_single   ``@gpuq.op("gen_single")``: no batching: ``gen_single(token, length)`` makes one
               sequence, returned as an int64 array (length,).

``gen_stats`` returns this worker's counters (its pid; per step size, the steps and their time
in the step function and between steps; the request-level and single calls and their time): what
bench_steps.py uses to say where a step's time goes.

Torch is imported in ``on_start``, not at the top, so that gpuqd's op listing (``--list-ops``)
does not pay for it (and the module imports where torch is missing; its ops then fail).
"""

import os
import time

import numpy as np

import gpuq

VOCAB, EMBED, HIDDEN = 64, 32, 128
SEED = 4242
MAX_LENGTH = 1000
# If a step's gap from the previous one is longer than this, the worker was idle in between:
# it is not counted as time between steps.
GAP_NS = 5_000_000

_model = None  # (embedding, cell, head) under torch.inference_mode
_torch = None

# This worker's counters (gen_stats).
_step_calls: dict = {}  # step size -> [steps, ns in the step function, gaps counted, ns between]
_last_step_end = 0
_batched = [0, 0, 0, 0, 0, 0]  # calls, rows, steps run, ns, tokens kept, rows x steps
_single = [0, 0, 0]  # calls, steps run, ns


@gpuq.on_start
def _load() -> None:
    global _model, _torch
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only before any parallel work; harmless to skip
        pass
    torch.manual_seed(SEED)
    embedding = torch.nn.Embedding(VOCAB, EMBED)
    cell = torch.nn.GRUCell(EMBED, HIDDEN)
    head = torch.nn.Linear(HIDDEN, VOCAB)
    for m in (embedding, cell, head):
        m.eval()
        for p in m.parameters():
            p.requires_grad_(False)
    _torch = torch
    _model = (embedding, cell, head)
    with (
        torch.inference_mode()
    ):  # first calls: torch's lazy setup, at each batch size used
        for rows in (1, 2, 8, 32):
            _advance(torch.zeros(rows, HIDDEN), torch.zeros(rows, dtype=torch.int64))


def _advance(h, tokens):
    """One step for a batch: hidden states (rows, 128) float32 and last tokens (rows,) int64 ->
    (new hidden states, next tokens). Under torch.inference_mode."""
    embedding, cell, head = _model
    h = cell(embedding(tokens), h)
    return h, head(h).argmax(1)


def _check(token, length):
    token, length = int(token), int(length)
    if not 0 <= token < VOCAB:
        raise ValueError(f"token {token} is not 0 to {VOCAB - 1}")
    if not 1 <= length <= MAX_LENGTH:
        raise ValueError(f"length {length} is not 1 to {MAX_LENGTH}")
    return token, length


# ---- step-level batching -------------------------------------------------------------------


def gen_start(token, length):
    """A sequence's state: its hidden state (zeros), its last token, the steps it has left."""
    token, length = _check(token, length)
    return {"h": _torch.zeros(HIDDEN), "token": token, "left": length}


@gpuq.step_op("gen_step", start=gen_start, max_batch_size=32)
def gen_step(states):
    """One token for each live sequence of the GRU: one cell call for all of them."""
    global _last_step_end
    t0 = time.perf_counter_ns()
    torch = _torch
    with torch.inference_mode():
        h, nxt = _advance(
            torch.stack([s["h"] for s in states]),
            torch.tensor([s["token"] for s in states], dtype=torch.int64),
        )
    tokens = nxt.tolist()
    out = []
    for i, s in enumerate(states):
        s["h"] = h[i]
        s["token"] = tokens[i]
        s["left"] -= 1
        out.append((tokens[i], s["left"] == 0))
    t1 = time.perf_counter_ns()
    c = _step_calls.get(len(states))
    if c is None:
        c = _step_calls[len(states)] = [0, 0, 0, 0]
    c[0] += 1
    c[1] += t1 - t0
    if _last_step_end and t0 - _last_step_end < GAP_NS:
        c[2] += 1
        c[3] += t0 - _last_step_end
    _last_step_end = t1
    return out


# ---- request-level batching and none -------------------------------------------------------


@gpuq.op("gen_batched", max_batch_size=32, max_queue_delay_us=500)
def gen_batched(tokens, lengths):
    """The GRU for a batch of rows (start tokens, lengths: int64 arrays of the same rows), every
    row run until the longest ends: int64 (rows, longest), each row padded with -1."""
    t0 = time.perf_counter_ns()
    torch = _torch
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if tokens.shape != lengths.shape:
        raise ValueError(
            f"tokens {tokens.shape} and lengths {lengths.shape} differ in rows"
        )
    for t, n in zip(tokens.tolist(), lengths.tolist()):
        _check(t, n)
    rows, longest = len(tokens), int(lengths.max())
    out = torch.empty((rows, longest), dtype=torch.int64)
    with torch.inference_mode():
        h = torch.zeros(rows, HIDDEN)
        tok = torch.from_numpy(tokens.copy())
        for i in range(longest):
            h, tok = _advance(h, tok)
            out[:, i] = tok
    result = out.numpy()
    result[np.arange(longest)[None, :] >= lengths[:, None]] = -1
    _batched[0] += 1
    _batched[1] += rows
    _batched[2] += longest
    _batched[3] += time.perf_counter_ns() - t0
    _batched[4] += int(lengths.sum())
    _batched[5] += rows * longest
    return result


@gpuq.op("gen_single")
def gen_single(token, length):
    """The GRU for one sequence: its tokens, int64 (length,)."""
    t0 = time.perf_counter_ns()
    token, length = _check(token, length)
    torch = _torch
    out = torch.empty(length, dtype=torch.int64)
    with torch.inference_mode():
        h = torch.zeros(1, HIDDEN)
        tok = torch.tensor([token], dtype=torch.int64)
        for i in range(length):
            h, tok = _advance(h, tok)
            out[i] = tok[0]
    _single[0] += 1
    _single[1] += length
    _single[2] += time.perf_counter_ns() - t0
    return out.numpy()


@gpuq.op("gen_stats")
def gen_stats():
    """This worker's counters: {"pid", "step": {size: [steps, ns in step, gaps, ns between]},
    "batched": [calls, rows, steps, ns, tokens kept, rows x steps], "single": [calls, steps,
    ns], "torch": version}."""
    return {
        "pid": os.getpid(),
        "step": {str(k): list(v) for k, v in sorted(_step_calls.items())},
        "batched": list(_batched),
        "single": list(_single),
        "torch": _torch.__version__ if _torch is not None else None,
    }
