"""Save the pictures in docs/inspect.md: the dashboard, the pool map and the KV timeline.

    python scripts/screenshots.py [--img-dir docs/img] [--num-gpu-blocks 160]

writes dashboard.png (the /dashboard page of a real server with traffic in flight),
pool_map.png (`kvpool inspect --png` of a snapshot taken at the same moment) and
kv_timeline.png (`kvpool inspect trace --png` of the run's `--kv-trace`).

Starts SmolLM2 behind a background server, streams a few long completions (one with n=2, so
its prompt blocks are shared, and two with a common prefix, so some blocks are cached), opens
the dashboard in headless chromium, selects a request and hovers one of its blocks, and saves
the window. Needs chromium and chromedriver (`make setup` installs them); the browser test
(tests/server/test_dashboard_browser.py) drives the page with `headless_chromium` below.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import threading
import time
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = ("chromium", "/usr/bin/chromium")
CHROMEDRIVER = ("chromedriver", "/usr/bin/chromedriver")
SYSTEM = "You are the harbour's archivist. Answer in full sentences, citing the ledger. "


def find_browser() -> tuple[str, str]:
    """Paths of chromium and its chromedriver; RuntimeError saying how to get them."""
    found = [shutil.which(name) or (path if Path(path).exists() else None)
             for name, path in (CHROMIUM, CHROMEDRIVER)]
    if None in found:
        raise RuntimeError("chromium and chromedriver are needed (`make setup` installs them: "
                           "apt-get install chromium chromium-driver)")
    return found[0], found[1]  # type: ignore[return-value]


def headless_chromium(width: int = 1280, height: int = 1000) -> WebDriver:
    """Debian's chromium through its own chromedriver: both paths are given, so Selenium
    Manager never downloads a browser or a driver."""
    browser, driver = find_browser()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


def stream(base_url: str, prompt: str, max_tokens: int, n: int = 1) -> None:
    """One streaming completion, read to its end (or until the server stops)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "n": n, "stream": True,
            "ignore_eos": True, "temperature": 0.8}
    with contextlib.suppress(httpx.HTTPError), httpx.stream(
            "POST", f"{base_url}/v1/completions", json=body, timeout=600) as response:
        for _ in response.iter_lines():
            pass


def traffic(base_url: str) -> list[threading.Thread]:
    """Warm the cache with one finished request, start long ones in the background, and keep
    short requests on a shared system prompt coming (they finish, leave cached blocks, hit
    the cached prefix and, in a small pool, make it evict)."""
    stream(base_url, SYSTEM + "List the ships of 1851.", 8)
    prompts = [(SYSTEM + "Describe the winter storm of 1852 in detail.", 600, 1),
               (SYSTEM + "Write the keeper's log for one week.", 600, 2),
               ("An unrelated prompt about tide tables and the moon. " * 3, 600, 1)]
    threads = [threading.Thread(target=stream, args=(base_url, prompt, max_tokens, n),
                                daemon=True) for prompt, max_tokens, n in prompts]
    threads += [threading.Thread(target=churn, args=(base_url, worker), daemon=True)
                for worker in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.3)
    return threads


def churn(base_url: str, worker: int) -> None:
    """Short requests one after another: a shared system prompt, then a question of its own."""
    for index in range(60):
        question = f"Ledger entry {worker}-{index}: which cargo came in on day {index}? " * (
            1 + index % 3)
        stream(base_url, SYSTEM + question, 16 + 8 * (index % 5))


def hover_block(driver: WebDriver, grid: WebElement, block_id: int) -> None:
    """Move the mouse to the middle of `block_id`'s cell on a dashboard grid."""
    cell = int(grid.get_attribute("data-cell-size") or 0)
    columns = int(grid.get_attribute("data-columns") or 1)
    x = (block_id % columns) * cell + cell // 2
    y = (block_id // columns) * cell + cell // 2
    # Selenium 4 offsets are from the element's centre.
    ActionChains(driver).move_to_element_with_offset(
        grid, x - grid.size["width"] // 2, y - grid.size["height"] // 2).perform()


def capture(base_url: str, out: Path) -> dict:
    """Open the dashboard, select the first request, hover one of its blocks, save."""
    driver = headless_chromium()
    try:
        driver.get(f"{base_url}/dashboard?interval=500")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "tr[data-request-id]"))
        time.sleep(8)  # polls enough for the time series to have a shape
        row = driver.find_element(By.CSS_SELECTOR, "tr[data-request-id]")
        request_id = row.get_attribute("data-request-id")
        row.click()
        grid = driver.find_element(By.ID, "block-grid")
        wait.until(lambda d: int(grid.get_attribute("data-highlighted-count") or 0) > 0)
        snapshot = httpx.get(f"{base_url}/v1/kv/snapshot", timeout=30).json()
        first_id = next(seq["block_ids"][0][0] for seq in snapshot["sequences"]
                        if seq["request_id"] == request_id)
        hover_block(driver, grid, first_id)
        out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(out))
        return snapshot
    finally:
        driver.quit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--img-dir", type=Path, default=Path("docs/img"))
    parser.add_argument("--num-gpu-blocks", type=int, default=160)
    args = parser.parse_args()

    import tempfile

    from kvpool.engine.async_engine import AsyncLLMEngine
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.engine import LLMEngine
    from kvpool.formats.kv_snapshot import KVSnapshot
    from kvpool.formats.kv_trace import read_kv_trace
    from kvpool.inspect.pool_map import draw_pool_map
    from kvpool.inspect.timeline import write_timeline
    from kvpool.server.app import build_app
    from kvpool.server.background import BackgroundServer
    from kvpool.server.config import ServerConfig

    find_browser()  # fail before loading the model
    trace = Path(tempfile.mkdtemp()) / "kv_trace.jsonl"
    config = EngineConfig(dtype="float32", num_gpu_blocks=args.num_gpu_blocks,
                          kv_trace=str(trace))
    engine = AsyncLLMEngine(LLMEngine(config))
    app = build_app(engine, ServerConfig(shutdown_grace_seconds=0))  # abort the rest at exit
    with BackgroundServer(app) as server:
        traffic(server.base_url)
        snapshot = capture(server.base_url, args.img_dir / "dashboard.png")
    engine.engine.close()  # the trace's last lines
    draw_pool_map(KVSnapshot.from_json(snapshot), args.img_dir / "pool_map.png")
    write_timeline(read_kv_trace(trace), args.img_dir / "kv_timeline.png", None)
    print(f"saved dashboard.png, pool_map.png and kv_timeline.png in {args.img_dir}")


if __name__ == "__main__":
    main()
