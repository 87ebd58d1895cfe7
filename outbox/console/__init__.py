"""The operator console: what the Django admin shows of the outbox and its queues, and what an operator does there.

    admin.py          the outbox's admin pages: records, dead letters, the dashboard, and the actions on records
    dashboard.py      the dashboard's figures: leader, replicas, backlog, held and stuck records
    history.py        the harvesters' samples read in buckets over a span, drawn as the dashboard's charts
    charts.py         the charts as inline SVG (no JavaScript), shared with the queue pages
    database_cost.py  what harvesting cost the database over a span, by kind of statement
    operations.py     what an operator does to records (retry, park, requeue, republish), through the engine's SQL
    pages.py          what every console page shares: refresh and span, who may see a page, shortened texts

The write path (`outbox.stash`, `outbox.models`) and the record states (`outbox.states`), which health checks and
metrics read too, stay outside; the queues' own pages (`outbox.queue.admin`) build on `pages` and `charts`.
The app label, template paths, admin URLs and URL names are the `outbox` app's, as before.
"""
