"""The chat page at `/`: how it is served (headers, API key, same-origin guards) against a real
`python -m mlxrs serve`, and the page itself in a headless Chromium (Playwright) when one is
installed: a streamed answer, stop, regenerate, markup in model output shown as text, reasoning,
the /stats panel, the API key prompt. A screenshot is written to $MLXRS_TEST_ARTIFACTS (default
tests/.artifacts)."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from scriptedmodel import THINK_SCRIPT, make_scripted_model
from server_util import Server

XSS = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2"> **bold** `x<b>y</b>`'
XSS_SCRIPT = [THINK_SCRIPT[0], "\nthinking <b>hard</b>\n", THINK_SCRIPT[2], "\n\n" + XSS]
ARTIFACTS = Path(os.environ.get("MLXRS_TEST_ARTIFACTS", Path(__file__).parent / ".artifacts"))


@pytest.fixture(scope="module")
def xss_model():
    return make_scripted_model("scripted-xss", think_script=XSS_SCRIPT)


@pytest.fixture(scope="module")
def xss(xss_model):
    with Server(xss_model) as s:
        yield s


@pytest.fixture(scope="module")
def talker(looping_server):
    """Talks until max_tokens (4078 tokens, some seconds): a stream to stop."""
    return looping_server


# -- serving (no browser needed) ------------------------------------------------------------------
def test_page_and_assets_are_served_with_a_strict_csp(xss):
    status, html = xss.get("/")
    assert status == 200 and "<title>mlxrs chat</title>" in html
    import http.client

    for path, ctype in (("/", "text/html"), ("/static/chat.js", "text/javascript"), ("/static/chat.css", "text/css")):
        conn = http.client.HTTPConnection("127.0.0.1", xss.port, timeout=10)
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
        conn.close()
        assert r.status == 200 and r.getheader("Content-Type").startswith(ctype), (path, r.getheaders())
        csp = r.getheader("Content-Security-Policy")
        assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
        assert r.getheader("X-Content-Type-Options") == "nosniff"
        assert b"http://" not in body and b"https://" not in body  # offline: nothing from elsewhere
    assert xss.get("/static/../__init__.py")[0] == 404
    assert xss.get("/static/nope.js")[0] == 404


def test_js_never_puts_text_into_the_page_as_html():
    js = (Path(__file__).parents[1] / "python/mlxrs/server/static/chat.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in js, sink


def test_page_with_api_key_and_same_origin_guards(xss_model):
    with Server(xss_model, "--api-key", "k1") as s:
        assert s.get("/")[0] == 200 and s.get("/static/chat.js")[0] == 200  # the page loads without the key
        assert s.get("/v1/models")[0] == 401 and s.get("/stats")[0] == 401  # its API calls need it
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        # what the page's own fetch sends: same Origin as Host, JSON, the key
        same = {"Origin": s.url, "Authorization": "Bearer k1", "Host": f"127.0.0.1:{s.port}"}
        assert s.post("/v1/chat/completions", body, headers=same)[0] == 200
        other = {**same, "Origin": "http://evil.example"}
        assert s.post("/v1/chat/completions", body, headers=other)[0] == 403


# -- in a browser ---------------------------------------------------------------------------------
def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        p = shutil.which(name)
        if p:
            return p
    return None


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    exe = _chromium()
    with sync_api.sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=exe) if exe else p.chromium.launch()
        except Exception as e:  # no browser could be had (the Playwright download is not installed)
            pytest.skip(f"no headless Chromium: {e}")
        yield b
        b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context()
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.errors = errors  # type: ignore[attr-defined]
    yield pg
    ctx.close()


def ask(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def test_browser_markup_in_model_output_is_text(page, xss):
    page.goto(xss.url + "/")
    page.wait_for_function("() => document.querySelector('#model').textContent === 'scripted-xss'")
    ask(page, "hi")
    page.wait_for_selector(".msg.assistant .meta")  # the answer has ended
    content = page.locator(".msg.assistant .content")
    text = content.text_content()
    # the raw markup is shown as text, and no element came from it
    assert '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">' in text
    assert page.evaluate("document.querySelectorAll('#messages script, #messages img, #messages b').length") == 0
    assert page.evaluate("window.__pwned === undefined")
    # markdown of the same output: **bold** and `code` became elements, their text kept as is
    assert content.locator("strong").text_content() == "bold"
    assert content.locator("code").text_content() == "x<b>y</b>"
    # the reasoning is collapsed in a <details>, as text
    reasoning = page.locator(".msg.assistant details")
    assert reasoning.get_attribute("open") is None
    assert page.locator(".msg.assistant .reasoning").text_content().strip() == "thinking <b>hard</b>"
    # the conversation survives a reload (localStorage)
    page.reload()
    page.wait_for_selector(".msg.assistant .meta")
    assert XSS.split(" **")[0] in page.locator(".msg.assistant .content").text_content()
    assert page.evaluate("document.querySelectorAll('#messages script, #messages img').length") == 0
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat-page-markup.png"), full_page=True)
    assert not page.errors, page.errors  # type: ignore[attr-defined]


def test_browser_streams_stops_regenerates_and_shows_stats(page, talker):
    base = talker.stats()["requests"]
    page.goto(talker.url + "/")
    page.click("#toggle-settings")
    page.fill("#temperature", "0")
    ask(page, "hi")
    # streamed: text shows while the server is still generating
    page.wait_for_function("() => (document.querySelector('.msg.assistant .content')||{}).textContent?.length > 20")
    assert talker.stats()["requests"]["active"] == 1
    assert page.locator("#stop").is_enabled() and page.locator("#send").is_disabled()
    page.click("#stop")
    page.wait_for_selector(".msg.assistant .meta")
    assert page.locator(".msg.assistant .meta").text_content().startswith("stopped")
    deadline = time.monotonic() + 10
    while talker.stats()["requests"]["cancelled"] < base["cancelled"] + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert talker.stats()["requests"]["cancelled"] == base["cancelled"] + 1
    # regenerate with a max_tokens: the same question again, answered in full this time
    page.fill("#max-tokens", "12")
    page.click("#regenerate")
    page.wait_for_function("() => document.querySelector('.msg.assistant .meta')?.textContent.startsWith('length')")
    assert page.locator(".msg.user").count() == 1 and page.locator(".msg.assistant").count() == 1
    status, want = talker.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "temperature": 0, "max_tokens": 12})
    got = page.evaluate("JSON.parse(localStorage.getItem('mlxrs.chat.conversation'))")
    assert got[1]["content"] == want["choices"][0]["message"]["content"]
    assert got[1]["reasoning"] == want["choices"][0]["message"]["reasoning_content"]
    assert page.locator(".msg.assistant .meta").text_content().startswith("length · 12 tokens")
    # the stats panel shows the server's figures
    page.click("#toggle-stats")
    stats = talker.stats()
    page.wait_for_selector('dd[data-stat="cancelled"]')
    assert page.locator('dd[data-stat="cancelled"]').text_content() == str(stats["requests"]["cancelled"])
    assert page.locator('dd[data-stat="context ceiling"]').text_content() == f"{stats['context_tokens']} tokens"
    assert page.locator('dd[data-stat="model"]').text_content() == stats["model"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat-page-stats.png"), full_page=True)
    assert not page.errors, page.errors  # type: ignore[attr-defined]


def test_browser_asks_for_the_api_key_once(page, xss_model):
    with Server(xss_model, "--api-key", "k2") as s:
        prompts: list[str] = []

        def on_dialog(d):
            prompts.append(d.message)
            d.accept("k2")
        page.on("dialog", on_dialog)
        page.goto(s.url + "/")
        page.wait_for_function("() => document.querySelector('#model').textContent === 'scripted-xss'")
        ask(page, "hi")
        page.wait_for_selector(".msg.assistant .meta")
        assert "Hello" not in page.locator(".msg.assistant .content").text_content()  # the XSS script's answer
        assert "onerror" in page.locator(".msg.assistant .content").text_content()
        assert len(prompts) == 1 and "API key" in prompts[0]
        assert page.evaluate("localStorage.getItem('mlxrs.chat.apiKey')") == "k2"
        assert json.dumps(page.errors) == "[]"  # type: ignore[attr-defined]
