"""``python -m ranklog.nemo SCRIPT [ARGS...]``: run a NeMo RL script with ranklog's logger.

The same as NeMo's ``python SCRIPT ARGS...`` after :func:`ranklog.nemo.install`:
``uv run python -m ranklog.nemo examples/run_grpo.py logger.tensorboard_enabled=true``.
"""

from __future__ import annotations

import runpy
import sys

from ranklog.nemo._install import install


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if args else 2)
    install()
    sys.argv = list(args)
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
