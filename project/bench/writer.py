"""Writers for the side-by-side benchmark, each in a process of its own (so its CPU never competes with the
measuring process's): psycopg only, plain SQL, as an application in any language would write.

    DATABASE_URL=DSN python -m project.bench.writer outbox --topic T --records N --rate R --batch B --keys K --out F
    DATABASE_URL=DSN python -m project.bench.writer backlog --topic T --records N --keys K
    DATABASE_URL=DSN python -m project.bench.writer unrelated --rate R --duration S --batch B

The DSN comes from the environment, not the command line, where `ps` would show its password.

`outbox` writes records at a steady rate, one INSERT a row (or, with `--insert transaction`, one a
transaction, as stash_many() writes), `batch` rows a transaction, and writes each transaction's ids and
commit time to F (one `id time` line each); `backlog` writes as fast as it can,
1,000 rows a statement (as stash_many() does); `unrelated` inserts rows into the `unrelated` table at a
steady rate, `batch` rows a statement, for `duration` seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import psycopg

#: What a writer in another language does: a plain INSERT, no stash(), no NOTIFY of its own (outbox_pump's too).
PLAIN_INSERT = ("INSERT INTO outbox (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, "
                "kafka_header_values) VALUES (now(), %s, %s, %s, '{}', '{}') RETURNING id")
BACKLOG_INSERT = """
INSERT INTO outbox (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values)
SELECT now(), %(topic)s, k, v, '{}', '{}' FROM unnest(%(keys)s::text[], %(values)s::text[]) AS r(k, v)
"""
UNRELATED_TABLE = """
CREATE TABLE IF NOT EXISTS unrelated (
  id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now(), account integer NOT NULL,
  amount numeric(12, 2) NOT NULL, note text NOT NULL)
"""
UNRELATED_INSERT = """
INSERT INTO unrelated (account, amount, note)
SELECT a, a * 0.01, 'payment ' || a FROM unnest(%(accounts)s::integer[]) AS r(a)
"""
#: About 100 bytes a value, as the other benchmarks write.
PADDING = "x" * 90


def paced(rate: float, began: float, done: int) -> None:
    ahead = done / rate - (time.perf_counter() - began)
    if ahead > 0:
        time.sleep(ahead)


def write_outbox(dsn: str, topic: str, records: int, rate: float, batch: int, keys: int, out: str,
                 per_transaction: bool = False) -> None:
    with psycopg.connect(dsn) as conn, open(out, "w") as log:
        began, written = time.perf_counter(), 0
        while written < records:
            count = min(batch, records - written)
            with conn.transaction(), conn.cursor() as cursor:
                rows = range(written, written + count)
                if per_transaction:
                    cursor.execute(BACKLOG_INSERT + "RETURNING id", {
                        "topic": topic, "keys": [f"key-{i % keys}" for i in rows],
                        "values": [f"{i}:{PADDING}" for i in rows]})
                    ids = [row[0] for row in cursor.fetchall()]
                else:
                    ids = []
                    for i in rows:
                        cursor.execute(PLAIN_INSERT, [topic, f"key-{i % keys}", f"{i}:{PADDING}"])
                        ids.append(cursor.fetchone()[0])
            committed = time.time()
            log.write("".join(f"{record_id} {committed:.6f}\n" for record_id in ids))
            written += count
            paced(rate, began, written)


def write_backlog(dsn: str, topic: str, records: int, keys: int) -> None:
    with psycopg.connect(dsn) as conn:
        for start in range(0, records, 1000):
            rows = range(start, min(records, start + 1000))
            with conn.transaction():
                conn.execute(BACKLOG_INSERT, {"topic": topic, "keys": [f"key-{i % keys}" for i in rows],
                                              "values": [f"{i}:{PADDING}" for i in rows]})


def write_unrelated(dsn: str, rate: float, duration: float, batch: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        began, written = time.perf_counter(), 0
        while time.perf_counter() - began < duration:
            conn.execute(UNRELATED_INSERT, {"accounts": [(written + i) % 100_000 for i in range(batch)]})
            written += batch
            paced(rate, began, written)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m project.bench.writer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["outbox", "backlog", "unrelated"])
    parser.add_argument("--topic", default="bench")
    parser.add_argument("--records", type=int, default=0)
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=0.0)
    parser.add_argument("--out", default="/dev/null")
    parser.add_argument("--insert", choices=["row", "transaction"], default="row",
                        help="outbox: one INSERT a row (default), or one a transaction")
    args = parser.parse_args(argv)
    args.dsn = os.environ.get("DATABASE_URL") or parser.error("DATABASE_URL: not set (the database to write to)")
    if args.mode == "outbox":
        write_outbox(args.dsn, args.topic, args.records, args.rate, args.batch, args.keys, args.out,
                     per_transaction=args.insert == "transaction")
    elif args.mode == "backlog":
        write_backlog(args.dsn, args.topic, args.records, args.keys)
    else:
        write_unrelated(args.dsn, args.rate, args.duration, args.batch)


if __name__ == "__main__":
    main(sys.argv[1:])
