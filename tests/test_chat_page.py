"""The chat page at `/`: how it is served (headers, API key, same-origin guards) against a real
`python -m mlxrs serve`, and the page itself in a headless Chromium (Playwright) when one is
installed: a streamed answer, stop, regenerate, markup in model output shown as text, reasoning,
the /stats panel, the API key prompt, an image attached for a model that takes images (the answer the
OpenAI SDK gets for the same messages; regenerate resends it; kept in localStorage, or dropped from it
with a notice when it does not fit). A screenshot is written to $MLXRS_TEST_ARTIFACTS (default
tests/.artifacts)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import openai
import pytest

from scriptedmodel import THINK_SCRIPT, make_scripted_model
from server_util import Server
from test_server_vision import _png, data_url
from tinymodels import make_gemma3_vision

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
        # images: the page's own and data: URLs (attached images' thumbnails), nothing from elsewhere
        assert "img-src 'self' data:;" in csp and "blob:" not in csp and "*" not in csp
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
    # a text-only model: /v1/models says so, and the page offers no image attach
    assert xss.get("/v1/models")[1]["data"][0]["input_modalities"] == ["text"]
    assert page.locator("#attach").is_hidden()
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
    status, want = talker.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 12}
    )
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


# -- images (a model that takes them) --------------------------------------------------------------
VISION_MODEL = "gemma3-vision-f32"
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def vision():
    with Server(make_gemma3_vision()) as s:
        yield s


def _write_png(path: Path, seed: int) -> str:
    """A random 80x60 PNG written with Pillow; its data: URL."""
    path.write_bytes(_png(seed))
    return data_url(_png(seed))


def _chat_requests(page) -> list[dict]:
    """The bodies of the page's chat requests, as they are sent."""
    sent: list[dict] = []
    page.on(
        "request", lambda r: sent.append(json.loads(r.post_data)) if r.url.endswith("/v1/chat/completions") else None
    )
    return sent


def _stored(page) -> list[dict]:
    return page.evaluate("JSON.parse(localStorage.getItem('mlxrs.chat.conversation'))")


def _open_with_greedy(page, server, max_tokens: int = 12) -> None:
    page.goto(server.url + "/")
    page.wait_for_function(f"() => document.querySelector('#model').textContent === '{VISION_MODEL}'")
    page.click("#toggle-settings")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(max_tokens))


def test_browser_attaches_an_image_for_a_model_that_takes_images(page, vision, tmp_path):
    assert vision.get("/v1/models")[1]["data"][0]["input_modalities"] == ["text", "image"]
    url = _write_png(tmp_path / "noise.png", 11)
    sent = _chat_requests(page)
    _open_with_greedy(page, vision)
    assert page.locator("#attach").is_visible()
    page.set_input_files("#attach-input", str(tmp_path / "noise.png"))
    page.wait_for_selector("#attachments img.thumb")
    ask(page, QUESTION)
    page.wait_for_selector(".msg.assistant .meta")
    assert page.locator("#attachments").is_hidden()  # sent with the message
    # the request carries the image as an OpenAI image_url data: URL part
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}],
        }
    ]
    assert [b["messages"] for b in sent] == [msgs]
    # the oracle: the API itself, through the OpenAI SDK, for the same messages
    want = openai.OpenAI(base_url=vision.url + "/v1", api_key="x", max_retries=0, timeout=120).chat.completions.create(
        model=VISION_MODEL, messages=msgs, temperature=0, max_tokens=12
    )
    answer = want.choices[0].message.content
    assert answer and _stored(page)[1]["content"] == answer
    meta = page.locator(".msg.assistant .meta").text_content()
    assert f"{want.usage.completion_tokens} tokens" in meta and f"prompt {want.usage.prompt_tokens} " in meta
    # the thumbnail: an <img> built by the page from the data: URL, loaded under the page's CSP
    thumb = page.locator(".msg.user img.thumb")
    assert thumb.get_attribute("src") == url
    page.wait_for_function("() => document.querySelector('.msg.user img.thumb').naturalWidth === 80")
    # regenerate resends the image: the same request, the same answer
    page.click("#regenerate")
    page.wait_for_selector(".msg.assistant .meta")
    assert [b["messages"] for b in sent] == [msgs, msgs]
    assert _stored(page)[1]["content"] == answer
    # kept in localStorage with the image: after a reload the thumbnail is back, and is resent
    assert _stored(page)[0]["images"] == [{"name": "noise.png", "url": url}]
    page.reload()
    page.wait_for_function("() => document.querySelector('.msg.user img.thumb')?.naturalWidth === 80")
    page.click("#regenerate")
    page.wait_for_selector(".msg.assistant .meta")
    assert [b["messages"] for b in sent] == [msgs, msgs, msgs]
    assert _stored(page)[1]["content"] == answer and page.locator("#notice").is_hidden()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat-page-image.png"), full_page=True)
    assert not page.errors, page.errors  # type: ignore[attr-defined]


# the browser's storage is full for anything past 20 kB (the PNG's data: URL is ~19 kB)
FULL_STORAGE = """
const setItem = Storage.prototype.setItem;
Storage.prototype.setItem = function (k, v) {
  if (k === "mlxrs.chat.conversation" && String(v).length > 20000) throw new DOMException("full", "QuotaExceededError");
  return setItem.call(this, k, v);
};"""


def test_browser_drops_images_from_full_storage_with_a_notice(page, vision, tmp_path):
    url = _write_png(tmp_path / "big.png", 12)
    assert 15000 < len(url) < 20000
    page.add_init_script(FULL_STORAGE)
    sent = _chat_requests(page)
    _open_with_greedy(page, vision, max_tokens=4)
    page.set_input_files("#attach-input", [str(tmp_path / "big.png")])
    page.wait_for_selector("#attachments img.thumb")
    page.set_input_files("#attach-input", [str(tmp_path / "big.png")])  # a second image: over 20 kB
    page.wait_for_selector("#attachments .attachment:nth-child(2)")
    page.click("#attachments .attachment:nth-child(2) button")  # removed again before sending
    page.set_input_files("#attach-input", [str(tmp_path / "big.png")])
    page.wait_for_function("() => document.querySelectorAll('#attachments img.thumb').length === 2")
    ask(page, QUESTION)
    page.wait_for_selector(".msg.assistant .meta")
    parts = [{"type": "image_url", "image_url": {"url": url}}] * 2 + [{"type": "text", "text": QUESTION}]
    assert sent[0]["messages"] == [{"role": "user", "content": parts}]
    # not kept: a visible notice; the images stay on the page until it is reloaded
    assert "too large for the browser's storage" in page.locator("#notice").text_content()
    assert page.locator("#notice").is_visible() and page.locator(".msg.user img.thumb").count() == 2
    assert _stored(page)[0]["images"] == [{"name": "big.png", "dropped": True}] * 2
    # after a reload: a note in their place, and regenerate sends the text alone
    page.reload()
    page.wait_for_selector(".msg.user .image-dropped")
    assert page.locator(".msg.user img").count() == 0 and page.locator(".msg.user .image-dropped").count() == 2
    page.click("#regenerate")
    page.wait_for_selector(".msg.assistant .meta")
    assert sent[-1]["messages"] == [{"role": "user", "content": QUESTION}]
    assert not page.errors, page.errors  # type: ignore[attr-defined]


# an image File in a DataTransfer, pasted into the input or dropped on the composer
DELIVER = """([kind, b64]) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const dt = new DataTransfer();
  dt.items.add(new File([bytes], kind + ".png", { type: "image/png" }));
  if (kind === "pasted") document.querySelector("#input").dispatchEvent(
    new ClipboardEvent("paste", { clipboardData: dt, bubbles: true, cancelable: true }));
  else document.querySelector("#composer").dispatchEvent(
    new DragEvent("drop", { dataTransfer: dt, bubbles: true, cancelable: true }));
}"""


def test_browser_attaches_a_pasted_or_dropped_image(page, vision, xss):
    png = _png(13)
    b64 = data_url(png).split(",", 1)[1]
    _open_with_greedy(page, vision)
    page.evaluate(DELIVER, ["pasted", b64])
    page.evaluate(DELIVER, ["dropped", b64])
    page.wait_for_function("() => document.querySelectorAll('#attachments img.thumb').length === 2")
    assert [page.locator("#attachments img.thumb").nth(i).get_attribute("alt") for i in range(2)] == [
        "pasted.png",
        "dropped.png",
    ]
    assert page.locator("#attachments img.thumb").first.get_attribute("src") == data_url(png)
    # a text-only model takes none
    page.goto(xss.url + "/")
    page.wait_for_function("() => document.querySelector('#model').textContent === 'scripted-xss'")
    page.evaluate(DELIVER, ["pasted", b64])
    page.evaluate(DELIVER, ["dropped", b64])
    page.wait_for_timeout(300)
    assert page.locator("#attachments img").count() == 0 and page.locator("#attachments").is_hidden()
    assert not page.errors, page.errors  # type: ignore[attr-defined]
