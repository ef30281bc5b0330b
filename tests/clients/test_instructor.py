"""instructor against the gateway: nested Pydantic response models in its TOOLS and JSON_SCHEMA modes.

instructor runs in a subprocess from its own cached virtualenv (``client_venv``: its pins conflict with the dev
environment's openai SDK), with a dead proxy for every non-loopback connection. It loads the same models as the
parent (``structured_models``: ``$ref``/``$defs``, an enum, a list field, ``anyOf``, bounds) and asks once per mode and
model with ``max_retries=1``, i.e. a single attempt: a reply that fails validation is an error (reported per call),
never a retry. The parent validates what instructor parsed and the raw arguments it parsed them from.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from ..conftest import MODEL, RunningGateway
from .client_venv import client_python
from .structured_models import BookTrip, Forecast, check_forecast, check_trip

REQUIREMENTS = ("instructor>=1.17,<2",)
CHECK = "import instructor, openai; print(instructor.__version__, openai.__version__)"
HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(600)  # the first run on a machine builds instructor's virtualenv

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import instructor, openai
    sys.path.insert(0, sys.argv[3])
    import structured_models

    PROMPTS = {"Forecast": "What is the weather going to be like in Paris this week?",
               "BookTrip": "Book a trip to Kyoto for me and my sister, window seats please."}
    base = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0, timeout=120)
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(base, mode=mode)
        for name, prompt in PROMPTS.items():
            reply = {"mode": mode.value, "model": name}
            try:
                parsed, completion = client.chat.completions.create_with_completion(
                    model=sys.argv[2],
                    response_model=getattr(structured_models, name),
                    messages=[{"role": "user", "content": prompt}],
                    temperature=0,
                    seed=7,
                    max_tokens=400,
                    max_retries=1,
                )
            except Exception as exc:  # reported per call, so one failure does not hide the others
                print(json.dumps({**reply, "error": f"{type(exc).__name__}: {exc}"[:2000]}))
                continue
            message = completion.choices[0].message
            raw = message.tool_calls[0].function.arguments if message.tool_calls else message.content
            print(json.dumps({**reply, "parsed": parsed.model_dump(mode="json"), "raw": raw,
                              "tool_calls": len(message.tool_calls or []),
                              "finish_reason": completion.choices[0].finish_reason}))
    """
)


@pytest.fixture(scope="module")
def replies(gateway: RunningGateway) -> list[dict[str, Any]]:
    python = client_python("instructor", REQUIREMENTS, CHECK)
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
    env.update(HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9", NO_PROXY="127.0.0.1,localhost")
    done = subprocess.run(
        [str(python), "-c", SCRIPT, gateway.base_url, MODEL, str(HERE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


MODELS: dict[str, type[BaseModel]] = {"Forecast": Forecast, "BookTrip": BookTrip}


@pytest.mark.parametrize("mode", ["tool_call", "json_schema_mode"])
@pytest.mark.parametrize("name", ["Forecast", "BookTrip"])
def test_nested_response_model(replies: list[dict[str, Any]], mode: str, name: str) -> None:
    (reply,) = [r for r in replies if r["mode"] == mode and r["model"] == name]
    assert "error" not in reply, reply["error"]
    model = MODELS[name]
    parsed = model.model_validate(reply["parsed"])
    assert model.model_validate_json(reply["raw"]) == parsed  # instructor parsed exactly what the gateway sent
    if mode == "tool_call":
        assert reply["tool_calls"] == 1 and reply["finish_reason"] == "tool_calls"
    else:
        assert reply["tool_calls"] == 0 and reply["finish_reason"] == "stop"
    if isinstance(parsed, Forecast):
        check_forecast(parsed)
    else:
        assert isinstance(parsed, BookTrip)
        check_trip(parsed)
