from django.apps import AppConfig


class BenchConfig(AppConfig):
    name = "project.bench"
    label = "bench"
    verbose_name = "outbox benchmarks"
