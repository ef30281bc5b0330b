"""What a serving process sets before it takes requests (``backends.registry.prepare_serving_process``): prompts
are encoded on the thread that asks, without the tokenizers' thread pool, whose threads spin after every call (on
two cores, about 2.4 µs of a front end's CPU per streamed token, docs/bench.md "Garbage, spinning threads and one
write less"); an operator's own ``TOKENIZERS_PARALLELISM`` wins. Each case runs in a fresh interpreter, whose
threads are its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

ENCODE_AND_COUNT_THREADS = """
import json, os
from backends.registry import prepare_serving_process
prepare_serving_process()
from backends.deepseek.conversation import to_conversation
from backends.deepseek.prompt_encoding import PromptEncoder
from backends.reference import load_or_build
tokenizer = load_or_build().tokenizer
encoder = PromptEncoder(tokenizer)
before = len(os.listdir("/proc/self/task"))
for n in range(50):
    text = f"Describe module number {n}. " * 40
    encoder.encode(to_conversation([{"role": "user", "content": text}], thinking=True, effort=None))  # a chat
    tokenizer.encode_batch_fast([text], add_special_tokens=False)  # a completion's prompt (PromptPreparer)
threads = [before, len(os.listdir("/proc/self/task"))]
print(json.dumps({"threads": threads, "setting": os.environ.get("TOKENIZERS_PARALLELISM")}))
"""


def encode_in_fresh_process(**environ: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"} | environ | {"PYTHONPATH": str(SRC)}
    run = subprocess.run(
        [sys.executable, "-c", ENCODE_AND_COUNT_THREADS], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    result: dict[str, object] = json.loads(run.stdout.splitlines()[-1])
    return result


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in /proc")
def test_a_serving_process_encodes_prompts_without_a_thread_pool() -> None:
    result = encode_in_fresh_process()
    before, after = result["threads"]  # type: ignore[misc]
    assert after == before
    assert result["setting"] == "false"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in /proc")
def test_an_operators_tokenizers_parallelism_wins() -> None:
    result = encode_in_fresh_process(TOKENIZERS_PARALLELISM="true")
    assert result["setting"] == "true"
    before, after = result["threads"]  # type: ignore[misc]
    assert after > before  # the control: the pool is there when asked for, so the first test can fail
