"""GPU: `forge serve --device cuda` answers over gRPC and the OpenAI gateway; greedy outputs match
the offline engine on the same GPU; capture time is logged at start-up."""
from __future__ import annotations

import openai
import pytest

from forge_service import LLM, SamplingParams
from tests.integration.serving.servers import running_forge

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def server():
    with running_forge(["--device", "cuda", "--dtype", "bfloat16", "--log-level", "info"]) as s:
        s.wait_ready()
        yield s


def test_server_reports_graph_capture(server):
    assert "captured" in server.log_path.read_text(errors="replace")


def test_greedy_completion_matches_offline(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = server.health().model
    served = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0.0)
    offline = LLM(dtype="bfloat16", device="cuda", max_num_seqs=4).generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0].text
    assert served.choices[0].text == offline


def test_streaming_chat(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = server.health().model
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name three fruits."}],
                                            max_tokens=32, temperature=0.7, seed=7, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text.strip()
