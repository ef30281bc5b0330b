"""lm-eval's ``local-completions`` model evaluates through the gateway, offline, with the remote tokenizer.

lm-eval runs as a user runs it (its CLI, in a subprocess) on three small tasks committed next to this file: a
multiple-choice task (loglikelihood requests: ``echo`` + ``logprobs`` over token ids), a ``loglikelihood_rolling``
(perplexity) task and a ``generate_until`` task. Hub access is switched off and every non-loopback connection
goes to a dead proxy, so the run passes only if lm-eval takes its tokenizer from ``/tokenizer_info`` +
``/tokenize`` (``tokenizer_backend=auto``). Its per-sample results are checked against the same questions asked of
the gateway with the openai SDK.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ..conftest import MODEL, RunningGateway

TASKS = Path(__file__).parent / "lm_eval_tasks"
pytestmark = pytest.mark.timeout(400)  # lm-eval's imports and dataset preparation take tens of seconds on 2 cores
DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens, so any outside request fails at once


def _offline_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(home / "hf"),
        HF_DATASETS_CACHE=str(home / "hf" / "datasets"),
        HTTP_PROXY=DEAD_PROXY,
        HTTPS_PROXY=DEAD_PROXY,
        NO_PROXY="127.0.0.1,localhost",
        OPENAI_API_KEY="unused",
    )
    return env


def _samples(output: Path, task: str) -> list[dict[str, Any]]:
    (path,) = output.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _results(output: Path) -> dict[str, Any]:
    (path,) = output.rglob("results_*.json")
    return json.loads(path.read_text())["results"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def lm_eval_run(gateway: RunningGateway, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("lm_eval")
    model_args = f"model={MODEL},base_url={gateway.base_url}/v1/completions,tokenizer_backend=auto,max_retries=1"
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        "gateway_choice,gateway_rolling,gateway_generate",
        "--include_path",
        str(TASKS),
        "--output_path",
        str(output),
        "--log_samples",
    ]
    done = subprocess.run(
        command, cwd=TASKS, env=_offline_env(output), capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return output


def _continuation_logprob(client: openai.OpenAI, http: httpx.Client, context: str, continuation: str) -> float:
    """What lm-eval computes for one choice: the continuation's summed logprob, from the gateway directly."""
    context_ids = http.post("/tokenize", json={"prompt": context, "add_special_tokens": False}).json()["tokens"]
    whole = http.post("/tokenize", json={"prompt": context + continuation, "add_special_tokens": False}).json()
    scored = client.completions.create(model=MODEL, prompt=whole["tokens"], max_tokens=0, echo=True, logprobs=1)
    assert scored.choices[0].logprobs is not None
    values = scored.choices[0].logprobs.token_logprobs[len(context_ids) :]
    return float(sum(v for v in values if v is not None))


def test_multiple_choice_scores_match_the_gateways_prompt_logprobs(
    lm_eval_run: Path, client: openai.OpenAI, http: httpx.Client
) -> None:
    samples = _samples(lm_eval_run, "gateway_choice")
    docs = [json.loads(line) for line in (TASKS / "gateway_choice.jsonl").read_text().splitlines()]
    assert len(samples) == len(docs)
    correct = 0
    for sample in samples:
        doc = sample["doc"]
        scores = [float(resp[0][0]) for resp in sample["resps"]]
        expected = [_continuation_logprob(client, http, doc["context"], choice) for choice in doc["choices"]]
        assert scores == pytest.approx(expected, abs=1e-6)
        correct += int(max(range(len(scores)), key=scores.__getitem__) == doc["answer"])
    assert _results(lm_eval_run)["gateway_choice"]["acc,none"] == pytest.approx(correct / len(docs))


def test_generate_until_outputs_are_the_gateways_greedy_completions(
    lm_eval_run: Path, client: openai.OpenAI, http: httpx.Client
) -> None:
    samples = _samples(lm_eval_run, "gateway_generate")
    assert len(samples) == 3
    info = http.get("/tokenizer_info").json()
    for sample in samples:
        prompt_ids = http.post("/tokenize", json={"prompt": sample["doc"]["prompt"], "add_special_tokens": False})
        completion = client.completions.create(
            model=MODEL,
            prompt=prompt_ids.json()["tokens"],
            max_tokens=12,
            temperature=0,
            stop=["\n\n", info["eos_token"]],
            seed=1234,
        )
        assert sample["resps"][0][0] == completion.choices[0].text
    assert "exact_match,none" in _results(lm_eval_run)["gateway_generate"]


def test_rolling_loglikelihood_is_the_documents_summed_prompt_logprobs_and_its_perplexity_is_finite(
    lm_eval_run: Path, client: openai.OpenAI, http: httpx.Client
) -> None:
    """Word perplexity (``loglikelihood_rolling``): each document is one window here (it is shorter than the
    context), scored after lm-eval's prefix token, the EOS; every token needs a finite logprob for the sum."""
    samples = _samples(lm_eval_run, "gateway_rolling")
    docs = [json.loads(line) for line in (TASKS / "gateway_rolling.jsonl").read_text().splitlines()]
    assert len(samples) == len(docs)
    eos = http.get("/tokenizer_info").json()["eos_token"]
    eos_id = http.post("/tokenize", json={"prompt": eos, "add_special_tokens": False}).json()["tokens"]
    for sample in samples:
        text = sample["doc"]["text"]
        ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        scored = client.completions.create(model=MODEL, prompt=eos_id + ids, max_tokens=0, echo=True, logprobs=0)
        assert scored.choices[0].logprobs is not None
        values = scored.choices[0].logprobs.token_logprobs[1:]
        assert all(v is not None and -100.0 < v < 0.0 for v in values), values  # finite, as under a real model
        total = float(sum(values))  # type: ignore[arg-type]
        ((logged,),) = sample["resps"]  # one window: lm-eval's sum is that window's loglikelihood
        assert float(logged) == pytest.approx(total, abs=1e-6)
    results = _results(lm_eval_run)["gateway_rolling"]
    assert 1.0 < results["word_perplexity,none"] < float("inf")
    assert results["bits_per_byte,none"] > 0.0
