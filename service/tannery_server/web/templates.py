"""The pages' HTML: Jinja2 templates with autoescape on (every name, metadata value and
message is user data) and a few formatting filters.

Nothing is fetched from elsewhere: the style and the script are this server's own files
(:mod:`.assets`), the plots inline SVG; no page holds an inline script or style.
"""

from __future__ import annotations

import datetime
from html import escape
from typing import Any
from urllib.parse import quote

from jinja2 import DictLoader, Environment, StrictUndefined, select_autoescape
from markupsafe import Markup


def size(value: int | float | None) -> str:
    """Bytes for people: ``424.8 KiB`` (as ``tannery ls`` writes them)."""
    if value is None:
        return "-"
    value = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def number(value: float | int | None) -> str:
    """A statistic: integers exactly, floats to 6 significant digits, ``-`` for none."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.6g}"


def count(value: int) -> str:
    """A count with thousands separators: ``1,234,567``."""
    return f"{value:,}"


def when(ns: int) -> str:
    """A creation time, UTC: ``2026-11-30 14:44:43``."""
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def seconds(value: float | None) -> str:
    """A duration: ``12.3 ms``, ``1.20 s``."""
    if value is None:
        return "-"
    if value == float("inf"):
        return "> 60 s"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


BASE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{% block title %}{% endblock %} · tannery</title>
<link rel="stylesheet" href="/static/style.css"><script src="/static/page.js" defer></script></head>
<body><header><span class="brand">tannery</span>
<a href="/archives">Archives</a><a href="/diff">Diff</a><a href="/server">Server</a>
<span class="note">{{ where }}</span>{% if signs_in %}<form method="post" action="/logout" id="logout">
<button type="submit" id="sign-out">Sign out</button></form>{% endif %}</header>
<main>{% block main %}{% endblock %}</main></body></html>
"""

ARCHIVES = """{% extends "base" %}{% block title %}Archives{% endblock %}{% block main %}
<h1>Archives{% if prefix %} starting with <code>{{ prefix }}</code>{% endif %}</h1>
<form class="inline" method="get" action="/archives">
<input type="text" name="prefix" id="prefix" value="{{ prefix }}" placeholder="name prefix, e.g. llama/">
<button type="submit" id="filter">Filter</button>{% if prefix %}<a href="/archives">all</a>{% endif %}</form>
{% if archives %}
<table id="archives"><thead><tr><th>name</th><th class="n">entries</th><th class="n">size</th>
<th>created (UTC)</th><th>aliases</th></tr></thead><tbody>
{% for a in archives %}<tr data-name="{{ a.name }}" data-entries="{{ a.entries }}" data-nbytes="{{ a.nbytes }}">
<td><a href="/archive?name={{ a.name|urlencode }}">{{ a.name }}</a></td>
<td class="n">{{ a.entries|count }}</td><td class="n">{{ a.nbytes|size }}</td><td>{{ a.created_ns|when }}</td>
<td>{% for alias in aliases.get(a.name, []) %}<span class="tag">{{ alias }}</span>{% endfor %}</td></tr>
{% endfor %}</tbody></table>
<p class="note">{{ archives|length }} archive{{ "" if archives|length == 1 else "s" }}{% if next_after %},
more after these: <a id="more" href="/archives?prefix={{ prefix|urlencode }}&amp;after={{ next_after|urlencode }}">next page</a>{% endif %}.</p>
{% else %}<p id="none">No archive{% if prefix %} starts with <code>{{ prefix }}</code>{% endif %}.</p>{% endif %}
{% endblock %}"""

ARCHIVE = """{% extends "base" %}{% block title %}{{ record.name }}{% endblock %}{% block main %}
<h1>Archive <code id="archive-name">{{ record.name }}</code>{% if asked != record.name %}{{ " " }}
<span class="note">(what the alias <code>{{ asked }}</code> points at)</span>{% endif %}</h1>
<div class="cols"><div>
<table id="summary"><tbody>
<tr><th>entries</th><td class="n" id="entry-count">{{ record.entries|count }}</td></tr>
<tr><th>parameters</th><td class="n" id="param-total" data-value="{{ total_params }}">{{ total_params|count }}</td></tr>
<tr><th>size</th><td class="n">{{ record.nbytes|size }} <span class="note">({{ record.payload_bytes|size }} stored with headers)</span></td></tr>
<tr><th>created (UTC)</th><td>{{ record.created_ns|when }}</td></tr>
<tr><th>aliases</th><td id="aliases">{% for a in aliases %}<span class="tag">{{ a.alias }}</span>{% else %}<span class="note">none</span>{% endfor %}</td></tr>
</tbody></table></div><div>
<table id="dtypes"><thead><tr><th>dtype</th><th class="n">parameters</th><th class="n">size</th></tr></thead><tbody>
{% for dtype, (params, nbytes) in by_dtype.items() %}<tr data-dtype="{{ dtype }}" data-params="{{ params }}">
<td>{{ dtype }}</td><td class="n">{{ params|count }}</td><td class="n">{{ nbytes|size }}</td></tr>{% endfor %}
</tbody></table></div></div>
{% if record.metadata %}<h2>Metadata</h2><table id="metadata"><tbody>
{% for key, value in record.metadata|dictsort %}<tr><th>{{ key }}</th><td><code>{{ value }}</code></td></tr>{% endfor %}
</tbody></table>{% endif %}
<h2>Fetch it</h2>
<pre id="cli">{{ cli }}</pre><pre id="python">{{ python }}</pre>
<h2>Entries</h2>
<p>{% if all_open %}<button type="button" id="expand-all">expand all</button>
{% else %}<a id="expand-all" href="/archive?name={{ archive_query }}&amp;open=all">expand all</a>{{ " " }}{% endif %}
<button type="button" id="collapse-all">collapse all</button>
<span class="note">name · dtype · shape · size · parameters; a name opens its statistics</span></p>
<div class="tree" id="tree" data-archive="{{ record.name }}">{% include "tree_rows" %}</div>
{% endblock %}"""

ENTRY = """{% extends "base" %}{% block title %}{{ entry.name }} · {{ archive }}{% endblock %}{% block main %}
<h1>Entry <code id="entry-name">{{ entry.name }}</code> of <a href="/archive?name={{ archive|urlencode }}">{{ archive }}</a></h1>
<table id="info"><tbody><tr><th>dtype</th><td>{{ entry.dtype }}</td></tr>
<tr><th>shape</th><td>[{{ entry.shape|join(', ') }}]</td></tr><tr><th>size</th><td>{{ entry.nbytes|size }}</td></tr>
<tr><th>sha256</th><td><code>{{ entry.digest }}</code></td></tr></tbody></table>
<h2>Statistics</h2>
<p id="coverage" class="note">{% if stats.sampled %}<span class="bad">Sampled:</span> {{ stats.bytes_read|size }} of {{ stats.data_bytes|size }} read
({{ stats.summarised|count }} of {{ stats.count|count }} elements{% if stats.cut_short %}, stopped at the time limit{% else %}, in evenly spread windows{% endif %}); every statistic below is of the sample.
{% else %}Every element read ({{ stats.count|count }} elements, {{ stats.bytes_read|size }}).{% endif %}{{ " " }}
Computed in {{ stats.seconds|seconds }} over the stored bytes, each block checked.</p>
<div class="cols"><table id="stats" data-sampled="{{ 'true' if stats.sampled else 'false' }}"><tbody>
{% for key in ["count", "min", "max", "mean", "std", "nan", "inf"] %}{% set value = stats[key] %}
<tr><th>{{ key }}</th><td class="n" data-key="{{ key }}" data-value="{{ 'null' if value is none else value }}">{{ value|number }}</td></tr>{% endfor %}
</tbody></table>
<figure>{{ histogram }}<figcaption class="note">Histogram of {{ stats.histogram_values|count }} values
{% if stats.of == "abs" %}(magnitudes) {% endif %}in {{ stats.counts|length }} bins from {{ stats.min|number }} to {{ stats.max|number }}.</figcaption></figure></div>
{% endblock %}"""

TREE_ROWS = """
{%- for row in rows -%}
{%- if row.kind == "open" -%}
<details data-path="{{ row.node.path }}"{% if row.lazy %} data-lazy="1"{% elif row.depth < open_depth %} open{% endif %}><summary><b>{{ row.label }}</b><span class="n">{{ row.node.entry_count|count }} {{ "entry" if row.node.entry_count == 1 else "entries" }} · {{ row.params|count }} params · {{ row.node.nbytes|size }}</span></summary>
{%- if row.lazy %}<div class="more"></div>{% endif -%}
{%- elif row.kind == "close" -%}
</details>
{%- else -%}
{{ row|leaf(archive_query) }}
{%- endif -%}
{%- endfor -%}"""

SERVER = """{% extends "base" %}{% block title %}Server{% endblock %}{% block main %}
<h1>Server <code>{{ target }}</code></h1>
<h2>Health</h2><table id="health"><tbody>
{% for part in health %}<tr data-part="{{ part.name }}"><th>{{ part.name }}</th>
<td class="{{ 'good' if part.ok else ('bad' if part.ok is sameas false else 'note') }}">{{ part.state }}</td><td class="note">{{ part.detail }}</td></tr>{% endfor %}
</tbody></table>
<h2>Traffic by RPC</h2>
{% if traffic is none %}<p class="note" id="no-metrics">The metrics are off (--metrics off): no traffic to show.</p>
{% else %}<table id="traffic"><thead><tr><th>RPC</th><th class="n">calls</th><th class="n">errors</th><th class="n">calls/s</th>
<th class="n">bytes/s</th><th class="n">received</th><th class="n">sent</th><th class="n">mean</th><th class="n">p50 ≤</th><th class="n">p95 ≤</th></tr></thead><tbody>
{% for row in traffic %}<tr data-method="{{ row.method }}" data-calls="{{ row.calls }}"><td>{{ row.method }}</td><td class="n">{{ row.calls|count }}</td><td class="n">{{ row.errors|count }}</td>
<td class="n">{{ "%.2f"|format(row.calls_per_second) }}</td><td class="n">{{ row.bytes_per_second|size }}/s</td><td class="n">{{ row.received|size }}</td><td class="n">{{ row.sent|size }}</td>
<td class="n">{{ row.mean_seconds|seconds }}</td><td class="n">{{ row.p50|seconds }}</td><td class="n">{{ row.p95|seconds }}</td></tr>
{% else %}<tr><td colspan="10" class="note">no call yet</td></tr>{% endfor %}</tbody></table>
<p class="note">Since the server started; rates over the last minute. Bytes per second, all RPCs, sampled every {{ interval|int }} s:</p>
{{ plot }}{% endif %}
<h2>Channels</h2>
{% if channels is none %}<p class="note">This server has no Channels service.</p>
{% else %}<table id="channels"><thead><tr><th>channel</th><th class="n">subscribers</th><th class="n">publishers</th><th class="n">payloads</th></tr></thead><tbody>
{% for c in channels %}<tr data-channel="{{ c.name }}"><td>{{ c.name }}</td><td class="n">{{ c.subscribers }}</td><td class="n">{{ c.publishers }}</td><td class="n">{{ c.payloads }}</td></tr>
{% else %}<tr><td colspan="4" class="note">no channel has a subscriber or publisher now</td></tr>{% endfor %}</tbody></table>{% endif %}
{% endblock %}"""

PROBLEM = """{% extends "base" %}{% block title %}{{ status }} {{ title }}{% endblock %}{% block main %}
<h1 id="problem" data-status="{{ status }}">{{ status }} {{ title }}</h1>
<div class="box"><p id="message">{{ message }}</p>{% if remedy %}<p class="note" id="remedy">{{ remedy }}</p>{% endif %}
{% if ask_token %}<form method="post" action="/login" id="login">
<input type="hidden" name="next" value="{{ next }}">
<p><label>Token <input type="password" name="token" id="token" autocomplete="current-password" autofocus></label>
<button type="submit" id="sign-in">Open</button></p></form>{% endif %}</div>
{% endblock %}"""


def leaf(row: Any, archive_query: str) -> Markup:
    """One entry's row of the tree, every name escaped here (html.escape, in one f-string: the
    page of a 10,000-entry archive is 10,000 of these, and a template's per-field escaping
    made it three times slower). ``archive_query``: the archive's name, quoted for a URL."""
    entry = row.entry
    name = escape(entry.name)
    dtype = escape(entry.dtype)
    href = f"/entry?archive={archive_query}&amp;name={quote(entry.name, safe='')}"
    return Markup(
        f'<div class="leaf" data-entry="{name}"><a href="{href}">{escape(row.label)}</a><span>{dtype}</span>'
        f'<span>[{", ".join(map(str, entry.shape))}]</span><span title="{entry.nbytes} bytes">{size(entry.nbytes)}</span>'
        f'<span>{row.params:,}</span></div>')


def environment() -> Environment:
    """The template environment: autoescape on for every template, unknown names an error."""
    env = Environment(
        loader=DictLoader({"base": BASE, "archives": ARCHIVES, "archive": ARCHIVE, "entry": ENTRY,
                           "server": SERVER, "problem": PROBLEM, "tree_rows": TREE_ROWS}),
        autoescape=select_autoescape(default=True, default_for_string=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(size=size, number=number, count=count, when=when, seconds=seconds, leaf=leaf)
    return env


class Renderer:
    """Renders a page by template name; ``where`` (the server's address) is in every header, and
    a sign-out button when the server ``signs_in`` (it has tokens)."""

    def __init__(self, where: str, signs_in: bool = False) -> None:
        self.env = environment()
        self.where = where
        self.signs_in = signs_in

    def page(self, name: str, **context: Any) -> str:
        return self.env.get_template(name).render(where=self.where, signs_in=self.signs_in, **context)


__all__ = ["Renderer", "environment", "number", "size"]
