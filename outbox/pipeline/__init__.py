"""The downstream audit: read what the harvester published to Kafka with Spark and check it.

    python -m outbox.pipeline --topics orders,payments --out audit/
    python manage.py outbox_audit --topics orders,payments --out audit/

Nothing in this package imports Django, so `spark-submit` can run it on a cluster; the
management command is a thin wrapper that fills defaults from settings. See docs/audit.md.

- `audit`: the checks, as pure functions over DataFrames (a batch audit is one fold)
- `state`: the follow mode's state, versioned by micro-batch id on any Hadoop file system
- `follow`: Structured Streaming that folds each micro-batch into that state
- `sources`: Kafka (reachability, pinned offsets, DataFrames)
- `ledger`: ledgers of expected ids (a file, or a table through JDBC)
- `sink`: the de-duplicated records as Parquet
- `report`: report.json, the human summary and the exit code
- `jars`: where the Kafka connector's jars come from
- `session`: the SparkSession
- `cli`: the command line (`python -m outbox.pipeline`, `spark-submit outbox/pipeline/cli.py`)
"""
