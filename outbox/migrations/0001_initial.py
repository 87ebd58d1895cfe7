import django.contrib.postgres.fields
import django.db.models.functions.datetime
from django.db import migrations, models

# Each harvested row is inserted, updated once (mark) and deleted once (purge), so the table
# churns through two dead tuples per message while staying small. Defaults (vacuum when 20%
# of the table is dead) let dead tuples pile up under a sustained load; these settings vacuum
# after a fixed number of dead rows, unthrottled, and leave free space on each page so the
# mark UPDATE can stay on its page (a HOT update: no new index entry). docs/tuning.md
# explains the numbers.
STORAGE = (
    "fillfactor = 70",
    "autovacuum_vacuum_scale_factor = 0.0",
    "autovacuum_vacuum_threshold = 5000",
    "autovacuum_vacuum_insert_scale_factor = 0.0",
    "autovacuum_vacuum_insert_threshold = 20000",
    "autovacuum_analyze_scale_factor = 0.0",
    "autovacuum_analyze_threshold = 20000",
    "autovacuum_vacuum_cost_delay = 0",
)
TOAST_STORAGE = tuple(f"toast.{s}" for s in STORAGE if s.startswith("autovacuum_vacuum"))


class Migration(migrations.Migration):
    initial = True
    dependencies = []

    operations = [
        migrations.CreateModel(
            name="OutboxRecord",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("create_time", models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ("kafka_topic", models.CharField(max_length=249)),
                ("kafka_key", models.CharField(max_length=1000)),
                ("kafka_value", models.TextField(blank=True, null=True)),
                ("kafka_header_keys", django.contrib.postgres.fields.ArrayField(
                    base_field=models.TextField(), blank=True, default=list, size=None)),
                ("kafka_header_values", django.contrib.postgres.fields.ArrayField(
                    base_field=models.TextField(), blank=True, default=list, size=None)),
                ("leader_id", models.UUIDField(blank=True, null=True)),
            ],
            options={"verbose_name": "outbox record", "db_table": "outbox", "ordering": ["id"]},
        ),
        migrations.RunSQL(
            sql=[
                "ALTER TABLE outbox ALTER COLUMN kafka_header_keys SET DEFAULT '{}'",
                "ALTER TABLE outbox ALTER COLUMN kafka_header_values SET DEFAULT '{}'",
                "ALTER TABLE outbox ADD CONSTRAINT outbox_headers_paired "
                "CHECK (cardinality(kafka_header_keys) = cardinality(kafka_header_values))",
                f"ALTER TABLE outbox SET ({', '.join(STORAGE)})",
                f"ALTER TABLE outbox SET ({', '.join(TOAST_STORAGE)})",
            ],
            reverse_sql=[
                "ALTER TABLE outbox DROP CONSTRAINT outbox_headers_paired",
                "ALTER TABLE outbox ALTER COLUMN kafka_header_keys DROP DEFAULT",
                "ALTER TABLE outbox ALTER COLUMN kafka_header_values DROP DEFAULT",
            ],
        ),
    ]
