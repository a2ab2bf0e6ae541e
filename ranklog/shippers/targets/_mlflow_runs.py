"""Finding and making the MLflow experiment and runs of a ranklog run, by their tags.

Used by :mod:`ranklog.shippers.targets.mlflow`. A ranklog run's MLflow runs are found
by the tag ``ranklog.run_id`` (and ``ranklog.role``, ``ranklog.rank``), never by a
name, so that every shipper process, and every restart, lands in the same run; a
create that was retried and made two runs is resolved the same way by all of them
(the oldest, then the lowest id). Also where NeMo RL's config puts them
(:func:`nemo_arg`, :func:`nemo_options`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from ranklog.errors import TargetError, TargetHeldError, TransientTargetError
from ranklog.shippers.targets._mlflow_rows import _ms

__all__ = ["KIND", "KIND_TAG", "adopt", "create", "experiment", "nemo_arg", "nemo_options",
           "oldest", "search"]  # fmt: skip

#: what MLflow 3's UI reads to show an experiment's runs as model training (its runs
#: table and charts), not as GenAI evaluation runs
KIND_TAG: Final = "mlflow.experimentKind"
KIND: Final = "custom_model_development"


def experiment(client: Any, name: str, artifact_root: str | None) -> str:
    """The id of the active experiment ``name``, created (tagged as model training) if
    missing; an experiment with no kind yet is given that one."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            tags = {KIND_TAG: KIND}
            return str(client.create_experiment(name, artifact_location=artifact_root, tags=tags))
        except MlflowException as exc:  # created meanwhile by another shipper
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise exc from None
    if exp.lifecycle_stage != "active":
        raise TargetError(f"MLflow experiment {name!r} is deleted: restore it or choose "
                           "another --experiment")  # fmt: skip
    if exp.tags.get(KIND_TAG) is None:  # the UI's training view, not GenAI's
        client.set_experiment_tag(exp.experiment_id, KIND_TAG, KIND)
    return str(exp.experiment_id)


def adopt(client: Any, run_id: str, ranklog_id: str, tags: dict[str, str]) -> Any:
    """The existing run ``run_id`` (NeMo's ``run_id``), tagged as this ranklog run's main
    run; one that holds another ranklog run is refused."""
    from mlflow.entities import RunTag

    found = client.get_run(run_id)
    owner = found.data.tags.get("ranklog.run_id")
    if owner not in (None, ranklog_id):
        raise TargetHeldError(
            f"MLflow run {run_id} holds run {owner}, not this run {ranklog_id}: use "
            "another --run-id (without one, each ranklog run gets its own MLflow run)"
        )
    if owner is None:
        new = [RunTag(k, v) for k, v in {"ranklog.run_id": ranklog_id, **tags}.items()]
        client.log_batch(run_id, tags=new, synchronous=True)
        found = client.get_run(run_id)
    return found


def search(client: Any, exp_id: str, ranklog_id: str, extra: str = "") -> list[Any]:
    """Every active run of this ranklog run in the experiment (main and per-rank)."""
    query = f"tags.\"ranklog.run_id\" = '{ranklog_id}'{extra}"
    runs: list[Any] = []
    token = None
    while True:
        page = client.search_runs([exp_id], query, max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def oldest(runs: list[Any]) -> Any:
    """The run every shipper process agrees on, should a retried create have made two."""
    return min(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id))


def create(
    client: Any, exp_id: str, ranklog_id: str, name: str, tags: dict[str, str], *,
    started: float | None, extra: str = "",
) -> Any:  # fmt: skip
    """Create a run, then find it again by tags (a retried request may have made two).

    It starts when the ranklog run was created (``started``), so that its end, the time
    of the last step shipped, comes after its start in the UI.
    """
    tags = {"ranklog.run_id": ranklog_id, **tags}
    start = _ms(started) if started is not None else 0
    client.create_run(exp_id, start_time=start or None, run_name=name, tags=tags)
    role = tags["ranklog.role"]
    found = [r for r in search(client, exp_id, ranklog_id, extra)
             if r.data.tags.get("ranklog.role") == role]  # fmt: skip
    if not found:
        raise TransientTargetError(f"the MLflow run just created for {name!r} is not found yet")
    return oldest(found)


# -- NeMo RL's MLflow runs: where they are and how they are named -----------------------


def nemo_arg(section: Mapping[str, Any], backend_dir: Path) -> str:
    """NeMo RL's tracking URI: the config's, else ``MLFLOW_TRACKING_URI``, else a local store.

    (NeMo RL leaves MLflow's own default; ranklog's is a sqlite file in the backend dir,
    as MLflow's docs advise: the file store breaks on "/" in metric names.)
    """
    uri = section.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
    return str(uri or f"sqlite:///{(backend_dir / 'mlflow.db').resolve()}")


def nemo_options(section: Mapping[str, Any], backend_dir: Path) -> dict[str, Any]:
    """NeMo RL's rules: each setting from the config, else its ``MLFLOW_*`` variable; a new
    experiment's artifacts in ``artifact_location``, else the backend dir; plots at
    ``plots/<name>.png``; GPU series under the Ray monitor's names."""
    env = os.environ.get
    return {
        "run_id": section.get("run_id") or env("MLFLOW_RUN_ID"),
        "experiment": section.get("experiment_name") or env("MLFLOW_EXPERIMENT_NAME"),
        "run_name": section.get("run_name") or env("MLFLOW_RUN_NAME"),
        "artifact_location": section.get("artifact_location") or backend_dir.resolve().as_uri(),
        "image_layout": "latest",
        "gpu_names": "nemo",
        "histogram_stats": "mean,p50,p90,max",  # NeMo's summary of a list
    }
