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
<table id="archives"><thead><tr><th data-sort="text" id="sort-name">name</th><th class="n" data-sort="number" id="sort-entries">entries</th>
<th class="n" data-sort="number" id="sort-size">size</th><th data-sort="number" id="sort-created">created (UTC)</th><th>aliases</th></tr></thead><tbody>
{% for a in archives %}<tr data-name="{{ a.name }}" data-entries="{{ a.entries }}" data-nbytes="{{ a.nbytes }}">
<td data-value="{{ a.name }}"><a href="/archive?name={{ a.name|urlencode }}">{{ a.name }}</a></td>
<td class="n" data-value="{{ a.entries }}">{{ a.entries|count }}</td><td class="n" data-value="{{ a.nbytes }}">{{ a.nbytes|size }}</td>
<td data-value="{{ a.created_ns }}">{{ a.created_ns|when }}</td>
<td>{% for alias in aliases.get(a.name, []) %}<a class="tag" href="/alias?name={{ alias|urlencode }}">{{ alias }}</a>{% endfor %}</td></tr>
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
<tr><th>tensors</th><td class="n" id="entry-count">{{ tensor_count|count }}</td></tr>
{% if files %}<tr><th>kept files</th><td class="n" id="file-count">{{ files|length|count }}</td></tr>{% endif %}
<tr><th>parameters</th><td class="n" id="param-total" data-value="{{ total_params }}">{{ total_params|count }}</td></tr>
<tr><th>size</th><td class="n" id="tensor-bytes" data-value="{{ tensor_bytes }}">{{ tensor_bytes|size }} <span class="note">({{ record.payload_bytes|size }} stored with headers{% if files %}, kept files included{% endif %})</span></td></tr>
<tr><th>created (UTC)</th><td>{{ record.created_ns|when }}</td></tr>
<tr><th>aliases</th><td id="aliases">{% for a in aliases %}<a class="tag" href="/alias?name={{ a.alias|urlencode }}">{{ a.alias }}</a>{% else %}<span class="note">none</span>{% endfor %}</td></tr>
</tbody></table></div><div>
<table id="dtypes"><thead><tr><th>dtype</th><th class="n">parameters</th><th class="n">size</th></tr></thead><tbody>
{% for dtype, (params, nbytes) in by_dtype.items() %}<tr data-dtype="{{ dtype }}" data-params="{{ params }}">
<td>{{ dtype }}</td><td class="n">{{ params|count }}</td><td class="n">{{ nbytes|size }}</td></tr>{% endfor %}
</tbody></table></div></div>
{% if record.metadata %}<h2>Metadata</h2><table id="metadata"><tbody>
{% for key, value in record.metadata|dictsort %}<tr><th>{{ key }}</th><td><code>{{ value }}</code></td></tr>{% endfor %}
</tbody></table>{% endif %}
{% if files %}<h2>Kept files</h2>
<table id="files"><thead><tr><th>file</th><th>prefix</th><th class="n">size</th></tr></thead><tbody>
{% for f in files %}<tr data-file="{{ f.name }}"><td><a href="/file?archive={{ record.name|urlencode }}&amp;name={{ f.entry|urlencode }}">{{ f.name }}</a></td>
<td>{% if f.prefix %}<code>{{ f.prefix }}</code>{% else %}<span class="note">none</span>{% endif %}</td><td class="n" data-value="{{ f.size }}">{{ f.size|size }}</td></tr>
{% endfor %}</tbody></table>{% endif %}
<h2>Fetch it</h2>
<p><a id="download-safetensors" href="/download/archive?name={{ record.name|urlencode }}">download its tensors as .safetensors</a>
<span class="note">(streamed; the kept files are on their own pages)</span></p>
<pre id="cli">{{ cli }}</pre><pre id="python">{{ python }}</pre>
<h2>Tensors</h2>
<form class="inline" method="get" action="/archive" id="filter-form"><input type="hidden" name="name" value="{{ asked }}">
<input type="text" name="filter" id="entry-filter" value="{{ filter }}" placeholder="names holding, e.g. attn.q">
<button type="submit" id="filter">Filter</button>{% if filter %}<a id="unfilter" href="/archive?name={{ asked|urlencode }}">all</a>
<span class="note" id="filter-count">{{ shown_count|count }} of {{ tensor_count|count }} tensors hold <code>{{ filter }}</code></span>{% endif %}</form>
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
<p><a id="download-npy" href="/download/entry?archive={{ archive|urlencode }}&amp;name={{ entry.name|urlencode }}">download .npy</a></p>
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
{% if stats.of == "abs" %}(magnitudes) {% endif %}in {{ stats.counts|length }} bins from {{ stats.min|number }} to {{ stats.max|number }};
{% if log_scale %}heights on a log scale (<a id="linear-scale" href="/entry?archive={{ archive|urlencode }}&amp;name={{ entry.name|urlencode }}">linear</a>){% else %}heights linear
(<a id="log-scale" href="/entry?archive={{ archive|urlencode }}&amp;name={{ entry.name|urlencode }}&amp;scale=log">log scale</a>){% endif %}.</figcaption></figure></div>
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
{% for row in traffic %}<tr data-method="{{ row.method }}" data-calls="{{ row.calls }}" data-received="{{ row.received|int }}" data-sent="{{ row.sent|int }}"><td>{{ row.method }}</td><td class="n">{{ row.calls|count }}</td><td class="n">{{ row.errors|count }}</td>
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

DIFF = """{% extends "base" %}{% block title %}Diff{% endblock %}{% block main %}
<h1>Diff</h1>
<form class="inline" method="get" action="/diff" id="diff-form">
<input type="text" name="a" id="diff-a" value="{{ a }}" placeholder="archive or alias A">
<input type="text" name="b" id="diff-b" value="{{ b }}" placeholder="archive or alias B">
<button type="submit" id="compare">Compare</button></form>
{% if diff is not none %}{% set s = diff.summary %}
<p id="diff-names">B <a href="/archive?name={{ diff.b|urlencode }}"><code>{{ diff.b }}</code></a>{% if b != diff.b %} (alias <code>{{ b }}</code>){% endif %}{{ " " }}
against A <a href="/archive?name={{ diff.a|urlencode }}"><code>{{ diff.a }}</code></a>{% if a != diff.a %} (alias <code>{{ a }}</code>){% endif %}.</p>
<p id="diff-summary" data-same="{{ s.same }}" data-value-changed="{{ s.value_changed }}" data-type-changed="{{ s.type_changed }}"
 data-added="{{ s.added }}" data-removed="{{ s.removed }}" data-files-changed="{{ s.files_changed }}">Tensors: {{ s.value_changed }} with other values,
{{ s.type_changed }} with another dtype or shape, {{ s.added }} added, {{ s.removed }} removed, {{ s.same }} the same;
kept files: {{ s.files_changed }} differ, {{ s.files_same }} the same; {{ s.bytes_read|size }} read to compare values.</p>
{% if changed %}<table id="changed"><thead><tr><th>entry</th><th>change</th><th>dtype</th><th>shape</th>
<th class="n">differ</th><th class="n">max |B−A|</th><th class="n">‖B−A‖/‖A‖</th><th class="n">new NaN/Inf</th></tr></thead><tbody>
{% for e in changed %}<tr class="changed" data-entry="{{ e.name }}" data-change="{{ words[e.change] }}"><td>{{ e.name }}</td><td>{{ words[e.change] }}</td>
{% if e.file %}<td>file</td><td>{{ (e.nbytes_a|size) if e.dtype_a else "-" }} → {{ (e.nbytes_b|size) if e.dtype_b else "-" }}</td>
{% else %}<td>{{ e.dtype_a or e.dtype_b }}{% if e.dtype_a and e.dtype_b and e.dtype_a != e.dtype_b %} → {{ e.dtype_b }}{% endif %}</td>
<td>{% if e.dtype_a %}[{{ e.shape_a|join(', ') }}]{% endif %}{% if e.dtype_a and e.dtype_b and e.shape_a != e.shape_b %} → {% endif %}{% if e.dtype_b and (not e.dtype_a or e.shape_a != e.shape_b) %}[{{ e.shape_b|join(', ') }}]{% endif %}</td>{% endif %}
{% if e.HasField("values") %}{% set v = e.values %}<td class="n" data-key="differing" data-value="{{ v.differing }}">{{ "%.3g"|format(100 * v.differing / (v.elements or 1)) }}%</td>
<td class="n" data-key="max_abs" data-value="{{ v.max_abs }}">{{ v.max_abs|number }}</td><td class="n" data-key="relative_l2" data-value="{{ v.relative_l2 }}">{{ v.relative_l2|number }}</td>
<td class="n">{{ v.nan_appeared }}/{{ v.inf_appeared }}</td>{% else %}<td></td><td></td><td></td><td></td>{% endif %}</tr>
{% endfor %}</tbody></table>{% else %}<p id="no-change">No entry differs.</p>{% endif %}
{% if diff.metadata %}<h2>Metadata</h2><table id="metadata-diff"><thead><tr><th>key</th><th>A</th><th>B</th></tr></thead><tbody>
{% for m in diff.metadata %}<tr data-key="{{ m.key }}"><th>{{ m.key }}</th><td>{% if m.HasField("a") %}<code>{{ m.a }}</code>{% else %}<span class="note">absent</span>{% endif %}</td>
<td>{% if m.HasField("b") %}<code>{{ m.b }}</code>{% else %}<span class="note">absent</span>{% endif %}</td></tr>{% endfor %}</tbody></table>{% endif %}
{% if same %}<details class="folded" id="same"><summary>{{ same|length|count }} entries the same (by digest, no byte read)</summary>
<ul>{% for e in same %}<li>{{ e.name }}</li>{% endfor %}</ul></details>{% endif %}
{% endif %}{% endblock %}"""

ALIAS = """{% extends "base" %}{% block title %}{{ alias }}{% endblock %}{% block main %}
<h1>Alias <code id="alias-name">{{ alias }}</code></h1>
<p id="alias-target">{% if current %}Points at <a href="/archive?name={{ current.archive|urlencode }}"><code>{{ current.archive }}</code></a> since {{ current.moved_ns|when }} UTC.
{% else %}<span class="note">Removed: it points at nothing now.</span>{% endif %}</p>
<h2>History</h2>
{% if moves %}<table id="history"><thead><tr><th>moved (UTC)</th><th></th><th>from</th><th>to</th><th>by</th><th></th></tr></thead><tbody>
{% for m in moves %}<tr data-from="{{ m.previous }}" data-to="{{ m.archive }}"><td>{{ m.moved_ns|when }}</td>
<td>{{ "created" if not m.previous else ("removed" if not m.archive else "moved") }}</td>
<td>{{ m.previous or "-" }}</td><td>{{ m.archive or "-" }}</td><td>{{ m.by or "-" }}</td>
<td>{% if m.previous and m.archive %}<a class="diff-link" href="/diff?a={{ m.previous|urlencode }}&amp;b={{ m.archive|urlencode }}">diff</a>{% endif %}</td></tr>
{% endfor %}</tbody></table>{% if moves|length == most %}<p class="note">The newest {{ most }} moves; tannery log {{ alias }} lists every one kept.</p>{% endif %}
{% else %}<p class="note" id="no-history">No move recorded (the alias was made before its server recorded them).</p>{% endif %}
{% endblock %}"""

FILE = """{% extends "base" %}{% block title %}{{ file.name }} · {{ archive }}{% endblock %}{% block main %}
<h1>File <code id="file-name">{{ file.name }}</code> kept with <a href="/archive?name={{ archive|urlencode }}">{{ archive }}</a></h1>
<p class="note" id="file-size">{{ file.size|size }}{% if file.prefix %}, pushed under prefix <code>{{ file.prefix }}</code>{% endif %}.</p>
{% if shown.text is none %}<p id="binary">A binary file ({{ file.size|count }} bytes): not shown as text. <code>tannery pull {{ archive }} -o DIR/</code> writes it.</p>
{% else %}<pre class="file" id="file-text">{{ shown.text }}</pre>
{% if shown.cut %}<p class="note" id="file-cut">The first {{ most|size }} of {{ file.size|size }} shown.</p>{% endif %}{% endif %}
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
                           "server": SERVER, "problem": PROBLEM, "file": FILE, "diff": DIFF, "alias": ALIAS, "tree_rows": TREE_ROWS}),
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
