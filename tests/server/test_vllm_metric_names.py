"""`/metrics` under vLLM's names: every `vllm:` name docs/server.md lists is served, scraped
over HTTP, with the type, labels and values of its `kvpool:` twin; the docs' table and the
code's mapping are the same list."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpool.server.vllm_metric_names import VLLM_NAMES
from tests.server.conftest import MODEL

DOCS = Path(__file__).resolve().parents[2] / "docs" / "server.md"
PROMPT = "A long prompt about lighthouses and the keepers who lit them every night. " * 3


def documented_pairs() -> set[tuple[str, str]]:
    """(kvpool name, vllm name) rows of the *vLLM names* table, `_total` dropped."""
    section = DOCS.read_text().split("### vLLM names", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `kvpool:(\w+)` \| `vllm:(\w+)`", section, flags=re.MULTILINE)
    return {(re.sub(r"_total$", "", kvpool), re.sub(r"_total$", "", vllm))
            for kvpool, vllm in rows}


def families(base_url: str) -> dict[str, tuple[str, dict[tuple, float]]]:
    """name -> (type, {(sample suffix, sorted labels): value}) for one scrape."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    result = {}
    for family in text_string_to_metric_families(text):
        samples = {(sample.name[len(family.name):], tuple(sorted(sample.labels.items()))):
                   sample.value for sample in family.samples}
        result[family.name] = (family.type, samples)
    return result


def test_the_docs_table_is_the_code_mapping() -> None:
    pairs = {(kvpool, vllm) for kvpool, names in VLLM_NAMES.items() for vllm in names}
    assert documented_pairs() == pairs


def test_every_vllm_name_is_served_equal_to_its_kvpool_twin(make_server) -> None:
    server = make_server(num_gpu_blocks=16, swap_space=0.01, preemption_mode="swap")
    client = server.client()
    for index in range(2):  # 4 prompts each; the second reuses the first's prefixes
        client.completions.create(model=MODEL, prompt=[PROMPT, PROMPT + str(index)] * 2,
                                  max_tokens=20, extra_body={"ignore_eos": True})
    server.wait_until_idle()
    scraped = families(server.base_url)
    served = 0
    for kvpool, vllm in sorted(documented_pairs()):
        kvpool_type, kvpool_samples = scraped[f"kvpool:{kvpool}"]
        assert scraped[f"vllm:{vllm}"] == (kvpool_type, kvpool_samples), vllm
        assert all(("model_name", MODEL) in labels for _, labels in kvpool_samples)
        served += 1
    assert served == len(documented_pairs()) >= 23
    _, tokens = scraped["vllm:generation_tokens"]
    assert tokens[("_total", (("model_name", MODEL),))] == 2 * 4 * 20
    _, ttft = scraped["vllm:time_to_first_token_seconds"]
    assert ttft[("_count", (("model_name", MODEL),))] == 2 * 4
    _, hits = scraped["vllm:prefix_cache_hits"]
    assert hits[("_total", (("model_name", MODEL),))] > 0
    assert not any(name.startswith("vllm:") and name[5:] in ("num_blocks", "host_num_blocks")
                   for name in scraped)
