"""gpuqd's config for the web examples: one Python pool, "model", whose workers import
model_ops from this folder and load the model once each.

    python examples/web/gpuqd_config.py > /tmp/gpuqd-web.json
    gpuqd --config /tmp/gpuqd-web.json &

Options: --model small|large (model.py), --workers N (the pool's workers: processes that each
hold the model; on a GPU, "kind": "gpu" and workers_per_gpu instead, docs/config.md),
--interpreter PATH (a Python with gpuq and numpy; default: this one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, Optional

HERE = os.path.dirname(os.path.abspath(__file__))


def config(model: str = "small", workers: int = 2, interpreter: Optional[str] = None,
           queue_factor: int = 16) -> Dict[str, Any]:
    """The config as a dict. The ring holds queue_factor x workers calls: enough for the web
    workers' concurrent requests to fill a batch, few enough that a burst past it is turned
    away (503) instead of waiting behind minutes of work."""
    return {
        "pools": [{
            "name": "model", "kind": "cpu", "workers": workers,
            "python": {"interpreter": interpreter or sys.executable, "modules": ["model_ops"],
                       "path": [HERE], "env": {"WEB_MODEL": model}},
        }],
        "queue_factor": queue_factor,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", choices=("small", "large"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--interpreter", default=None)
    a = p.parse_args()
    json.dump(config(a.model, a.workers, a.interpreter), sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
