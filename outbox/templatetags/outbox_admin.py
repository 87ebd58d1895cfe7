"""Template tags of the outbox's admin pages: breadcrumbs that match the running Django's admin."""

from __future__ import annotations

import django
from django import template
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

register = template.Library()

#: Django 6.0 turned the admin's breadcrumbs into a list (<ol class="breadcrumbs">, styled as such);
#: 5.2 styles <div class="breadcrumbs"> with links between arrows.
ORDERED_BREADCRUMBS = django.VERSION >= (6, 0)


@register.simple_tag
def breadcrumbs(*crumbs: str) -> SafeString:
    """{% breadcrumbs url1 label1 url2 label2 ... "" current %}: links, then the page itself (an empty url)."""
    pairs = list(zip(crumbs[::2], crumbs[1::2], strict=True))
    if ORDERED_BREADCRUMBS:
        # One item a line, as Django's own templates write them: the arrow between items is each item's ::after,
        # whose spaces render only with whitespace between the inline-block items.
        items = format_html_join("\n", "{}", ((format_html('<li><a href="{}">{}</a></li>', url, label) if url
                                             else format_html('<li aria-current="page">{}</li>', label),)
                                            for url, label in pairs))
        return format_html('<ol class="breadcrumbs">{}</ol>', items)
    items = format_html_join(mark_safe(" &rsaquo; "), "{}", ((format_html('<a href="{}">{}</a>', url, label) if url
                                                   else label,) for url, label in pairs))
    return format_html('<div class="breadcrumbs">{}</div>', items)
