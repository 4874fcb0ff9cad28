"""``python -m gpuq`` (the ``gpuq`` command): ``serve`` starts a daemon with one Python pool.

gpuq serve app.ops [--gpus all|none|0,1] [--workers N] ...   (gpuq serve --help)
gpuq version
"""

from __future__ import annotations

import sys
from typing import List, Optional

_USAGE = """usage: gpuq COMMAND [ARGS...]

commands:
  serve MODULE...   start gpuqd with one Python pool running MODULE's @gpuq.op functions in
                    this Python, in the foreground (gpuq serve --help)
  version           print gpuq's version

The daemon's own commands: gpuqd (the daemon, with a config file: docs/config.md) and
gpuqctl (status, ready, top, metrics, submit, stop).
"""


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(_USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        from . import _serve

        return _serve.main(rest)
    if command in ("version", "--version"):
        from . import __version__

        print(f"gpuq {__version__}")
        return 0
    sys.stderr.write(f"gpuq: unknown command {command!r}\n\n{_USAGE}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
