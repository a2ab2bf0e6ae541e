"""The targets: one module per backend, each declaring itself with a ``TARGET``.

::

    jsonl.py         jsonl:PATH          one JSON line per step
    console.py       console[:N]         a readable line per N-th step, validation samples
    tensorboard.py   tensorboard:DIR     event files, written with the tensorboard package
    mlflow.py        mlflow[:URI]        an MLflow run (sqlite store or tracking server)
    wandb.py         wandb:PROJECT       a W&B run (offline or online)
    _media.py        histograms, images and GPU statistics in each backend's form
    _tfrecord.py     TFRecord framing and its CRC-32C (TensorBoard's event files)
    _mlflow_rows.py  MLflow keys, metric rows with their marker, artifact paths
    _wandb_log.py    a reader of W&B's own transaction log (the durable step)
    _wandb_config.py a W&B run's config: nested params, read back from the log

Each implements :class:`ranklog.shippers.Target` and is found by
:func:`ranklog.shippers.target_kinds`; nothing here imports a backend library
until its target is built. ``docs/targets.md`` shows how to add one.
"""
