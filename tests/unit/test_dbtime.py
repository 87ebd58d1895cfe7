"""outbox.harvest.dbtime: the harvester's statements told apart in pg_stat_statements' rows, and the round trips'
tally. (tests/integration/test_database_cost.py reads the real view.)"""

from __future__ import annotations

import re
import threading

from outbox.harvest import contract, dbtime


def as_pg_stat_statements_keeps_it(text: str) -> str:
    """What pg_stat_statements shows of a statement psycopg sent: parameters as $1.., then each constant as the
    next $n (and its own white space untouched)."""
    names: dict[str, int] = {}

    def parameter(found: re.Match[str]) -> str:
        return f"${names.setdefault(found.group(1), len(names) + 1)}"

    sent = re.sub(r"%\((\w+)\)s", parameter, text)
    count = iter(range(len(names) + 1, 1000))
    return re.sub(r"'[^']*'|(?<![\w.$])\d+(?![\w.])", lambda _: f"${next(count)}", sent)


def test_every_statement_of_the_engine_is_told_as_its_kind_in_the_form_pg_stat_statements_keeps():
    statements = dbtime.engine_statements("outbox", "outbox_dead_letter")
    kinds = dbtime.StatementKinds(statements)
    assert set(statements.values()) == set(dbtime.SERVER_KINDS) - {"status"}
    for query_id, (text, kind) in enumerate(statements.items()):
        kept = as_pg_stat_statements_keeps_it(text)
        assert kept != text or "%(" not in text
        assert kinds.kind(query_id, kept) == kind, kept


def test_the_same_statements_on_another_table_are_not_this_tables():
    kinds = dbtime.StatementKinds(dbtime.engine_statements("outbox"))
    other = dbtime.engine_statements("other.outbox")
    mark = next(text for text, kind in other.items() if kind == "mark")
    assert kinds.kind(1, as_pg_stat_statements_keeps_it(mark)) is None
    assert kinds.kind(2, "SELECT * FROM outbox WHERE id > $1") is None


def test_a_query_id_once_told_is_not_told_again():
    kinds = dbtime.StatementKinds({contract.TAKE_FENCE: "fence"})
    assert kinds.kind(7, "SELECT pg_try_advisory_lock($1)") == "fence"
    assert kinds.kind(7, "anything") == "fence"
    assert kinds.kind(8, "SELECT pg_advisory_lock($1)") is None


def test_normalizing_keeps_identifiers_and_casts_and_drops_values():
    assert dbtime.normalize("SELECT  1 FROM \"t2\"\n WHERE id = %(id)s::bigint AND x = 'a''b'") == \
        dbtime.normalize('select $2 from "t2" where id = $1::bigint and x = $3')
    assert dbtime.normalize('SELECT 1 FROM "t2"') != dbtime.normalize('SELECT 1 FROM "t3"')


def test_the_filter_keeps_the_tables_rows_quoted_as_the_engine_names_them():
    patterns = dbtime.server_patterns(["outbox", "other.out_box"])
    assert patterns[:2] == ['%"outbox"%', '%"other"."out_box"%']
    assert "%pg_locks%" in patterns


def test_round_trips_add_up_across_threads():
    trips = dbtime.RoundTrips()

    def add() -> None:
        for _ in range(1000):
            trips.add("purge", 0.001, 2)

    threads = [threading.Thread(target=add) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    trips.add("mark", 0.5, 10)
    totals = trips.totals()
    assert totals["purge"][0] == 4000 and totals["purge"][2] == 8000 and abs(totals["purge"][1] - 4.0) < 1e-6
    assert totals["mark"] == (1, 0.5, 10)
    assert dbtime.as_json(totals)["mark"] == [1, 0.5, 10]


class Views:
    """pg_stat_statements as ServerTime reads it: the texts (LEARN) or the rows of known query ids (READ)."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[str, int]] = {}  # query id -> (text, calls)
        self.learns = 0

    def execute(self, query: str, params: dict) -> Views:
        if query == dbtime.LEARN:
            self.learns += 1
            self.answer = [(qid, text, calls, 1.0, 1) for qid, (text, calls) in self.rows.items()]
        else:
            self.answer = [(qid, calls, 1.0, 1) for qid, (_, calls) in self.rows.items() if qid in params["ids"]]
        return self

    def fetchall(self) -> list:
        return self.answer


def test_a_statement_first_run_after_the_leader_started_is_counted_within_seconds_then_texts_are_read_seldom():
    kinds = dbtime.StatementKinds(dbtime.engine_statements("outbox"))
    now = [0.0]
    server = dbtime.ServerTime(kinds, dbtime.server_patterns(["outbox"]), clock=lambda: now[0])
    views = Views()
    views.rows[1] = (contract.TAKE_FENCE, 1)
    assert set(server.read(views)) == {"fence"}
    views.rows[2] = (contract.WRITERS, 3)  # the first gap's lookup, after the first read
    learnt_at = None
    while learnt_at is None:
        now[0] += 1.0
        if "writers" in server.read(views):
            learnt_at = now[0]
    assert learnt_at == dbtime.FIRST_RELEARN, "read again 10 s after the first read, not ten minutes"
    views.learns = 0
    for _ in range(3600):  # an hour more, a read a second
        now[0] += 1.0
        assert server.read(views)["writers"][0] == 3
    # 20 s, then 40, 80, 160, 320, then every 600: nine reads of the texts in the hour, not 3,600
    assert views.learns <= 10, views.learns
    # A leader again after standing by: what its new term runs first is counted within seconds again.
    server.again()
    views.learns = 0
    now[0] += 1.0
    server.read(views)
    now[0] += dbtime.FIRST_RELEARN
    server.read(views)
    assert views.learns == 2


def test_every_statement_the_status_board_sends_on_its_tables_counts_as_status():
    """The samples count the status writer's own statements as `status`, the harvested tables' backlogs read among
    them (it names pg_stat_user_tables, not the status table: only this list tells it)."""
    from outbox.harvest import status, status_board

    texts = [as_pg_stat_statements_keeps_it(text) for text in status_board.writer_statements("outbox_harvester")]
    kinds = dbtime.StatementKinds(dict.fromkeys(status_board.writer_statements("outbox_harvester"), "status"))
    for query_id, text in enumerate((status_board.BACKLOGS, status_board.UPSERT_MANY_SHARDS, status.PRUNE)):
        sent = text.replace("{table}", '"outbox_harvester"')
        assert kinds.kind(query_id, as_pg_stat_statements_keeps_it(sent)) == "status", text
    assert len(texts) == len(set(texts))
