"""Embeddings: a prompt's last hidden state (after the final norm) through the engine, equal to
transformers' in fp32, the same alone and in a batch in bf16; the service's Embed call (a fake
engine and a tiny model); the gateway's /v1/embeddings (a fake service, the openai client)."""
from __future__ import annotations

import base64
import json
import math
import struct
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import torch

from forge_service import LLM, SamplingParams
from forge_service.backends import cpu_kernels
from forge_service.errors import InvalidArgument
from forge_service.pb import forge_pb2 as pb
from tests.tiny_models import tiny_tokenizer_json, variant_arch, write_gguf, write_safetensors_dir
from tests.unit.test_gateway import client, fake, http, stack  # noqa: F401 (fixtures)
from tests.unit.test_model_variants import _weights
from tests.unit.test_server_fake_engine import run

pytestmark = pytest.mark.timeout(120)
PROMPTS = [list(range(3, 40)), list(range(7, 12)), list(range(3, 30))]  # the third shares the first's start


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    arch = variant_arch("qwen3", tie_word_embeddings=True)  # as Qwen3-Embedding
    root = tmp_path_factory.mktemp("qwen3_embed")
    write_safetensors_dir(root, arch, _weights(arch), tokenizer_json=tiny_tokenizer_json())
    return root


def hf_last_hidden(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf.model(torch.tensor([ids])).last_hidden_state[0, -1]


def test_fp32_embeddings_are_transformers_last_hidden_state(qwen3_dir: Path) -> None:
    llm = LLM(model=str(qwen3_dir), dtype="float32", max_num_batched_tokens=16)  # prompts in chunks
    raw = llm.embed(PROMPTS, normalize=False)
    for prompt, got in zip(PROMPTS, raw):
        want = hf_last_hidden(qwen3_dir, prompt)
        assert len(got) == want.numel() == 64
        assert torch.allclose(torch.tensor(got), want, atol=1e-4, rtol=1e-4)
    unit = llm.embed(PROMPTS)
    assert all(abs(math.fsum(v * v for v in u) - 1) < 1e-9 for u in unit)
    assert torch.allclose(torch.tensor(unit[0]), torch.nn.functional.normalize(torch.tensor(raw[0]), dim=0))
    short = llm.embed(PROMPTS[0], dimensions=8)[0]
    assert len(short) == 8 and torch.allclose(torch.tensor(short),
                                              torch.nn.functional.normalize(torch.tensor(raw[0][:8]), dim=0))
    with pytest.raises(InvalidArgument, match=r"dimensions must be in \[1, 64\]"):
        llm.embed("x", dimensions=65)


def embeddings_beside_generation(llm: LLM) -> list[list[float]]:
    """PROMPTS[0] embedded alone, then in a batch beside a generation, then again from the prefix
    cache. Asserts that the generation's tokens are those it gives alone and that the last embedding
    hit the cache; returns the three embeddings."""
    generate = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], generate)[0].outputs[0].token_ids
    embedded = llm.embed(PROMPTS[0], normalize=False)[0]
    from forge_service.embeddings import embed_params

    both = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[0]], [embed_params(), generate, embed_params()])
    assert both[1].outputs[0].token_ids == alone and both[1].outputs[0].embedding is None
    assert both[2].num_cached_tokens > 0  # a prefix-cache hit
    assert [len(o.outputs[0].token_ids) for o in (both[0], both[2])] == [1, 1]
    return [embedded, both[0].outputs[0].embedding, both[2].outputs[0].embedding]


def test_an_embedding_beside_generation_changes_neither(qwen3_dir: Path) -> None:
    llm = LLM(model=str(qwen3_dir), dtype="float32")
    embedded, beside, cached = embeddings_beside_generation(llm)
    assert beside == embedded and cached == embedded
    with pytest.raises(InvalidArgument, match="an embedding takes n 1, max_tokens 1"):
        llm.generate(["x"], SamplingParams(embed=True, max_tokens=4))


@pytest.mark.skipif(cpu_kernels.library() is None, reason="the native CPU kernels cannot run on this machine")
def test_bf16_embedding_is_the_same_alone_and_in_a_batch(tmp_path: Path) -> None:
    arch = variant_arch("qwen2", hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32)
    path = str(write_gguf(tmp_path / "m.gguf", arch, _weights(arch), qtype="Q8_0"))
    llm = LLM(model=path, dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=24)
    assert llm.engine.runner.model.decode_plan is not None  # the native fused step
    alone = [llm.embed(p)[0] for p in PROMPTS]
    assert llm.embed(PROMPTS) == alone
    reference = LLM(model=path, dtype="float32").embed(PROMPTS)
    assert all(sum(a * b for a, b in zip(x, y)) > 0.999 for x, y in zip(alone, reference))  # cosine


# --- the service --------------------------------------------------------------------------------

def embed(*inputs: pb.EmbedInput, **fields) -> pb.EmbedRequest:
    return pb.EmbedRequest(inputs=list(inputs), **fields)


def test_embed_on_a_fake_engine() -> None:
    """The fake embeds a prompt as [its length, its first token, 3, 4]."""
    async def body(h):
        whole = await h.stub.Embed(embed(pb.EmbedInput(text="ab"), pb.EmbedInput(token_ids=pb.TokenIds(ids=[9])),
                                         request_id="e1"))
        raw = await h.stub.Embed(embed(pb.EmbedInput(text="ab"), normalize=False, dimensions=2))
        return whole, raw

    whole, raw = run(body)
    assert whole.request_id == "e1" and whole.model == "fake-model"
    first, second = (list(e.values) for e in whole.embeddings)
    assert first == pytest.approx([v / math.sqrt(2 * 2 + 97 * 97 + 9 + 16) for v in (2, 97, 3, 4)])
    assert second == pytest.approx([v / math.sqrt(1 + 81 + 9 + 16) for v in (1, 9, 3, 4)])
    assert [e.prompt_tokens for e in whole.embeddings] == [2, 1] and whole.usage.prompt_tokens == 3
    assert list(raw.embeddings[0].values) == [2.0, 97.0]


@pytest.mark.parametrize("request_, field, words", [
    (embed(), "inputs", "inputs must hold 1 to 2048"),
    (embed(*[pb.EmbedInput(text="a")] * 2049), "inputs", "inputs must hold 1 to 2048"),
    (embed(pb.EmbedInput(text="a"), pb.EmbedInput(text="")), "inputs[1]", "inputs[1] is empty"),
    (embed(pb.EmbedInput(text="a"), pb.EmbedInput()), "inputs[1]", "set text or token_ids"),
    (embed(pb.EmbedInput(token_ids=pb.TokenIds(ids=[1, 300]))), "inputs[0]", "token id 300, outside the vocabulary"),
    (embed(pb.EmbedInput(text="a"), pb.EmbedInput(token_ids=pb.TokenIds(ids=[5] * 128))), "inputs[1]",
     "128 tokens; the context length is 128"),
    (embed(pb.EmbedInput(text="x" * 200)), "inputs[0]", "the model's context length is 128"),  # before tokenizing
    (embed(pb.EmbedInput(text="a"), dimensions=5), "dimensions", r"dimensions must be in [1, 4]"),
    (embed(pb.EmbedInput(text="a"), model="other"), "model", "is not served here"),
])
def test_bad_embed_requests_name_their_field(request_, field, words) -> None:
    async def body(h):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.stub.Embed(request_)
        error = info.value
        return error.code(), error.details(), dict(error.trailing_metadata() or ()).get("forge-error-field")

    code, details, got_field = run(body)
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    assert words in details and got_field == field


def test_embed_on_a_tiny_model_equals_the_offline_api(qwen3_dir: Path) -> None:
    llm = LLM(model=str(qwen3_dir), dtype="float32")
    want = llm.embed(PROMPTS[:2], dimensions=16)

    async def body(h):
        inputs = [pb.EmbedInput(token_ids=pb.TokenIds(ids=p)) for p in PROMPTS[:2]]
        return await h.stub.Embed(embed(*inputs, dimensions=16))

    got = run(body, factory=lambda: llm.engine)
    for e, w in zip(got.embeddings, want, strict=True):
        assert list(e.values) == pytest.approx(w, abs=1e-6)  # float32 on the wire
    assert got.usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1])


# --- the gateway (a fake service: input i embeds as [i, its length, 0.5]) ------------------------

def test_the_gateway_embeds_texts_and_token_ids(http: httpx.Client, fake) -> None:
    body = http.post("/v1/embeddings", json={"model": "m", "input": ["hello", "hi"], "dimensions": 3}).json()
    assert body["object"] == "list" and body["model"] == "fake-model"
    assert [(d["object"], d["index"], d["embedding"]) for d in body["data"]] == [
        ("embedding", 0, [0.0, 5.0, 0.5]), ("embedding", 1, [1.0, 2.0, 0.5])]
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    sent = fake.requests[-1]
    assert [i.text for i in sent.inputs] == ["hello", "hi"] and sent.dimensions == 3
    assert not sent.HasField("normalize")
    for value, kinds in (("one", ["text"]), ([1, 2, 3], ["token_ids"]), ([[1, 2], [3]], ["token_ids"] * 2)):
        assert http.post("/v1/embeddings", json={"model": "m", "input": value, "normalize": False}).status_code == 200
        assert [i.WhichOneof("input") for i in fake.requests[-1].inputs] == kinds
        assert fake.requests[-1].HasField("normalize") and not fake.requests[-1].normalize
    encoded = http.post("/v1/embeddings", json={"model": "m", "input": "abc", "encoding_format": "base64"}).json()
    assert struct.unpack("<3f", base64.b64decode(encoded["data"][0]["embedding"])) == (0.0, 3.0, 0.5)


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"), ({"input": ""}, "input"), ({"input": ["a", ""]}, "input"), ({"input": [[]]}, "input"),
    ({"input": ["a", 1]}, "input"), ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"), ({"input": [1, "a"]}, "input"), ({"input": True}, "input"),
    ({"input": "a", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ({"input": ["a"] * 2049}, "input"), ({"input": ["ok", "bad"]}, "input[1]"),
])
def test_bad_embedding_requests_are_400_naming_the_parameter(http: httpx.Client, fake, body, param) -> None:
    response = http.post("/v1/embeddings", json={"model": "m", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_openai_client_embeds(client: openai.OpenAI, fake) -> None:
    # the client asks for base64 by default and decodes it
    out = client.embeddings.create(model="fake-model", input=["hello", "hi"])
    assert [d.embedding for d in out.data] == [[0.0, 5.0, 0.5], [1.0, 2.0, 0.5]]
    assert out.usage.prompt_tokens == 7 and fake.requests[-1].inputs[1].text == "hi"


def test_a_decoder_saved_without_its_head_loads_as_tied(tmp_path: Path, qwen3_dir: Path) -> None:
    # Qwen3-Embedding's files: `embed_tokens.weight`, `layers.0....` (no `model.` prefix), no lm_head
    from safetensors.torch import load_file, save_file

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (bare / name).write_bytes((qwen3_dir / name).read_bytes())
    config = json.loads((qwen3_dir / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))  # no head to find
    tensors = load_file(str(qwen3_dir / "model.safetensors"))
    save_file({n.removeprefix("model."): t for n, t in tensors.items() if n != "lm_head.weight"},
              str(bare / "model.safetensors"))
    want = LLM(model=str(qwen3_dir), dtype="float32").embed(PROMPTS)
    llm = LLM(model=str(bare), dtype="float32")
    assert llm.engine.arch.tie_word_embeddings
    assert llm.embed(PROMPTS) == want


def test_a_model_that_declares_another_pooling_is_refused_clearly(tmp_path: Path) -> None:
    import gguf

    from forge_service.errors import Unsupported
    from forge_service.loaders import load_checkpoint

    arch = variant_arch("qwen3")
    weights = _weights(arch)
    for pooling_type, pooling in ((3, "last"), (1, "mean"), (2, "cls")):
        path = write_gguf(tmp_path / f"{pooling_type}.gguf", arch, weights,
                          uint32_keys={"qwen3.pooling_type": pooling_type})
        assert gguf.GGUFReader(path).fields["qwen3.pooling_type"].contents() == pooling_type
        assert load_checkpoint(str(path)).arch.pooling == pooling
    assert len(LLM(model=str(tmp_path / "3.gguf"), dtype="float32").embed("abc")[0]) == 64
    mean = LLM(model=str(tmp_path / "1.gguf"), dtype="float32")
    with pytest.raises(Unsupported, match="declares mean pooling; Forge embeds by the last token only"):
        mean.embed("abc")

    async def body(h):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.stub.Embed(embed(pb.EmbedInput(text="abc"), pb.EmbedInput(text="de")))
        return info.value.code(), info.value.details()

    code, details = run(body, factory=lambda: mean.engine)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "declares mean pooling" in details
    root = write_safetensors_dir(tmp_path / "st", arch, weights, tokenizer_json=tiny_tokenizer_json())
    (root / "1_Pooling").mkdir()
    for modes, pooling in (({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, "last"),
                           ({"pooling_mode_mean_tokens": True}, "mean"), ({"pooling_mode_max_tokens": True}, "max_tokens")):
        (root / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
        assert load_checkpoint(str(root)).arch.pooling == pooling
    assert load_checkpoint(str(write_safetensors_dir(tmp_path / "plain", arch, weights))).arch.pooling is None
    assert load_checkpoint(str(write_gguf(tmp_path / "plain.gguf", arch, weights))).arch.pooling is None

