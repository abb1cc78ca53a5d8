"""/dashboard in a real headless chromium against a live server.

The grid draws one cell per block id (64 online + the null block); long streams turn free
blocks into used ones (and an n=2 request's prompt blocks into shared ones) on the map without
a reload; hovering a block shows its tooltip; clicking a request highlights its block table.
With keys configured the page asks for one, then shows the map. A KV producer's leased blocks
are drawn in the lease colour until the lease ends. Chromium and chromedriver are
installed by `make setup`: a missing browser fails the test, it never skips it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from kvpool.inspect.palette import LEASED_COLOUR
from kvpool.openai.auth import ApiKeyTable
from kvpool.server.config import ServerConfig
from scripts.screenshots import headless_chromium, hover_block
from tests.engine.kv_connector.loopback_pair import CONSUMER, PRODUCER
from tests.engine.kv_connector.loopback_pair import PROMPT as HANDOVER_PROMPT
from tests.server.conftest import MODEL, RunningServer, slow_steps

NUM_BLOCKS = 64
PROMPT = "The lighthouse keeper wrote down every ship that passed the northern cape, " * 2


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    try:
        driver = headless_chromium(1200, 900)
    except RuntimeError as error:
        pytest.fail(str(error))
    yield driver
    driver.quit()


@contextmanager
def streaming(server: RunningServer, n: int, headers: dict[str, str] | None = None
              ) -> Iterator[None]:
    """A long completion in flight (first token out) until the block ends."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 250, "n": n, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http, http.stream(
            "POST", "/v1/completions", json=body, headers=headers or {}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept open: a closed iterator closes the connection
        while not next(lines).startswith("data:"):
            pass
        yield


def grid_data(browser: WebDriver) -> dict[str, Any]:
    grid = browser.find_element(By.ID, "block-grid")
    return {"count": int(grid.get_attribute("data-block-count") or 0),
            "online": int(grid.get_attribute("data-online-blocks") or 0),
            "states": json.loads(grid.get_attribute("data-state-counts") or "{}"),
            "shared": int(grid.get_attribute("data-shared-count") or 0),
            "highlighted": int(grid.get_attribute("data-highlighted-count") or 0)}


def cell_colour(browser: WebDriver, grid: Any, block_id: int) -> str:
    """The colour drawn in a corner of `block_id`'s cell, as "#rrggbb"."""
    red, green, blue = browser.execute_script("""
        const [canvas, id] = arguments, ratio = window.devicePixelRatio || 1;
        const cell = Number(canvas.dataset.cellSize), columns = Number(canvas.dataset.columns);
        const x = (id % columns) * cell + 1, y = Math.floor(id / columns) * cell + 1;
        return Array.from(canvas.getContext("2d").getImageData(x * ratio, y * ratio, 1, 1)
                          .data.slice(0, 3));""", grid, block_id)
    return f"#{red:02x}{green:02x}{blue:02x}"


def request_rows(browser: WebDriver) -> list[Any]:
    return browser.find_elements(By.CSS_SELECTOR, "#request-table tr[data-request-id]")


def wait_for(browser: WebDriver, condition, timeout: float = 10) -> Any:
    return WebDriverWait(browser, timeout, poll_frequency=0.1).until(lambda _: condition())


def test_the_map_follows_the_pool_and_answers_hover_and_click(
        browser, make_server, tmp_path: Path) -> None:
    server = make_server(num_gpu_blocks=NUM_BLOCKS)
    slow_steps(server, 0.02)  # 250 tokens: over 5 s in flight (3 sequences fit 64 blocks)
    browser.get(f"{server.base_url}/dashboard?interval=200")
    idle = wait_for(browser, lambda: grid_data(browser)["count"] and grid_data(browser))
    assert (idle["count"], idle["online"]) == (NUM_BLOCKS + 1, NUM_BLOCKS)  # + the null block
    assert idle["states"] == {"free": NUM_BLOCKS, "used": 0, "cached": 0, "offline": 1,
                              "other": 0}
    with ExitStack() as stack:
        stack.enter_context(streaming(server, n=2))
        stack.enter_context(streaming(server, n=1))
        rows = wait_for(browser, lambda: len(request_rows(browser)) == 3  # one per sequence
                        and request_rows(browser))  # both requests on the page: sharing settled
        busy = grid_data(browser)
        assert busy["states"]["used"] > 0 and busy["shared"] > 0
        assert busy["count"] == sum(busy["states"].values()) == NUM_BLOCKS + 1

        grid = browser.find_element(By.ID, "block-grid")
        tooltip = browser.find_element(By.ID, "block-tooltip")

        def tooltip_shows_a_shared_block() -> dict | None:
            """Hover a shared block of a fresh snapshot; its tooltip says what the server
            says (retried: the page shows the poll before, and a third sequence may still be
            joining the shared prefix)."""
            snapshot = httpx.get(f"{server.base_url}/v1/kv/snapshot").json()
            first, _, _, ref_count, _, holders = next(
                run for run in snapshot["pools"]["device"]["runs"] if run[3] > 1)
            hover_block(browser, grid, first)
            owner = snapshot["sequences"][holders[0]]["request_id"]
            text = tooltip.text if tooltip.is_displayed() else ""
            shown = (tooltip.get_attribute("data-block-id") == str(first)
                     and f"block {first} · used" in text and owner in text
                     and f"ref count {ref_count} (shared)" in text)
            return snapshot if shown else None

        snapshot = wait_for(browser, tooltip_shows_a_shared_block)

        request_id = rows[-1].get_attribute("data-request-id")
        rows[-1].click()
        lit = wait_for(browser, lambda: grid_data(browser)["highlighted"])
        own = {first + i for seq in snapshot["sequences"] if seq["request_id"] == request_id
               for first, count in seq["block_ids"] for i in range(count)}
        assert lit >= len(own) > 0  # its table then, and maybe a block more since
        selected = browser.find_elements(By.CSS_SELECTOR, "#request-table tr.selected")
        assert {row.get_attribute("data-request-id") for row in selected} == {request_id}
        shot = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    charts = browser.find_elements(By.CSS_SELECTOR, "#charts figure")
    assert {c.get_attribute("id") for c in charts} >= {"chart-usage", "chart-hit-rate",
                                                       "chart-alloc-rate", "chart-preemptions",
                                                       "chart-fragmentation"}


def test_a_producers_leased_blocks_have_a_colour_of_their_own(browser, make_server) -> None:
    producer = make_server(num_gpu_blocks=NUM_BLOCKS, kv_transfer_config=PRODUCER)
    consumer = make_server(num_gpu_blocks=NUM_BLOCKS, kv_transfer_config=CONSUMER)
    body = {"model": MODEL, "prompt": HANDOVER_PROMPT, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}
    handover = httpx.post(f"{producer.base_url}/v1/completions", json=body,
                          timeout=60).json()["kv_transfer_params"]
    browser.get(f"{producer.base_url}/dashboard?interval=200")
    grid = browser.find_element(By.ID, "block-grid")
    wait_for(browser, lambda: grid.get_attribute("data-leased-count") == str(
        len(handover["remote_block_ids"])))
    first = handover["remote_block_ids"][0]
    assert cell_colour(browser, grid, first) == LEASED_COLOUR
    assert "leased for decode" in browser.find_element(By.ID, "legend").text
    tooltip = browser.find_element(By.ID, "block-tooltip")
    hover_block(browser, grid, first)
    wait_for(browser, lambda: "1 lease(s): kept for a decode worker" in tooltip.text)

    body = {**body, "max_tokens": 4, "kv_transfer_params": handover}
    assert httpx.post(f"{consumer.base_url}/v1/completions", json=body,
                      timeout=60).status_code == 200
    wait_for(browser, lambda: grid.get_attribute("data-leased-count") == "0")  # released
    assert cell_colour(browser, grid, first) != LEASED_COLOUR


def test_the_page_asks_for_a_key_when_the_server_needs_one(browser, make_server) -> None:
    keys = ApiKeyTable.from_keys([("alice", "key-alice")])
    server = make_server(ServerConfig(served_model_names=(MODEL,), api_keys=keys),
                         num_gpu_blocks=NUM_BLOCKS)
    browser.get(f"{server.base_url}/dashboard?interval=200")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    form = browser.find_element(By.ID, "key-form")
    wait_for(browser, form.is_displayed)
    assert grid_data(browser)["count"] == 0  # nothing shown without a key
    browser.find_element(By.ID, "api-key").send_keys("key-alice")
    browser.find_element(By.ID, "key-submit").click()
    wait_for(browser, lambda: grid_data(browser)["count"] == NUM_BLOCKS + 1)
    assert not form.is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('kvpool-api-key')") == \
        "key-alice"


def test_a_hybrid_models_other_groups_get_maps_of_their_own(browser, smollm2) -> None:
    """A model with sliding-window layers: its window group's pool ("device/g1") is drawn
    under the device map, fills while a long completion streams, and lights up the selected
    request's blocks in that group."""
    import dataclasses

    import transformers

    from kvpool.model.hf_config import config_from_hf
    from kvpool.model.loaders import load_model
    from kvpool.model.loaders.base import LoadedModel
    from tests.server.conftest import serve

    hf = transformers.MinistralConfig(
        vocab_size=smollm2.config.vocab_size, hidden_size=32, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_hidden_layers=2,
        sliding_window=32, max_position_embeddings=1024,
        layer_types=["sliding_attention", "full_attention"])
    config = dataclasses.replace(config_from_hf(hf.to_dict()),
                                 eos_token_ids=smollm2.config.eos_token_ids)
    dummy = load_model(config, load_format="dummy", seed=1)
    loaded = LoadedModel(config, dummy.model, smollm2.tokenizer, dummy.load_seconds)
    with serve(loaded, block_size=16, kv_cache_memory=1 << 20) as server:
        slow_steps(server, 0.02)
        browser.get(f"{server.base_url}/dashboard?interval=200")
        with streaming(server, n=1):
            canvas = wait_for(browser, lambda: browser.find_elements(By.ID, "grid-device-g1"))
            grid = canvas[0]
            assert browser.find_element(By.ID, "group-section").is_displayed()
            wait_for(browser, lambda: json.loads(
                grid.get_attribute("data-state-counts") or "{}").get("used", 0) > 0)
            row = wait_for(browser, lambda: request_rows(browser))[0]
            row.click()
            wait_for(browser, lambda: int(grid.get_attribute("data-highlighted-count")) > 0)
            title = browser.find_element(By.ID, "grid-device-g1-title").text
            assert title.startswith("device/g1 · ")
