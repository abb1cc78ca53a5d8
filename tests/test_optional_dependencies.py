"""kvpool imports and generates offline without its optional packages (redis, xgrammar,
pyzmq, msgspec, pydantic/FastAPI, mooncake), as on the GPU image that lacks them; a feature
that needs one names it; the GPU check's test files still collect. Each case runs in a fresh
interpreter whose imports of those packages fail (`tests/optional_blocker.py`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[1]
# The test files the GPU check's tests step runs, read from the script itself.
GPU_TEST_FILES = sorted(set(re.findall(r"tests/[\w/]+\.py",
                                       (REPO / "scripts" / "gpu_check.sh").read_text())))
MAKE_LLM = ("from kvpool import LLM, SamplingParams\n"
            "llm = LLM(dtype='float32', kv_cache_memory=32 << 20, enable_warmup=False)\n")


def run_hidden(statement: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "tests.optional_blocker", statement],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_an_offline_generate_needs_none_of_them() -> None:
    result = run_hidden(
        MAKE_LLM +
        "[out] = llm.generate(['Hello'], SamplingParams(temperature=0, max_tokens=4),"
        " use_tqdm=False)\n"
        "assert len(out.outputs[0].token_ids) == 4\n"
        "import sys\n"
        "assert not {'redis', 'xgrammar', 'zmq', 'msgspec', 'pydantic', 'mooncake'}"
        " & set(sys.modules)\n"
        "print('generated')")
    assert result.returncode == 0, result.stderr
    assert "generated" in result.stdout


def test_a_feature_that_needs_one_names_it() -> None:
    result = run_hidden(
        MAKE_LLM +
        "from kvpool.engine.structured_outputs import StructuredOutputsParams\n"
        "params = SamplingParams(max_tokens=4,"
        " structured_outputs=StructuredOutputsParams(choice=['yes', 'no']))\n"
        "try:\n"
        "    llm.generate(['Yes or no?'], params, use_tqdm=False)\n"
        "except ImportError as error:\n"
        "    print(error)\n")
    assert result.returncode == 0, result.stderr
    assert "structured outputs (and tool_choice) needs the package 'xgrammar'" in result.stdout


def test_the_mooncake_transport_names_its_package() -> None:
    result = run_hidden(
        "from kvpool.engine.kv_connector.mooncake_transport import MooncakeTransport\n"
        "try:\n"
        "    MooncakeTransport()\n"
        "except ImportError as error:\n"
        "    print(error)\n")
    assert result.returncode == 0, result.stderr
    assert "the Mooncake KV transport (pip install 'kvpool[mooncake]') needs the package " \
           "'mooncake'" in result.stdout


def test_the_gpu_checks_test_files_collect() -> None:
    result = run_hidden(
        "import sys, pytest\n"
        f"sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', "
        f"*{GPU_TEST_FILES!r}]))")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "error" not in result.stdout.lower()
