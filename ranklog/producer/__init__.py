"""The producer: what training code calls. :func:`init` returns a :class:`Run`."""

from ranklog.producer._env import RankInfo, detect_rank
from ranklog.producer._init import init
from ranklog.producer._run import Durability, Run
from ranklog.producer._values import flatten_params

__all__ = ["Durability", "RankInfo", "Run", "detect_rank", "flatten_params", "init"]
