"""Embeddings on the real model through `forge serve`: the openai client's /v1/embeddings (base64,
its default) and the gRPC Embed call equal the offline API's, and leave no KV block behind."""
from __future__ import annotations

import math

import openai

from forge_service.pb import forge_pb2 as pb
from tests.integration.serving.servers import ForgeProcess

TEXTS = ["The capital of France is Paris.", "Rivers run to the sea.", "The capital of France is Paris."]


def test_embeddings_equal_the_offline_api(idle_server: ForgeProcess, openai_client: openai.OpenAI, llm_fp32) -> None:
    want = llm_fp32.embed(TEXTS)
    got = openai_client.embeddings.create(model=idle_server.health().model, input=TEXTS)
    assert [d.index for d in got.data] == [0, 1, 2]
    assert got.usage.prompt_tokens == sum(len(llm_fp32.tokenizer.encode(t)) for t in TEXTS)
    for d, w in zip(got.data, want, strict=True):
        assert len(d.embedding) == 576  # the model's hidden size
        assert max(abs(a - b) for a, b in zip(d.embedding, w)) < 1e-6  # float32 on the wire
    assert got.data[0].embedding == got.data[2].embedding != got.data[1].embedding
    assert abs(math.fsum(v * v for v in got.data[1].embedding) - 1) < 1e-5
    short = idle_server.stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text=TEXTS[1])], dimensions=64,
                                                   normalize=False), timeout=60)
    raw = llm_fp32.embed(TEXTS[1], dimensions=64, normalize=False)[0]
    assert max(abs(a - b) for a, b in zip(short.embeddings[0].values, raw)) < 1e-4 * max(map(abs, raw))
