"""Stand-ins for the backend clients NeMo RL code reaches through its loggers.

In NeMo RL, ``logger.wandb_logger.run`` is a ``wandb.Run``, ``TensorboardLogger.writer``
a ``SummaryWriter`` and ``MLflowLogger.run`` MLflow's active run. Under ranklog.nemo the
clients live in the shipper processes, so these objects give what NeMo code and
callbacks use from them, each write routed through the spool like any other value:

- :class:`WandbRun` (``wandb_logger.run``): ``id``, ``name``, ``project``, ``entity``,
  ``group``, ``tags``, ``notes``, ``dir``, ``path``, ``url``, ``offline``; ``config``
  (updates are hyperparameters), ``summary`` (updates are summary records), ``log``,
  ``define_metric``.
- :class:`SwanlabRun` (``swanlab_logger.run``): the same identity, ``config``, ``log``.
- :class:`SummaryWriter` (``TensorboardLogger.writer``): ``add_scalar``, ``add_scalars``,
  ``add_text``, ``add_histogram``, ``add_figure``, ``add_hparams``, ``flush``, ``close``,
  ``log_dir``.

Anything else raises :class:`~ranklog.errors.UnsupportedError` naming the attribute.
A write without a step goes to the step the logger is at.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, ClassVar

from ranklog.errors import UnsupportedError

if TYPE_CHECKING:
    from ranklog.nemo._session import Session

__all__ = ["ConfigView", "SummaryView", "SummaryWriter", "SwanlabRun", "WandbRun"]

#: where docs/nemo.md lists what each stand-in offers
_DOCS = "docs/nemo.md, 'Backend objects'"


def _unsupported(owner: str, name: str, offered: tuple[str, ...]) -> UnsupportedError:
    return UnsupportedError(
        f"{owner}.{name} is not available under ranklog.nemo: the backend's client lives "
        f"in the shipper process. {owner} offers {', '.join(offered)} ({_DOCS})"
    )


class _Strict:
    """Refuses, by name, any public attribute its class does not define."""

    OWNER: ClassVar[str]
    OFFERS: ClassVar[tuple[str, ...]]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise UnsupportedError(name)  # copy, pickle and the like probe dunders
        raise _unsupported(self.OWNER, name, self.OFFERS)


class ConfigView(MutableMapping[str, Any]):
    """``run.config``: what this process logged as hyperparameters; a write logs one."""

    def __init__(self, session: Session) -> None:
        self._session = session

    @property
    def _data(self) -> dict[str, Any]:
        return self._session.config

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._session.log_hyperparams({key: value})

    def __delitem__(self, key: str) -> None:
        raise UnsupportedError(
            f"run.config: deleting {key!r} is not possible: a logged hyperparameter stays "
            "in every backend"
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __getattr__(self, key: str) -> Any:  # wandb's ``run.config.lr``
        if key.startswith("_"):
            raise UnsupportedError(key)
        try:
            return self._session.config[key]
        except KeyError:
            raise UnsupportedError(key) from None

    def update(self, *args: Any, allow_val_change: bool = True, **kwargs: Any) -> None:
        """Log the items of a mapping (wandb's ``config.update(d, allow_val_change=True)``)."""
        values = dict(*args, **kwargs)
        if values:
            self._session.log_hyperparams(values)

    def as_dict(self) -> dict[str, Any]:
        """A copy of what was logged (wandb's ``config.as_dict()``)."""
        return dict(self._data)


class SummaryView(MutableMapping[str, Any]):
    """``run.summary``: a write sets a summary value in W&B (a run record, docs/producer.md);
    reads give what this process set."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._data: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.update({key: value})

    def __delitem__(self, key: str) -> None:
        raise UnsupportedError(f"run.summary: deleting {key!r} is not possible under ranklog")

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Set several summary values at once."""
        values = dict(*args, **kwargs)
        self._session.run.log_summary(values)
        self._data.update(values)


class _Run(_Strict):
    """What NeMo code uses of a backend's run object: its identity, config and ``log``."""

    def __init__(self, session: Session, cfg: Mapping[str, Any], dir: str | None) -> None:
        self._session = session
        self.id: str = str(cfg.get("id") or self._default_id(session))
        self.name: str = str(cfg.get("name") or session.run.info.name)
        self.project: str | None = cfg.get("project")
        self.dir = dir
        self.config = ConfigView(session)

    @staticmethod
    def _default_id(session: Session) -> str:
        return session.run.info.run_id

    def log(
        self, data: Mapping[str, Any], step: int | None = None, commit: bool | None = None
    ) -> None:
        """Log values as the Logger's ``log_metrics`` does; no step: the logger's current one.

        ``commit=True`` with a step closes that step (the shippers forward it).
        """
        at = self._session.current_step() if step is None else step
        self._session.log_metrics(data, at, "", None, bool(commit and step is not None))


class WandbRun(_Run):
    """``wandb_logger.run``: the W&B run the shipper writes, as NeMo code uses one."""

    OWNER = "wandb_logger.run"
    OFFERS = (
        "id", "name", "project", "entity", "group", "tags", "notes", "dir", "path", "url",
        "offline", "config", "summary", "log", "define_metric",
    )  # fmt: skip

    def __init__(self, session: Session, cfg: Mapping[str, Any], dir: str | None) -> None:
        super().__init__(session, cfg, dir)
        self.project = str(cfg.get("project") or "nemo-rl")
        self.entity: str | None = cfg.get("entity") or os.environ.get("WANDB_ENTITY") or None
        self.group: str | None = cfg.get("group")
        self.tags: tuple[str, ...] = tuple(cfg.get("tags") or ())
        self.notes: str | None = cfg.get("notes")
        self.summary = SummaryView(session)
        self._mode = str(cfg.get("mode") or "")

    @staticmethod
    def _default_id(session: Session) -> str:
        from ranklog.shippers.targets.wandb import wandb_run_id  # wandb itself is not imported

        return wandb_run_id(session.run.info.run_id)

    @property
    def offline(self) -> bool:
        """Whether the shipper writes the run offline (then ``url`` is None)."""
        from ranklog.shippers.targets.wandb import default_mode

        return (self._mode or default_mode()) == "offline"

    @property
    def path(self) -> str:
        """``entity/project/id`` (W&B's run path)."""
        return f"{self.entity or ''}/{self.project}/{self.id}"

    @property
    def url(self) -> str | None:
        """The run's page: None offline, or when the entity is not configured (W&B takes
        the API key's default entity, which only the shipper learns)."""
        if self.offline or not self.entity:
            return None
        base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").rstrip("/")
        app = base.replace("://api.", "://", 1)
        return f"{app}/{self.entity}/{self.project}/runs/{self.id}"

    def define_metric(
        self, name: str, step_metric: str | None = None, step_sync: bool | None = None,
        hidden: bool | None = None, summary: str | None = None, goal: str | None = None,
        overwrite: bool | None = None,
    ) -> None:  # fmt: skip
        """W&B's ``define_metric``, recorded in the spool and given to the W&B run."""
        if step_sync is False or overwrite is False:
            raise UnsupportedError(
                f"wandb_logger.run.define_metric({name!r}): step_sync=False and "
                "overwrite=False are not forwarded (W&B's defaults apply)"
            )
        self._session.run.define_metric(
            name, step_metric, summary=summary, hidden=bool(hidden), goal=goal
        )


class SwanlabRun(_Run):
    """``swanlab_logger.run``: the SwanLab run the shipper writes offline."""

    OWNER = "swanlab_logger.run"
    OFFERS = ("id", "name", "project", "dir", "config", "log")


class SummaryWriter(_Strict):
    """``TensorboardLogger.writer``: a ``SummaryWriter``'s writes, routed through the spool
    to every backend the Logger ships to (the event files are the shipper's)."""

    OWNER = "TensorboardLogger.writer"
    OFFERS = (
        "add_scalar", "add_scalars", "add_text", "add_histogram", "add_figure",
        "add_hparams", "flush", "close", "log_dir", "get_logdir",
    )  # fmt: skip

    def __init__(self, session: Session, log_dir: str | None) -> None:
        self._session = session
        self.log_dir = log_dir

    def get_logdir(self) -> str | None:
        """Where the shipper writes the event files."""
        return self.log_dir

    def _step(self, global_step: int | None) -> int:
        return self._session.current_step() if global_step is None else global_step

    def add_scalar(
        self, tag: str, scalar_value: Any, global_step: int | None = None,
        walltime: float | None = None, new_style: bool = False, double_precision: bool = False,
    ) -> None:  # fmt: skip
        """One scalar at ``global_step`` (the logger's step when None)."""
        self._session.log_metrics({tag: scalar_value}, self._step(global_step), "", None, False)

    def add_scalars(
        self, main_tag: str, tag_scalar_dict: Mapping[str, Any], global_step: int | None = None,
        walltime: float | None = None,
    ) -> None:  # fmt: skip
        """Several scalars, each as ``main_tag/tag`` (one run, not a sub-run per tag)."""
        values = {f"{main_tag}/{k}": v for k, v in tag_scalar_dict.items()}
        self._session.log_metrics(values, self._step(global_step), "", None, False)

    def add_text(
        self, tag: str, text_string: str, global_step: int | None = None,
        walltime: float | None = None,
    ) -> None:  # fmt: skip
        """A text at ``global_step``."""
        self._session.log_text(tag, text_string, self._step(global_step))

    def add_histogram(
        self, tag: str, values: Any, global_step: int | None = None, bins: Any = "tensorflow",
        walltime: float | None = None, max_bins: int | None = None,
    ) -> None:  # fmt: skip
        """A distribution at ``global_step`` (binned by each backend)."""
        self._session.log_histogram(values, self._step(global_step), tag)

    def add_figure(
        self, tag: str, figure: Any, global_step: int | None = None, close: bool = True,
        walltime: float | None = None,
    ) -> None:  # fmt: skip
        """A matplotlib figure, as an image; closed afterwards unless ``close=False``."""
        self._session.log_plot(figure, self._step(global_step), tag)
        if close:
            import matplotlib.pyplot as plt

            plt.close(figure)

    def add_hparams(
        self, hparam_dict: Mapping[str, Any], metric_dict: Mapping[str, Any],
        hparam_domain_discrete: Any = None, run_name: str | None = None,
        global_step: int | None = None,
    ) -> None:  # fmt: skip
        """Hyperparameters, and ``metric_dict`` as metrics at ``global_step``."""
        self._session.log_hyperparams(hparam_dict)
        if metric_dict:
            self._session.log_metrics(metric_dict, self._step(global_step), "", None, False)

    def flush(self) -> None:
        """Hand what was logged to the spool now."""
        if not self._session.run.closed:
            self._session.run.flush()

    def close(self) -> None:
        """Nothing to close: the Logger's ``finish()`` ends the run."""
