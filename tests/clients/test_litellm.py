"""litellm as a client: ``text_completion(echo=True, logprobs=1)`` scores the prompt through the gateway.

litellm runs in a subprocess so its import-time settings (the bundled model cost map instead of a download) and a
dead proxy for every non-loopback connection apply to it alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ..conftest import MODEL, RunningGateway

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import litellm

    response = litellm.text_completion(
        model="text-completion-openai/" + sys.argv[2],
        api_base=sys.argv[1] + "/v1",
        api_key="unused",
        prompt="The module defines",
        echo=True,
        logprobs=1,
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    print(response.model_dump_json())
    """
)


@pytest.mark.timeout(300)  # importing litellm alone takes several seconds of CPU
def test_text_completion_with_echo_and_logprobs(gateway: RunningGateway) -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
    env.update(
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        HTTP_PROXY="http://127.0.0.1:9",
        HTTPS_PROXY="http://127.0.0.1:9",
        NO_PROXY="127.0.0.1,localhost",
    )
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, gateway.base_url, MODEL],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    response = json.loads(done.stdout.strip().splitlines()[-1])
    choice, usage = response["choices"][0], response["usage"]
    assert choice["text"].startswith("The module defines")
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"] == 7
    assert logprobs["token_logprobs"][0] is None
    assert all(isinstance(lp, float) for lp in logprobs["token_logprobs"][1:])
    assert logprobs["tokens"][1:4] == ["The", " module", " defines"]
