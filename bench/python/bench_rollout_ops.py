"""Ops of bench_rollout.py's pool: a small torch model (an MLP, made in on_start, as a model
would be loaded) and one op that runs it on the caller's rows. Its import and on_start are what
a rolling restart pays for each new worker. VERSION is read from version.txt beside this file at
import: the bench raises it before each rollout, so that answers say which version served."""

import os

import torch

import gpuq

_HERE = os.path.dirname(os.path.abspath(__file__))
try:
    with open(os.path.join(_HERE, "version.txt")) as _f:
        VERSION = int(_f.read())
except OSError:
    VERSION = 1
_model = {}


@gpuq.on_start
def _load():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    net = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    ).to(device).eval()
    with torch.no_grad():  # the first call's one-off costs before ready, as a warm-up would
        net(torch.zeros(8, 256, device=device))
    _model["net"], _model["device"] = net, device


@gpuq.op("infer")
def infer(x):
    with torch.no_grad():
        y = _model["net"](torch.as_tensor(x, device=_model["device"]))
    return {"y": y.argmax(dim=1).tolist(), "version": VERSION, "pid": os.getpid()}
