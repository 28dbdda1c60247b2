"""The web console in a real browser: Debian's chromium, headless, driven by Playwright (no
browser download), against the console process (`python -m services.console`) reading the three
services running for real. Every page renders its data; the trial page's chart holds one point per
tick; stepping the inspector shows the right tick; a running trial's curve grows within 2 seconds
of new samples; a download's bytes have the version's SHA-256; the console shows no error and
every request goes to the console's own origin. Screenshots of each page are kept in the test's
directory (`COGMENT_CONSOLE_SCREENSHOTS` copies them elsewhere, e.g. docs/images)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from playwright.async_api import Browser, ConsoleMessage, Page, Request, async_playwright

from services.model_registry.client.api import ModelRegistryClient
from tests.helpers.console_trials import record, rewarded_trial, running_suite, trial_inputs
from tests.helpers.datastore import send_acknowledged
from tests.helpers.running import (
    RunningRegistry,
)
from tests.helpers.services import PROJECT_ROOT, clean_environment

pytestmark = pytest.mark.timeout(180)

CHROMIUM = "/usr/bin/chromium"
START_TIMEOUT_S = 30.0
GROWTH_S = 2.0


@contextmanager
def console_process(log_dir: Path, *flags: str) -> Iterator[str]:
    """`python -m services.console --port 0 <flags>`; yields its URL once it serves."""
    log_path = log_dir / "console.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.console", "--port", "0", "--log_format", "json", *flags],
            cwd=PROJECT_ROOT,
            env=clean_environment(),
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
            serving = [line for line in lines if line.get("event") == "serving"]
            if serving:
                yield str(serving[0]["url"]).rstrip("/")
                break
            assert process.poll() is None, f"the console did not start:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"the console did not serve:\n{log_path.read_text()}"
            time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(timeout=15)


class Watched:
    """A page whose console errors and requests are recorded."""

    def __init__(self, page: Page, origin: str) -> None:
        self.page = page
        self.origin = origin
        self.errors: list[str] = []
        self.foreign: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda error: self.errors.append(str(error)))
        page.on("request", self._request)

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def _request(self, request: Request) -> None:
        if not request.url.startswith(self.origin + "/") and not request.url.startswith("blob:"):
            self.foreign.append(request.url)


@pytest.fixture
def chromium() -> str:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} not found: install Debian's chromium package (.ci/run does)")
    return CHROMIUM


@pytest.fixture
async def browser(chromium: str) -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(
            executable_path=chromium, args=["--no-sandbox"], headless=True
        )
        yield launched
        await launched.close()


async def shot(page: Page, directory: Path, name: str) -> None:
    path = directory / f"console-{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    copy_to = os.environ.get("COGMENT_CONSOLE_SCREENSHOTS")
    if copy_to:
        shutil.copy(path, Path(copy_to) / path.name)


async def test_the_console_in_a_browser(browser: Browser, tmp_path: Path) -> None:
    ticks = 60
    data = secrets.token_bytes(200_000)
    async with running_suite(tmp_path) as suite:
        directory, registry, datastore = suite.directory, suite.registry, suite.datastore
        for number in range(3):
            await record(datastore, f"trial-{number}", rewarded_trial(ticks, seed=number))
        await publish(registry, data)
        live = datastore.datalog.RunTrialDatalog(metadata=(("trial-id", "live"), ("user-id", "researcher")))
        running = rewarded_trial(ticks * 2, seed=9)
        await send_acknowledged(live, trial_inputs(running[:10]))

        flags = [
            "--directory_endpoint", f"grpc://{directory.address}",
            "--model_registry_endpoint", f"grpc://127.0.0.1:{registry.service.port}",
            "--trial_datastore_endpoint", f"grpc://127.0.0.1:{datastore.service.port}",
            "--proto_module", "services.demo.api.spec_pb2",
            "--messages", "class1=cogment_aux_demo.Observation,cogment_aux_demo.Action",
        ]  # fmt: skip
        with console_process(tmp_path, *flags) as origin:
            context = await browser.new_context(
                accept_downloads=True, viewport={"width": 1280, "height": 900}
            )
            watched = Watched(await context.new_page(), origin)
            page = watched.page

            await page.goto(origin + "/")
            assert await page.locator("#services td.up").count() == 3
            assert "4" in await page.locator("#trial-counts .count").inner_text()
            await shot(page, tmp_path, "overview")

            await page.click("nav >> text=Trials")
            rows = page.locator("#trials tbody tr[data-trial]")
            assert await rows.count() == 4
            assert await rows.first.get_attribute("data-trial") == "live"  # the newest first
            await shot(page, tmp_path, "trials")

            await page.click("a[href='/trials/trial-1']")
            await page.wait_for_function(
                f"document.getElementById('reward-chart').dataset.points === '{ticks}'"
            )
            points = await page.evaluate("document.getElementById('reward-chart').data[0].x.length")
            assert points == ticks
            assert "ticks." in await page.locator("#curve-status").inner_text()
            await page.locator("#shown-tick").wait_for()
            assert await page.locator("#shown-tick").inner_text() == "0"
            await page.click("#tick-next")
            await page.wait_for_function("document.getElementById('shown-tick').textContent === '1'")
            await page.fill("#tick-number", "42")
            await page.locator("#tick-number").dispatch_event("change")
            await page.wait_for_function("document.getElementById('shown-tick').textContent === '42'")
            assert "move: RIGHT" in await page.locator("#tick-view").inner_text()
            await shot(page, tmp_path, "trial")

            await page.goto(origin + "/trials/live")
            await page.wait_for_function("document.getElementById('reward-chart').dataset.points === '10'")
            await send_acknowledged(live, trial_inputs(running[10:20], with_params=False))
            sent = time.monotonic()
            await page.wait_for_function(
                "document.getElementById('reward-chart').data[0].x.length === 20", timeout=GROWTH_S * 1000
            )
            assert time.monotonic() - sent < GROWTH_S

            await page.goto(origin + "/compare?trial=trial-0&trial=trial-2")
            await page.locator("#compare-chart .main-svg").first.wait_for()
            assert await page.evaluate("document.getElementById('compare-chart').data.length") == 6

            await page.click("nav >> text=Models")
            await page.click("a[href='/models/policy']")
            assert await page.locator("#versions tbody tr").count() == 1
            await shot(page, tmp_path, "model")
            async with page.expect_download() as download_info:
                await page.click("#versions a.download")
            download = await download_info.value
            downloaded = await asyncio.to_thread(Path(await download.path()).read_bytes)
            assert hashlib.sha256(downloaded).hexdigest() == hashlib.sha256(data).hexdigest()
            # A new version appears without a reload.
            await publish(registry, b"second version", create=False)
            await page.wait_for_function("document.querySelectorAll('#versions tbody tr').length === 2")

            await page.click("nav >> text=Directory")
            assert await page.locator("#entries").count() == 1
            await shot(page, tmp_path, "directory")

            assert watched.errors == []
            assert watched.foreign == []
            await context.close()
        await live.done_writing()


async def publish(registry: RunningRegistry, data: bytes, create: bool = True) -> None:
    async with ModelRegistryClient(f"grpc://127.0.0.1:{registry.service.port}") as client:
        if create:
            await client.create_model("policy")
        await client.publish_version("policy", data)
