"""The web page (issues 31 and 39) in a real browser: Debian's headless Chromium, driven by selenium
through chromedriver, against a real server on loopback with tokens. A real model (a small
GPT-2 built by transformers) is pushed with ``tannery push``; each page is opened and checked
against what ``tannery ls --json``, ``show --json`` and ``get --json`` say; a node is expanded;
the list is filtered; a token is asked for and a wrong one refused. One screenshot per page is
saved under the directory the module prints (TANNERY_WEB_SCREENSHOTS to choose it)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tannery

from .needs import require
from .server_harness import running_server

pytestmark = pytest.mark.browser

READ_TOKEN, WRITE_TOKEN = "browser-read-token", "browser-write-token"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
MODEL = "gpt2-tiny"


def cli(target: str, *argv: str) -> object:
    """``tannery --target T --token W ARGV --json``, as a person runs it: its JSON output."""
    done = subprocess.run([sys.executable, "-m", "tannery.cli", "--target", target, "--token", WRITE_TOKEN, *argv,
                           "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where the screenshots go: TANNERY_WEB_SCREENSHOTS, or a temporary directory (printed)."""
    chosen = os.environ.get("TANNERY_WEB_SCREENSHOTS")
    directory = Path(chosen) if chosen else tmp_path_factory.mktemp("web-screenshots")
    directory.mkdir(parents=True, exist_ok=True)
    print(f"\nweb page screenshots: {directory}")
    return directory


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module, 1280x800."""
    require(Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists(),
            "Debian's chromium and chromium-driver are not installed (make test installs them)")
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium's manager fetches nothing: the driver is given
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,800", "--hide-scrollbars"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A server with tokens and the web page on, holding a GPT-2 pushed by the CLI (alias prod),
    an archive of other dtypes, and two runs for the filter."""
    tmp = tmp_path_factory.mktemp("web-browser")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=1000, n_positions=128,
                                       bos_token_id=0, eos_token_id=0))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              tmp / "model.safetensors", metadata={"format": "pt", "source": "GPT2Config(n_layer=4, n_embd=64)"})
    with running_server(tmp, web_port=0, tokens=f"{READ_TOKEN}:read,{WRITE_TOKEN}:write") as server:
        cli(server.target, "push", str(tmp / "model.safetensors"), "--as", MODEL)
        cli(server.target, "tag", "prod", MODEL)
        mixed = {"bf16": torch.randn(300, 7).to(torch.bfloat16), "ids": torch.arange(-50, 150, dtype=torch.int64),
                 "mask": torch.arange(37) % 3 == 0,
                 "odd": torch.tensor([1.5, float("nan"), float("inf"), float("-inf"), -2.5, 0.25]),
                 "wide": torch.randn(1 << 20)}
        with tannery.Client(server.target, token=WRITE_TOKEN) as client:
            client.store("mixed", mixed)
            client.store("runs/a", {"w": torch.ones(3)})
            client.store("runs/b", {"w": torch.zeros(3)})
        yield server


@pytest.fixture(scope="module")
def origin(store) -> str:
    return store._running.web.url.rstrip("/")


@pytest.fixture
def site(origin: str, browser) -> str:
    """The page's address, the browser signed in with the read token (through the sign-in form:
    the cookie holds an opaque value the server gave, not the token)."""
    if browser.get_cookie("tannery_token") is None:
        browser.get(origin + "/server")  # asks for the token
        _by(browser, "#token")[0].send_keys(READ_TOKEN)
        _by(browser, "#sign-in")[0].click()
        _wait(browser, lambda b: _by(b, "#health"), "the server page, signed in")
    return origin


def _shot(browser, shots: Path, name: str) -> None:
    path = shots / f"{name}.png"
    browser.save_screenshot(str(path))
    assert path.stat().st_size > 1000


def _by(browser, css: str):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, css)


def _wait(browser, condition, what: str) -> None:
    """Wait (at most 10 s) until ``condition(browser)``: a click that sends a form returns
    before the next page is there, so an element found on the old page may be gone by the time
    it is read (stale): that is asked again, not a failure."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 10, ignored_exceptions=(StaleElementReferenceException,)).until(
        condition, f"waited 10 s for {what}")


def _status(browser) -> str:
    found = _by(browser, "#problem")
    return found[0].get_attribute("data-status") if found else ""


def test_a_page_asks_for_a_token_refuses_a_wrong_one_then_opens(browser, origin, shots):
    site = origin
    browser.get(site + "/server")
    browser.delete_all_cookies()
    browser.get(site + "/archive?name=prod")
    assert _by(browser, "#problem")[0].get_attribute("data-status") == "401"
    assert "asks for a token" in _by(browser, "#message")[0].text
    _shot(browser, shots, "token")
    _by(browser, "#token")[0].send_keys("not-a-token")
    _by(browser, "#sign-in")[0].click()
    _wait(browser, lambda b: _status(b) == "403", "the refusal of a wrong token")
    assert "refused" in _by(browser, "#message")[0].text
    _by(browser, "#token")[0].send_keys(READ_TOKEN)
    _by(browser, "#sign-in")[0].click()
    _wait(browser, lambda b: b.current_url == site + "/archive?name=prod", "the page asked for")
    assert _by(browser, "#archive-name")[0].text == MODEL


def test_the_archives_list_matches_ls_and_filters_by_prefix(browser, site, store, shots):
    listed = cli(store.target, "ls")
    browser.get(site + "/archives")
    rows = _by(browser, "#archives tbody tr")
    shown = {r.get_attribute("data-name"): (int(r.get_attribute("data-entries")), int(r.get_attribute("data-nbytes")),
                                            [t.text for t in r.find_elements("css selector", ".tag")]) for r in rows}
    assert shown == {a["name"]: (a["entries"], a["nbytes"], a["aliases"]) for a in listed}
    _shot(browser, shots, "archives")
    box = _by(browser, "#prefix")[0]
    box.clear()
    box.send_keys("runs/")
    _by(browser, "#filter")[0].click()
    _wait(browser, lambda b: b.current_url == site + "/archives?prefix=runs%2F", "the filtered list")
    assert [r.get_attribute("data-name") for r in _by(browser, "#archives tbody tr")] == ["runs/a", "runs/b"]


def _cells(browser) -> list[list[str]]:
    """Each entry row of the tree, hidden ones too (textContent): its entry's name, then its
    cells (name, dtype, shape, size, parameters), then the exact bytes (the size's title)."""
    return browser.execute_script(
        "return Array.from(document.querySelectorAll('#tree .leaf'), l => [l.dataset.entry,"
        " ...Array.from(l.children, c => c.textContent), l.children[3].title])")


def _check_rows(cells: list[list[str]], shown: dict) -> None:
    by_name = {e["name"]: e for e in shown["entries"]}
    for name, label, dtype, shape, _size, params, nbytes in cells:
        entry = by_name[name]
        assert name.endswith("." + label) and dtype == entry["dtype"]
        assert shape == "[" + ", ".join(map(str, entry["shape"])) + "]"
        assert nbytes == f"{entry['nbytes']} bytes" and params == f"{math.prod(entry['shape']):,}"


def test_the_archive_page_matches_show(browser, site, store, shots):
    shown = cli(store.target, "show", "prod")
    browser.get(site + "/archive?name=prod")
    _shot(browser, shots, "archive")
    params = sum(math.prod(e["shape"]) for e in shown["entries"])
    assert int(_by(browser, "#entry-count")[0].text) == len(shown["entries"])
    assert int(_by(browser, "#param-total")[0].get_attribute("data-value")) == params
    assert {r.get_attribute("data-dtype"): int(r.get_attribute("data-params")) for r in _by(browser, "#dtypes tbody tr")} \
        == {"float32": params}
    assert [t.text for t in _by(browser, "#aliases .tag")] == shown["aliases"] == ["prod"]
    assert "GPT2Config" in _by(browser, "#metadata")[0].text
    assert "tannery pull gpt2-tiny" in _by(browser, "#cli")[0].text
    assert 'client.fetch("gpt2-tiny")' in _by(browser, "#python")[0].text
    # Every node open (the expand-all link): every entry of show is a row, with its dtype, shape, size, parameters.
    _by(browser, "#expand-all")[0].click()
    _wait(browser, lambda b: b.current_url.endswith("&open=all"), "the page with every node open")
    cells = _cells(browser)
    assert sorted(c[0] for c in cells) == sorted(e["name"] for e in shown["entries"])
    _check_rows(cells, shown)


def test_a_node_of_the_tree_expands(browser, site, store, shots):
    shown = cli(store.target, "show", "prod")
    browser.get(site + "/archive?name=prod")
    # The top level is open; the nodes under it come closed and without their content, which
    # opening one fetches: transformer.h.2.attn.c_attn's entries appear once its path is opened.
    assert _by(browser, 'details[data-path="transformer"]')[0].get_attribute("open") is not None
    assert not _by(browser, '.leaf[data-entry="transformer.h.2.attn.c_attn.weight"]')
    for path in ("transformer.h", "transformer.h.2", "transformer.h.2.attn", "transformer.h.2.attn.c_attn"):
        _wait(browser, lambda b: _by(b, f'details[data-path="{path}"]'), f"node {path}")
        node = _by(browser, f'details[data-path="{path}"]')[0]
        assert node.get_attribute("open") is None
        node.find_element("css selector", "summary").click()
        _wait(browser, lambda b: node.get_attribute("data-loaded") == "1", f"the content of {path}")
    inner = _by(browser, '.leaf[data-entry="transformer.h.2.attn.c_attn.weight"]')[0]
    assert inner.is_displayed()
    cells = [c for c in _cells(browser) if c[0].startswith("transformer.h.2.attn.c_attn.")]
    assert sorted(c[0] for c in cells) == ["transformer.h.2.attn.c_attn.bias", "transformer.h.2.attn.c_attn.weight"]
    _check_rows(cells, shown)
    summary = _by(browser, 'details[data-path="transformer.h.2"] > summary')[0].text
    h2 = [e for e in shown["entries"] if e["name"].startswith("transformer.h.2.")]
    assert f"{len(h2)} entries · {sum(math.prod(e['shape']) for e in h2):,} params" in summary
    browser.execute_script("window.scrollTo(0, document.querySelector('#tree').offsetTop - 60)")
    _shot(browser, shots, "archive-tree")


@pytest.mark.parametrize("archive, entry", [(MODEL, "transformer.h.0.attn.c_attn.weight"), ("mixed", "bf16"),
                                            ("mixed", "ids"), ("mixed", "mask"), ("mixed", "odd")])
def test_entry_statistics_match_get(browser, site, store, shots, archive, entry):
    expected = cli(store.target, "get", archive, entry)["stats"]
    browser.get(f"{site}/entry?archive={archive}&name={entry}")
    assert _by(browser, "#entry-name")[0].text == entry
    assert _by(browser, "#stats")[0].get_attribute("data-sampled") == "false"
    got = {c.get_attribute("data-key"): json.loads(c.get_attribute("data-value")) for c in _by(browser, "#stats td")}
    for key in ("count", "nan", "inf"):
        assert got[key] == expected[key], key
    for key in ("min", "max", "mean", "std"):
        assert got[key] == pytest.approx(expected[key], rel=1e-9, abs=1e-12), key
    assert int(_by(browser, "#histogram")[0].get_attribute("data-bins")) == 48
    if entry == "transformer.h.0.attn.c_attn.weight":
        _shot(browser, shots, "entry")


def test_a_large_entry_is_sampled_and_the_page_says_so(browser, site, shots, monkeypatch):
    from tannery_server.web import stats

    monkeypatch.setattr(stats, "FULL_BYTES", 1 << 20)  # the 4 MiB entry counts as large (64 MiB does by default)
    monkeypatch.setattr(stats, "WINDOW_BYTES", 16 << 10)
    browser.get(f"{site}/entry?archive=mixed&name=wide")
    assert _by(browser, "#stats")[0].get_attribute("data-sampled") == "true"
    coverage = _by(browser, "#coverage")[0].text
    assert "Sampled: 1.0 MiB of 4.0 MiB read (262,144 of 1,048,576 elements" in coverage, coverage
    assert "every statistic below is of the sample" in coverage
    _shot(browser, shots, "entry-sampled")


def test_the_server_page_shows_health_traffic_and_channels(browser, site, store, shots):
    with tannery.Client(store.target, token=WRITE_TOKEN) as client:
        subscription = client.subscribe("telemetry")
        try:
            browser.get(site + "/server")
            health = {r.get_attribute("data-part"): r.text for r in _by(browser, "#health tr")}
            assert "answers" in health["catalog"] and "answers" in health["blob store"]
            assert "not used" in health["NATS"]
            calls = {r.get_attribute("data-method"): int(r.get_attribute("data-calls"))
                     for r in _by(browser, "#traffic tbody tr")}
            assert any(method.endswith("Store") and n >= 3 for method, n in calls.items()), calls
            assert any(method.endswith("Fetch") and n >= 5 for method, n in calls.items()), calls
            channels = {r.get_attribute("data-channel"): r.text for r in _by(browser, "#channels tbody tr")}
            assert "telemetry" in channels
            _shot(browser, shots, "server")
        finally:
            subscription.close()


def test_a_missing_entry_is_a_page_naming_it(browser, site, shots):
    browser.get(site + "/entry?archive=prod&name=transformer.h.9.mlp")
    assert _by(browser, "#problem")[0].get_attribute("data-status") == "404"
    assert "has no entry 'transformer.h.9.mlp'" in _by(browser, "#message")[0].text
    _shot(browser, shots, "missing")


# Issue 39: versions, kept files, the policy, sign-out --------------------------------------------


@pytest.fixture(scope="module")
def versions(store) -> dict:
    """Two versions of a small model with kept files, an alias moved between them, and an archive
    whose top-level entry sorts after a node."""
    with tannery.Client(store.target, token=WRITE_TOKEN) as client:
        torch.manual_seed(1)
        v1 = {"enc.0.w": torch.randn(16, 8), "enc.1.w": torch.randn(16, 8), "head": torch.randn(2, 16)}
        v2 = {**v1, "head": v1["head"] * 2}
        files = {"config.json": b'{"layers": 2}\n', "README.md": b"# tiny\n"}
        client.store("tiny/v1", v1, files=files)
        client.store("tiny/v2", v2, files={**files, "config.json": b'{"layers": 2, "tuned": true}\n'})
        client.tag("staging", "tiny/v1")
        client.tag("staging", "tiny/v2")
        client.store("nested", {"a.x": torch.ones(2), "a.y": torch.ones(2), "b": torch.ones(2)})
        return {"v1": v1, "v2": v2, "diff": client.diff("tiny/v1", "tiny/v2")}


def test_an_injected_inline_handler_does_not_run(browser, site, shots):
    browser.get(site + "/archives")
    assert browser.execute_script("return typeof sortBy") == "function"  # the page's own script file ran
    browser.execute_script("""document.body.insertAdjacentHTML('beforeend',
        '<img id="probe" src="/no-such-image.png" onerror="window.pwned = 1">' +
        '<div id="probe2" onclick="window.pwned = 2">x</div>');
        document.getElementById('probe2').click();""")
    _wait(browser, lambda b: b.execute_script("var i = document.getElementById('probe'); return i && i.complete"),
          "the probe image to fail")
    assert browser.execute_script("return window.pwned === undefined")


def test_the_list_sorts_by_size_and_date(browser, site, versions, shots):
    browser.get(site + "/archives")
    sizes = lambda: [int(r.get_attribute("data-nbytes")) for r in _by(browser, "#archives tbody tr")]  # noqa: E731
    _by(browser, "#sort-size")[0].click()
    assert sizes() == sorted(sizes()) and _by(browser, "#sort-size")[0].get_attribute("aria-sort") == "ascending"
    _by(browser, "#sort-size")[0].click()
    assert sizes() == sorted(sizes(), reverse=True)
    _by(browser, "#sort-created")[0].click()
    created = [r.find_element("css selector", "td:nth-child(4)").get_attribute("data-value")
               for r in _by(browser, "#archives tbody tr")]
    assert [int(c) for c in created] == sorted(int(c) for c in created)
    _shot(browser, shots, "archives-sorted")


def test_a_top_level_entry_after_a_node_is_indented_as_the_top_level(browser, site, versions):
    browser.get(site + "/archive?name=nested")
    child = _by(browser, '.leaf[data-entry="a.x"]')[0].location["x"]
    top = _by(browser, '.leaf[data-entry="b"]')[0].location["x"]
    node = _by(browser, 'details[data-path="a"] > summary')[0].location["x"]
    # b is at the top level: indented as a.x's node (past its marker), less than a.x, the node's child.
    assert node <= top < child, (top, node, child)


def test_kept_files_are_listed_apart_and_shown_as_text(browser, site, versions, shots):
    browser.get(site + "/archive?name=tiny/v1")
    params = sum(t.numel() for t in versions["v1"].values())
    assert int(_by(browser, "#param-total")[0].get_attribute("data-value")) == params
    assert [r.get_attribute("data-file") for r in _by(browser, "#files tbody tr")] == ["README.md", "config.json"]
    assert not _by(browser, '.leaf[data-entry^="@file"]')
    _shot(browser, shots, "archive-files")
    _by(browser, '#files tr[data-file="config.json"] a')[0].click()
    _wait(browser, lambda b: _by(b, "#file-text"), "the file's text")
    assert _by(browser, "#file-text")[0].text == '{"layers": 2}'
    _shot(browser, shots, "file")


def test_the_entry_filter(browser, site, versions):
    browser.get(site + "/archive?name=tiny/v1")
    _by(browser, "#entry-filter")[0].send_keys("ENC.1")
    _by(browser, "#filter")[0].click()
    _wait(browser, lambda b: _by(b, "#filter-count"), "the filtered tree")
    assert [leaf.get_attribute("data-entry") for leaf in _by(browser, ".leaf")] == ["enc.1.w"]


def test_the_diff_page_from_the_alias_history(browser, site, versions, shots):
    browser.get(site + "/archive?name=tiny/v2")
    _by(browser, '#aliases a.tag')[0].click()
    _wait(browser, lambda b: _by(b, "#history"), "the alias page")
    assert [(r.get_attribute("data-from"), r.get_attribute("data-to")) for r in _by(browser, "#history tbody tr")] \
        == [("tiny/v1", "tiny/v2"), ("", "tiny/v1")]
    assert "write token sha256:" in _by(browser, "#history tbody tr")[0].text
    _shot(browser, shots, "alias")
    _by(browser, "#history a.diff-link")[0].click()
    _wait(browser, lambda b: _by(b, "#changed"), "the diff page")
    rows = {r.get_attribute("data-entry"): r for r in _by(browser, "#changed tbody tr")}
    assert set(rows) == {"head", "@file:config.json"}
    (head,) = [e for e in versions["diff"].entries if e.name == "head"]
    shown = {c.get_attribute("data-key"): float(c.get_attribute("data-value"))
             for c in rows["head"].find_elements("css selector", "td[data-key]")}
    assert shown == pytest.approx({"differing": head.values.differing, "max_abs": head.values.max_abs,
                                   "relative_l2": head.values.relative_l2}, rel=1e-12)
    folded = _by(browser, "#same")[0]
    assert folded.get_attribute("open") is None and "entries the same" in folded.text
    _shot(browser, shots, "diff")


def test_sign_out_asks_for_the_token_again(browser, site):
    browser.get(site + "/archives")
    cookie = browser.get_cookie("tannery_token")["value"]
    assert cookie != READ_TOKEN
    _by(browser, "#sign-out")[0].click()
    _wait(browser, lambda b: _status(b) in ("401", "403"), "the page asking for a token")
    assert browser.get_cookie("tannery_token") is None


def test_the_log_scale_histogram_and_the_download_links(browser, site, versions):
    browser.get(site + "/entry?archive=tiny/v1&name=head")
    assert _by(browser, "#histogram")[0].get_attribute("data-scale") == "linear"
    _by(browser, "#log-scale")[0].click()
    _wait(browser, lambda b: _by(b, '#histogram[data-scale="log"]'), "the log-scale histogram")
    href = _by(browser, "#download-npy")[0].get_attribute("href")
    assert href.endswith("/download/entry?archive=tiny/v1&name=head")
    browser.get(site + "/archive?name=tiny/v1")
    assert _by(browser, "#download-safetensors")[0].get_attribute("href").endswith("/download/archive?name=tiny/v1")
