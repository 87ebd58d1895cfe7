"""`queue.consumer("emails")`, as the README and docs/queues.md show it, is the function whatever else was imported:
a submodule of the same name once took its place in the package once anything had imported it."""

from __future__ import annotations

import importlib
import pkgutil

import outbox.queue


def test_every_submodule_imported_leaves_the_public_names_functions_and_classes():
    for module in pkgutil.iter_modules(outbox.queue.__path__):
        if module.name not in {"admin", "apps", "models", "overview", "status", "store", "runner", "history",
                               "checks", "app_settings", "metrics", "api", "cli"}:  # those need Django set up
            importlib.import_module(f"outbox.queue.{module.name}")
    for name in outbox.queue.__all__:
        found = getattr(outbox.queue, name)
        assert callable(found) and not hasattr(found, "__path__") and type(found).__name__ != "module", name


def test_no_submodule_of_a_package_has_the_name_of_one_of_its_public_functions():
    for name in ("outbox", "outbox.queue", "outbox.testing"):
        package = importlib.import_module(name)
        submodules = {m.name for m in pkgutil.iter_modules(package.__path__)}
        clashes = [public for public in set(package.__all__) & submodules
                   if public != "signals"]  # outbox.signals is the module itself, by design
        assert not clashes, f"{name}: {sorted(clashes)} would be shadowed by the submodule once it is imported"
