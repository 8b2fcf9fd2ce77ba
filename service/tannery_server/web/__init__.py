"""A read-only web page onto the store (``tannery serve --web-port P``; docs/web.md).

One module a job: :mod:`.server` (the aiohttp application, TLS, its start and stop),
:mod:`.access` (tokens), :mod:`.inputs` (what a URL may hold), :mod:`.pages` (the handlers),
:mod:`.tree` (entries by dotted names, parameter counts), :mod:`.stats` (an entry's statistics
over its checked bytes, sampled above a size), :mod:`.traffic` (calls, bytes and latency from
the metrics), :mod:`.templates` and :mod:`.plots` (the HTML and its SVG plots).
"""
