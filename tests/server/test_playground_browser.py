"""The playground page in a real headless Chromium (Debian's `chromium`, driven by Playwright)
against a real `qserve serve` on a loopback port: a streamed reply that grows, Stop mid-reply
(every KV block free again, the request aborted, not finished), and --api-key.

Without /usr/bin/chromium (or $QSERVE_CHROMIUM) or the playwright package the tests skip;
with QSERVE_REQUIRE_BROWSER=1 (.ci/run sets it) they fail instead. The screenshot of the
stopped reply is saved as `playground-stopped.png` in the test's tmp_path (its path printed;
`pytest -s` shows it, `--basetemp DIR` keeps it somewhere known)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.test_lifecycle import serve_process

try:  # pinned in the [test] extra; without it the tests skip (or fail, in CI)
    from playwright.sync_api import expect, sync_playwright
except ImportError:
    expect = sync_playwright = None

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
API_KEY = "playground-key"
LONG_REPLY_TOKENS = 470  # the tiny model's context is 512 tokens
TIMEOUT_MS = 30_000


def _chromium() -> str | None:
    path = os.environ.get("QSERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    return path if os.access(path, os.X_OK) else None


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("QSERVE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (QSERVE_REQUIRE_BROWSER=1)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser_context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A Chromium context with a fresh profile folder."""
    executable = _chromium()
    if executable is None:
        _skip_or_fail("no chromium (apt-get install chromium, or set QSERVE_CHROMIUM)")
    if sync_playwright is None:
        _skip_or_fail("the playwright package is missing (pip install -e '.[test]')")
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=executable, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900},
        )  # fmt: skip
        context.set_default_timeout(TIMEOUT_MS)
        expect.set_options(timeout=TIMEOUT_MS)
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser_context: Any) -> Iterator[Any]:
    page = browser_context.new_page()
    try:
        yield page
    finally:
        page.close()


def _server_info(base_url: str, key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(f"{base_url}/server_info", headers=headers, timeout=10)
    response.raise_for_status()
    return response.json()


def _finished_requests(base_url: str, key: str | None = None) -> float:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10).text
    name = "qserve:e2e_request_latency_seconds_count"
    (line,) = [x for x in text.splitlines() if x.startswith(name)]
    return float(line.rsplit(" ", 1)[1])


def _wait_all_blocks_free(base_url: str, key: str | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    info = _server_info(base_url, key)
    while time.monotonic() < deadline and (
        info["kv_cache_usage"]["used_blocks"] or info["requests"]["running"]
    ):
        time.sleep(0.05)
        info = _server_info(base_url, key)
    return info


def _send(page: Any, text: str, max_tokens: int, ignore_eos: bool = False) -> Any:
    page.fill("#max_tokens", str(max_tokens))
    page.set_checked("#ignore_eos", ignore_eos)
    page.fill("#prompt", text)
    page.click("#send")
    return page.locator(".message.assistant").last


def _growing_lengths(reply: Any, wanted: int) -> list[int]:
    """The reply's text length, polled until it has grown `wanted` times while streaming."""
    lengths: list[int] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = reply.locator(".text").text_content() or ""
        if reply.get_attribute("data-state") != "streaming":
            break
        if not lengths or len(text) > lengths[-1]:
            lengths.append(len(text))
        if sum(b > a for a, b in zip(lengths, lengths[1:])) >= wanted:
            return lengths
        time.sleep(0.01)
    raise AssertionError(f"the reply did not grow {wanted} times while streaming: {lengths}")


def test_chat_streams_and_stop_frees_every_block(
    page: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    with serve_process(tiny_model_dir, "5") as (_, base_url):
        page.goto(f"{base_url}/")
        expect(page.locator("#kv-total")).to_have_text("128")
        assert page.text_content("#info-model") == "tiny-smollm"
        assert page.text_content("#info-scheme") == "dense"
        assert "q_proj" in page.text_content("#kernel-paths")
        finished_before = _finished_requests(base_url)

        page.fill("#system", "You are a storyteller.")
        page.fill("#temperature", "0.8")
        page.fill("#seed", "7")
        reply = _send(page, "Tell me a very long story.", LONG_REPLY_TOKENS, ignore_eos=True)
        lengths = _growing_lengths(reply, wanted=2)
        page.click("#stop")
        expect(reply).to_have_attribute("data-state", "stopped")
        stopped_text = reply.locator(".text").text_content() or ""
        assert len(stopped_text) >= lengths[-1] > lengths[0]
        assert "stopped after" in reply.locator(".stats").text_content()
        assert page.is_disabled("#stop") and page.is_enabled("#send")

        info = _wait_all_blocks_free(base_url)
        assert info["kv_cache_usage"]["used_blocks"] == 0
        assert info["kv_cache_usage"]["free_blocks"] == info["kv_cache"]["num_blocks"]
        assert info["requests"] == {"running": 0, "waiting": 0}
        # aborted on the disconnect, not run to its 470 tokens
        assert _finished_requests(base_url) == finished_before
        expect(page.locator("#kv-used")).to_have_text("0")
        screenshot = tmp_path / "playground-stopped.png"
        page.screenshot(path=str(screenshot), full_page=True)
        print(f"screenshot: {screenshot}")
        assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        # a second reply runs to its end and shows its timing and the stream's token counts
        reply = _send(page, "And a short one.", 8, ignore_eos=True)
        expect(reply).to_have_attribute("data-state", "done")
        stats = reply.locator(".stats").text_content()
        assert "time to first token" in stats and "tokens/s" in stats
        assert "+ 8 completion" in stats and "finish: length" in stats


def test_api_key_is_asked_for_and_a_wrong_one_shows_the_servers_message(
    page: Any, tiny_model_dir: Path
) -> None:
    with serve_process(tiny_model_dir, "5", "--api-key", API_KEY) as (_, base_url):
        page.goto(f"{base_url}/")
        page.wait_for_selector("#key-form:not([hidden])")
        page.fill("#api-key", "wrong-key")
        page.click("#key-submit")
        page.wait_for_selector("#key-error:has-text('Incorrect or missing API key')")
        # a message sent with the wrong key gets the server's words, not a blank reply
        reply = _send(page, "Hello?", 4)
        expect(reply).to_have_attribute("data-state", "error")
        assert "Incorrect or missing API key" in reply.locator(".text").text_content()

        page.fill("#api-key", API_KEY)
        page.click("#key-submit")
        page.wait_for_selector("#key-form", state="hidden")
        expect(page.locator("#info-model")).to_have_text("tiny-smollm")
        reply = _send(page, "Hello again", 4, ignore_eos=True)
        expect(reply).to_have_attribute("data-state", "done")
        assert "+ 4 completion" in reply.locator(".stats").text_content()
        assert page.evaluate("sessionStorage.getItem('qserve.apiKey')") == API_KEY
        assert page.evaluate("localStorage.length") == 0
        _wait_all_blocks_free(base_url, API_KEY)
