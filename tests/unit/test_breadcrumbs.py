"""The console's breadcrumbs read as the admin's own: "Home > Outbox > Dashboard", not "Home >Outbox"."""

from __future__ import annotations

from outbox.templatetags import outbox_admin


def test_items_are_apart_as_the_admins_own() -> None:
    html = str(outbox_admin.breadcrumbs("/admin/", "Home", "/admin/outbox/", "Outbox", "", "Dashboard"))
    if outbox_admin.ORDERED_BREADCRUMBS:  # Django 6: the arrow is each <li>'s ::after, spaced by the whitespace
        assert html == ('<ol class="breadcrumbs"><li><a href="/admin/">Home</a></li>\n'
                        '<li><a href="/admin/outbox/">Outbox</a></li>\n<li aria-current="page">Dashboard</li></ol>')
    else:
        assert html == ('<div class="breadcrumbs"><a href="/admin/">Home</a> &rsaquo; '
                        '<a href="/admin/outbox/">Outbox</a> &rsaquo; Dashboard</div>')
