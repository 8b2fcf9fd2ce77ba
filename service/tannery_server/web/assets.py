"""The pages' style and script, served as files of their own (``/static/style.css``,
``/static/page.js``) so that the Content-Security-Policy allows no inline script or style at all:
a hostile name that escaping missed still could not run. The script attaches every behaviour by
``addEventListener`` (no ``on...=`` attribute): the tree's buttons and lazy nodes, the list's
sortable columns, the entry filter's clearing."""

from __future__ import annotations

from aiohttp import web

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d232a;background:#f6f7f9}
header{background:#2b3440;color:#fff;padding:.6em 1.2em;display:flex;gap:1.5em;align-items:baseline}
header a{color:#e8eef5;text-decoration:none}header .brand{font-weight:700;font-size:1.1em}
header form{margin-left:auto}header button{background:none;border:1px solid #8a96a3;color:#e8eef5;cursor:pointer}
main{padding:1em 1.4em;max-width:1200px}
h1{font-size:1.35em;margin:.2em 0 .6em}h2{font-size:1.1em;margin:1.4em 0 .5em}
table{border-collapse:collapse;background:#fff;font-size:13px}
th,td{padding:.25em .7em;border-bottom:1px solid #e3e6ea;text-align:left;vertical-align:top}
th{background:#eef1f4}td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
th[data-sort]{cursor:pointer}th[data-sort]::after{content:" \\2195";color:#8a96a3}
th[aria-sort=ascending]::after{content:" \\2191"}th[aria-sort=descending]::after{content:" \\2193"}
code,pre{font-family:ui-monospace,monospace;font-size:12.5px}
pre{background:#fff;border:1px solid #e3e6ea;padding:.6em .8em;overflow-x:auto}
pre.file{max-height:40em;white-space:pre-wrap}
.note{color:#5b6570}.bad{color:#b3261e;font-weight:600}.good{color:#1e7b34;font-weight:600}
.tag{display:inline-block;background:#e5eefb;color:#1f4d8f;border-radius:3px;padding:0 .4em;margin-right:.3em}
.tree details{margin-left:1.1em}.tree>details{margin-left:0}
.tree summary{cursor:pointer;padding:1px 0}.tree summary .n{color:#5b6570;margin-left:.6em}
.tree{max-width:62em}.tree .leaf{display:grid;grid-template-columns:minmax(8em,1fr) 7em 10em 7em 7em;margin-left:2.2em;padding:1px 0}
.tree>.leaf{margin-left:1.1em}
.tree .leaf>*{white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
.tree .leaf:hover{background:#eef3fa}
form.inline{display:flex;gap:.5em;margin:.4em 0 1em}
input[type=text],input[type=password]{padding:.3em .5em;min-width:22em}
.box{background:#fff;border:1px solid #e3e6ea;padding:1em 1.2em;max-width:44em}
.cols{display:flex;gap:2em;flex-wrap:wrap}
figure{margin:0}
tr.changed td{background:#fff8e6}
details.folded>summary{cursor:pointer;color:#5b6570}
"""

SCRIPT = """
'use strict';
function setAll(open){document.querySelectorAll('.tree details').forEach(function(d){d.open=open;});}
document.addEventListener('DOMContentLoaded', function () {
  var expand = document.querySelector('button#expand-all');
  if (expand) expand.addEventListener('click', function () { setAll(true); });
  var collapse = document.getElementById('collapse-all');
  if (collapse) collapse.addEventListener('click', function () { setAll(false); });
  document.querySelectorAll('table th[data-sort]').forEach(function (th) {
    th.addEventListener('click', function () { sortBy(th); });
  });
});
// A column of a table sorted by its cells' data-value (numbers) or their text, each click reversing.
function sortBy(th) {
  var table = th.closest('table'), body = table.tBodies[0], index = th.cellIndex;
  var numeric = th.dataset.sort === 'number';
  var ascending = th.getAttribute('aria-sort') !== 'ascending';
  table.querySelectorAll('th[data-sort]').forEach(function (other) { other.removeAttribute('aria-sort'); });
  th.setAttribute('aria-sort', ascending ? 'ascending' : 'descending');
  var rows = Array.prototype.slice.call(body.rows);
  function key(row) {
    var cell = row.cells[index];
    var value = cell.dataset.value !== undefined ? cell.dataset.value : cell.textContent;
    return numeric ? Number(value) : value;
  }
  rows.sort(function (a, b) {
    var x = key(a), y = key(b);
    var order = x < y ? -1 : x > y ? 1 : 0;
    return ascending ? order : -order;
  });
  rows.forEach(function (row) { body.appendChild(row); });
}
// A node drawn without its content (data-lazy) fetches it from /tree when first opened.
document.addEventListener('toggle', function (event) {
  var node = event.target;
  if (!node.open || !node.dataset || !node.dataset.lazy) return;
  delete node.dataset.lazy;
  var more = node.querySelector(':scope > .more');
  var tree = document.getElementById('tree');
  more.textContent = 'loading...';
  fetch('/tree?name=' + encodeURIComponent(tree.dataset.archive) + '&node=' + encodeURIComponent(node.dataset.path),
        {credentials: 'same-origin'})
    .then(function (r) { if (!r.ok) throw new Error(r.status + ' ' + r.statusText); return r.text(); })
    .then(function (html) { more.innerHTML = html; node.dataset.loaded = '1'; })
    .catch(function (e) { node.dataset.lazy = '1'; more.textContent = 'could not load this node: ' + e.message + ' (reload the page)'; });
}, true);
"""

#: The files, by name: their text and content type.
FILES = {"style.css": (STYLE, "text/css"), "page.js": (SCRIPT, "text/javascript")}


async def static_file(request: web.Request) -> web.Response:
    """GET /static/NAME: the style or the script (404 for any other name)."""
    found = FILES.get(request.match_info["name"])
    if found is None:
        raise web.HTTPNotFound()
    text, content_type = found
    return web.Response(text=text, content_type=content_type, charset="utf-8")


__all__ = ["FILES", "SCRIPT", "STYLE", "static_file"]
