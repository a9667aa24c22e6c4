"""LoRA adapters: PEFT's own files and forward are the reference. In fp32 an adapted request gives
peft's greedy tokens and logprobs; in bf16 a request's tokens do not depend on the adapters (or none)
of the requests beside it; the prefix cache never shares KV between an adapter and the base model;
what Forge does not serve is refused at load, naming it."""
from __future__ import annotations

import json
from pathlib import Path

import peft  # a dev dependency: the reference, never skipped
import pytest
import torch
from safetensors.torch import load_file, save_file

from forge_service import LLM, SamplingParams
from forge_service.backends import cpu_kernels, torch_ref
from forge_service.config import ModelConfig
from forge_service.errors import InvalidArgument, ModelLoadError
from tests.tiny_models import random_weights, tiny_arch, tiny_tokenizer_json, write_gguf, write_safetensors_dir

PROMPT = list(range(3, 40))
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _weights(arch, seed: int = 3) -> dict[str, torch.Tensor]:
    w = random_weights(arch, seed)
    w["model.embed_tokens.weight"] *= 10  # confident enough that greedy choices are not near ties
    w["lm_head.weight"] *= 10
    return w


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("base")
    arch = tiny_arch()
    write_safetensors_dir(root, arch, _weights(arch), tokenizer_json=tiny_tokenizer_json())
    return root


def _adapter(base: Path, out: Path, seed: int, **config) -> object:
    """A PEFT LoRA of `base` with random A and B (B is zero at PEFT's usual init), saved to `out`;
    returns the peft model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    config = {"r": 4, "lora_alpha": 8, "target_modules": ALL_MODULES, "init_lora_weights": False} | config
    model = peft.get_peft_model(model, peft.LoraConfig(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(4.0)  # an update large enough to change the greedy tokens
    model.save_pretrained(out)
    return model.eval()


def _reference(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    # n tokens, EOS among them where it is the argmax, as Forge's ignore_eos gives (min_new_tokens
    # would keep EOS from being chosen instead)
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(out.logits, tokens)]


def _ours(llm: LLM, ids: list[int], n: int, adapter: str | None) -> tuple[list[int], list[float]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0, adapter=adapter)
    out = llm.generate([ids], params)[0].outputs[0]
    return out.token_ids, [pos[0].logprob for pos in out.logprobs]


@pytest.mark.parametrize("config", [
    {},
    {"use_rslora": True, "r": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    {"alpha_pattern": {"o_proj": 32}, "target_modules": ["o_proj", "up_proj", "k_proj"]},
], ids=["all-modules", "rslora-some", "alpha-pattern"])
def test_fp32_adapter_equals_peft(tmp_path: Path, base_dir: Path, config: dict) -> None:
    model = _adapter(base_dir, tmp_path / "a", 0, **config)
    want_tokens, want_logprobs = _reference(model, PROMPT, 10)
    llm = LLM(model=str(base_dir), dtype="float32", lora_modules=f"tuned={tmp_path / 'a'}",
              max_num_batched_tokens=16)  # prefill in chunks
    tokens, logprobs = _ours(llm, PROMPT, 10, "tuned")
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-4
    with model.disable_adapter():  # the base model's answer is another one, and Forge's base requests give it
        base_tokens, base_logprobs = _reference(model, PROMPT, 10)
    assert max(abs(a - b) for a, b in zip(base_logprobs, want_logprobs)) > 1e-2
    tokens, logprobs = _ours(llm, PROMPT, 10, None)
    assert tokens == base_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, base_logprobs)) < 1e-4


@pytest.fixture(scope="module")
def coded(tmp_path_factory) -> tuple[str, str]:
    """A Q8_0 GGUF whose bf16 steps run the native kernels (the fused step when no row is adapted:
    head_dim 32), and two adapters of it (made by PEFT from the same weights' SafeTensors):
    (model path, --lora-modules)."""
    return coded_model(tmp_path_factory.mktemp("coded"),
                       tiny_arch(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2))


def coded_model(root: Path, arch) -> tuple[str, str]:
    """`arch` as a Q8_0 GGUF and two PEFT adapters of it, under `root`: (model path, --lora-modules)."""
    weights = _weights(arch)
    write_safetensors_dir(root / "hf", arch, weights, tokenizer_json=tiny_tokenizer_json())
    _adapter(root / "hf", root / "a", 1)
    _adapter(root / "hf", root / "b", 2, r=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    return str(write_gguf(root / "m.gguf", arch, weights, qtype="Q8_0")), f"a={root / 'a'},b={root / 'b'}"


@pytest.mark.skipif(cpu_kernels.library() is None, reason="needs the native CPU kernels")
def test_bf16_tokens_do_not_depend_on_the_adapters_beside_them(coded: tuple[str, str]) -> None:
    path, adapters_spec = coded
    llm = LLM(model=path, dtype="bfloat16", lora_modules=adapters_spec, enable_prefix_caching=False,
              max_num_batched_tokens=24)  # prefill chunks beside decodes
    assert llm.engine.model.decode_plan is not None  # what a step without adapted rows runs
    prompts = [PROMPT, PROMPT[5:], PROMPT[:20], PROMPT]
    adapters = [None, "a", "b", "a"]

    def params(adapter):
        return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, adapter=adapter)

    def answers(outputs) -> list:
        return [(o.token_ids, [p[0].logprob for p in o.logprobs]) for o in outputs]

    alone = [llm.generate([p], params(a))[0].outputs[0] for p, a in zip(prompts, adapters)]
    together = answers(o.outputs[0] for o in llm.generate(prompts, [params(a) for a in adapters]))
    assert answers(alone) == together
    plan, llm.engine.model.decode_plan = llm.engine.model.decode_plan, None  # kernel by kernel: the same bits
    assert answers(o.outputs[0] for o in llm.generate(prompts, [params(a) for a in adapters])) == together
    llm.engine.model.decode_plan = plan
    # the adapters answer otherwise than the base model and than each other
    assert len({tuple(alone[0].token_ids), tuple(alone[3].token_ids)}) == 2
    b_alone = llm.generate([PROMPT], params("b"))[0].outputs[0].token_ids
    assert len({tuple(alone[0].token_ids), tuple(alone[3].token_ids), tuple(b_alone)}) == 3


def test_the_prefix_cache_keeps_adapters_and_the_base_model_apart(coded: tuple[str, str]) -> None:
    path, adapters_spec = coded

    def run(llm: LLM, adapter: str | None):
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, adapter=adapter))
        return out[0].outputs[0].token_ids, out[0].num_cached_tokens

    fresh = {a: run(LLM(model=path, dtype="bfloat16", lora_modules=adapters_spec, block_size=4), a)[0]
             for a in (None, "a", "b")}
    llm = LLM(model=path, dtype="bfloat16", lora_modules=adapters_spec, block_size=4)
    assert run(llm, None) == (fresh[None], 0)
    assert run(llm, "a") == (fresh["a"], 0)  # the base model's blocks are not the adapter's
    assert run(llm, "b") == (fresh["b"], 0)
    tokens, cached = run(llm, "a")  # its own blocks are
    assert tokens == fresh["a"] and cached > 0


def test_an_unknown_adapter_is_an_invalid_argument(coded: tuple[str, str]) -> None:
    llm = LLM(model=coded[0], dtype="float32", lora_modules=coded[1])
    with pytest.raises(InvalidArgument, match="'c' is not loaded here") as info:
        llm.generate([PROMPT], SamplingParams(max_tokens=2, adapter="c"))
    assert info.value.field == "adapter"
    assert llm.engine.kv.num_used_blocks == 0


def _edit_adapter(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    dst.mkdir()
    data = json.loads((src / "adapter_config.json").read_text()) | (config or {})
    (dst / "adapter_config.json").write_text(json.dumps(data))
    weights = load_file(src / "adapter_model.safetensors")
    save_file(tensors(weights) if tensors else weights, dst / "adapter_model.safetensors")
    return dst


@pytest.mark.parametrize("change, message", [
    ({"config": {"use_dora": True}}, "DoRA"),
    ({"config": {"bias": "lora_only"}}, "bias 'lora_only'"),
    ({"config": {"modules_to_save": ["lm_head"]}}, "modules_to_save"),
    ({"config": {"peft_type": "IA3"}}, "peft_type 'IA3'"),
    ({"config": {"alpha_pattern": {"q_proj": "big"}}}, "layer 0 q_proj has lora_alpha 'big' \\(alpha_pattern\\)"),
    ({"tensors": lambda w: w | {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}},
     "lm_head.lora_A.weight is not a LoRA update"),
    ({"tensors": lambda w: {k: v for k, v in w.items() if "layers.1.mlp.up_proj.lora_B" not in k}},
     "layer 1 up_proj has lora_A without its other half"),
    ({"tensors": lambda w: {k: v[:, :32].contiguous() if "layers.0.self_attn.q_proj.lora_A" in k else v
                            for k, v in w.items()}},
     r"layer 0 q_proj has A \(4, 32\).*an adapter of another base model"),
    ({"tensors": lambda w: {k.replace("layers.1.", "layers.7."): v for k, v in w.items()}},
     "names layer 7; the model has 2"),
    ({"tensors": lambda w: {k.replace("q_proj", "query_key_value"): v for k, v in w.items()}},
     "adapts query_key_value, which this llama model does not have"),
])
def test_what_forge_does_not_serve_is_refused_at_load(tmp_path: Path, base_dir: Path, change: dict,
                                                       message: str) -> None:
    _adapter(base_dir, tmp_path / "good", 0)
    bad = _edit_adapter(tmp_path / "good", tmp_path / "bad", change.get("config"), change.get("tensors"))
    with pytest.raises(ModelLoadError, match=message):
        LLM(model=str(base_dir), dtype="float32", lora_modules=f"x={bad}")


def test_rank_limit_and_missing_files_are_refused(tmp_path: Path, base_dir: Path) -> None:
    _adapter(base_dir, tmp_path / "a", 0, r=8)
    with pytest.raises(ModelLoadError, match="rank 8, above --max-lora-rank 4"):
        LLM(model=str(base_dir), dtype="float32", lora_modules=f"x={tmp_path / 'a'}", max_lora_rank=4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no adapter_config.json"):
        LLM(model=str(base_dir), dtype="float32", lora_modules=f"x={tmp_path / 'empty'}")
    (tmp_path / "a" / "adapter_model.safetensors").rename(tmp_path / "a" / "adapter_model.bin")
    with pytest.raises(ModelLoadError, match="a pickle Forge does not load"):
        LLM(model=str(base_dir), dtype="float32", lora_modules=f"x={tmp_path / 'a'}")


@pytest.mark.parametrize("spec, message", [
    ("a", "'a' is not NAME=PATH"),
    ("a=", "'a=' is not NAME=PATH"),
    ("a=/x,a=/y", "'a' is given twice"),
    ("-a=/x", "adapter name '-a' must be"),
])
def test_a_malformed_module_list_is_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(lora_modules=spec)
    with pytest.raises(ValueError, match="max_lora_rank must be at most 256, got 257"):
        ModelConfig(max_lora_rank=257)  # the native kernel's bound
    assert ModelConfig(lora_modules=" a=/x , b.v2=/y ").lora_paths() == {"a": "/x", "b.v2": "/y"}


@pytest.mark.skipif(cpu_kernels.library() is None, reason="needs the native CPU kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lora_kernel_matches_torch_and_each_row_stands_alone(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 96, generator=g).to(dtype)
    a = torch.randn(5, 96, generator=g) * 0.1
    bt = torch.randn(5, 48, generator=g) * 0.1
    y = torch.randn(13, 80, generator=g).to(dtype)
    rows = torch.tensor([0, 2, 3, 5, 8, 9, 12])  # two blocks of rows, one per thread
    want = y.clone()
    torch_ref.lora_add(want[:, 16:64], x, rows, a, bt)
    got = y.clone()
    cpu_kernels.lora_add_(got[:, 16:64], x, rows, a, bt)  # a slice of the output, rows 80 apart
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
    assert torch.equal(got[[1, 4, 6, 7, 10, 11]], y[[1, 4, 6, 7, 10, 11]])  # rows not listed are left alone
    assert not torch.equal(got[rows], y[rows])
    for row in rows.tolist():  # a row's result is the same listed alone (or with others in its block)
        alone = y.clone()
        cpu_kernels.lora_add_(alone[:, 16:64], x, torch.tensor([row]), a, bt)
        assert torch.equal(alone[row], got[row])


@pytest.mark.timeout(120)
def test_the_gateway_and_grpc_serve_adapters_by_model_name(coded: tuple[str, str]) -> None:
    import asyncio
    import os
    import signal

    import grpc
    import openai

    from forge_service.config import ServiceConfig
    from forge_service.pb import forge_pb2 as pb
    from forge_service.serve import run_all_async
    from forge_service.server import ForgeService
    from tests.ports import free_port
    from tests.unit.fakes import wait_ready
    from tests.unit.test_server_fake_engine import code_of, run

    llm = LLM(model=coded[0], dtype="bfloat16", lora_modules=coded[1])
    base = llm.engine.model_name
    text = "the quick brown fox jumps over"
    want = {a: llm.generate([text], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, adapter=a))[0]
            .outputs[0].text for a in (None, "a", "b")}
    assert len(set(want.values())) == 3

    async def grpc_body(h):
        listed = await h.stub.ListModels(pb.ListModelsRequest())
        request = pb.GenerateRequest(text=text, model="b", sampling=pb.SamplingParameters(temperature=0),
                                     stopping=pb.StoppingParameters(max_tokens=8, ignore_eos=True))
        response = await h.stub.Generate(request)
        request.model = "c"
        return listed, response, await code_of(h.stub.Generate(request))

    listed, response, (code, details) = run(grpc_body, factory=lambda: llm.engine)
    assert [(m.id, m.parent) for m in listed.models] == [(base, ""), ("a", base), ("b", base)]
    assert (response.model, response.choices[0].text) == ("b", want["b"])
    assert code == grpc.StatusCode.NOT_FOUND and f"serves {base!r}, 'a', 'b'" in details

    config = ServiceConfig(host="127.0.0.1", grpc_port=0, http_port=free_port(), drain_timeout_s=10)
    url = f"http://127.0.0.1:{config.http_port}"

    def use_it() -> dict:
        wait_ready(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        cards = {m.id: m.model_extra.get("parent") for m in client.models.list()}
        got = {}
        for name in (base, "a", "b"):
            completion = client.completions.create(model=name, prompt=text, max_tokens=8, temperature=0,
                                                   extra_body={"ignore_eos": True})
            got[name] = (completion.model, completion.choices[0].text)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="c", prompt=text, max_tokens=2)
        os.kill(os.getpid(), signal.SIGTERM)
        return {"cards": cards, "got": got}

    async def main() -> dict:
        service = ForgeService(config, lambda: llm.engine)
        running = asyncio.create_task(run_all_async(service, config))
        result = await asyncio.to_thread(use_it)
        await asyncio.wait_for(running, 20)
        return result

    result = asyncio.run(main())
    assert result["cards"] == {base: None, "a": base, "b": base}
    assert result["got"] == {base: (base, want[None]), "a": ("a", want["a"]), "b": ("b", want["b"])}


@pytest.mark.skipif(cpu_kernels.library() is None, reason="needs the native CPU kernels")
def test_adapted_greedy_tokens_survive_preemption_and_speculation(coded: tuple[str, str]) -> None:
    path, adapters_spec = coded
    looping = [[5, 6, 7, 8, 9] * 7, list(range(3, 40)), [11, 12, 13] * 10, list(range(50, 90))]
    prompts = looping + looping[:2]  # repeats, each on the other adapter (no hit on the first's blocks)
    adapters = ["a", "b", None, "a", "b", "a"]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, adapter=a) for a in adapters]
    roomy = LLM(model=path, dtype="bfloat16", lora_modules=adapters_spec, enable_prefix_caching=False)
    want = [roomy.generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]  # each alone
    # 14 blocks of 8 tokens cannot hold six prompts of up to 40 tokens plus 40 outputs at once
    tight = LLM(model=path, dtype="bfloat16", lora_modules=adapters_spec, num_blocks=14, block_size=8,
                max_num_batched_tokens=32, speculative="ngram", spec_step_base_rows=1e9)
    got = tight.generate(prompts, params)
    assert [g.outputs[0].token_ids for g in got] == want
    assert tight.engine.num_preemptions > 0
    assert sum(g.outputs[0].num_accepted_tokens for g in got) > 0
    assert tight.engine.kv.num_used_blocks == 0


def write_gguf_adapter(peft_dir: Path, out: Path, arch, qtype: str = "F32", alpha: float | None = None,
                       general_type: str = "adapter", architecture: str = "llama", permute: bool = True,
                       invocation: list[int] | None = None) -> Path:
    """A PEFT adapter as llama.cpp's convert_lora_to_gguf writes it: blk.N.<tensor>.weight.lora_a / .lora_b,
    B's Q/K rows permuted as a Llama GGUF's weights are."""
    import gguf

    from tests.tiny_models import _add_tensor, gguf_tensor_name, permute_qk

    config = json.loads((peft_dir / "adapter_config.json").read_text())
    w = gguf.GGUFWriter(str(out), architecture)
    w.add_type(general_type)
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(config["lora_alpha"] if alpha is None else alpha))
    if invocation:
        w.add_array("adapter.alora.invocation_tokens", invocation)
    for key, value in load_file(peft_dir / "adapter_model.safetensors").items():
        hf = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight").replace(".lora_B.weight",
                                                                                                 ".weight")
        data = value.float().numpy()
        if permute and ".lora_B." in key and hf.endswith(("q_proj.weight", "k_proj.weight")):
            data = permute_qk(data, arch.num_heads if "q_proj" in hf else arch.num_kv_heads)
        _add_tensor(w, gguf_tensor_name(hf) + (".lora_a" if ".lora_A." in key else ".lora_b"), data, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_a_llama_cpp_gguf_adapter_serves_as_its_peft_directory(coded: tuple[str, str], tmp_path: Path) -> None:
    path, spec = coded
    arch = tiny_arch(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
    peft_dir = Path(spec.split(",")[1].split("=", 1)[1])  # adapter b: q, v, gate, down at rank 8
    exact = write_gguf_adapter(peft_dir, tmp_path / "b.gguf", arch)
    halves = write_gguf_adapter(peft_dir, tmp_path / "b16.gguf", arch, qtype="F16")
    unpermuted = write_gguf_adapter(peft_dir, tmp_path / "flat.gguf", arch, permute=False)
    llm = LLM(model=path, dtype="bfloat16", lora_modules=f"dir={peft_dir},gguf={exact},f16={halves},flat={unpermuted}")
    params = {a: SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0, adapter=a)
              for a in ("dir", "gguf", "f16", "flat")}
    out = {a: llm.generate([PROMPT], p)[0].outputs[0] for a, p in params.items()}
    assert out["gguf"].token_ids == out["dir"].token_ids  # fp32 tensors: the same updates, bit for bit
    assert [p[0].logprob for p in out["gguf"].logprobs] == [p[0].logprob for p in out["dir"].logprobs]
    assert out["f16"].token_ids[:8] == out["dir"].token_ids[:8]  # fp16-rounded A and B
    # B's Q/K rows read as stored (not un-permuted) would put the updates on the wrong rotary halves
    assert out["flat"].token_ids != out["dir"].token_ids
    other = write_gguf_adapter(peft_dir, tmp_path / "qwen.gguf", arch, architecture="qwen2")
    with pytest.raises(ModelLoadError, match="an adapter of a 'qwen2' model, and this one is a 'llama' model"):
        LLM(model=path, dtype="bfloat16", lora_modules=f"x={other}")


@pytest.mark.parametrize("change, message", [
    ({"general_type": "model"}, "general.type 'model' and adapter.type 'lora', not a LoRA adapter"),
    ({"invocation": [5, 6]}, "an activated LoRA"),
    ({"alpha": 0.0}, None),  # llama.cpp's: no alpha, scale 1
])
def test_gguf_adapter_metadata(coded: tuple[str, str], tmp_path: Path, change: dict, message: str | None) -> None:
    path, spec = coded
    arch = tiny_arch(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
    peft_dir = Path(spec.split(",")[0].split("=", 1)[1])
    adapter = write_gguf_adapter(peft_dir, tmp_path / "a.gguf", arch, **change)
    if message:
        with pytest.raises(ModelLoadError, match=message):
            LLM(model=path, dtype="float32", lora_modules=f"x={adapter}")
        return
    from forge_service import lora

    loaded = lora.load_adapter("x", adapter, arch, 64)
    reference = lora.load_adapter("y", peft_dir, arch, 64)  # alpha 8 over rank 4: scale 2
    for got, want in zip(loaded.layers[1]["qkv"], reference.layers[1]["qkv"]):
        torch.testing.assert_close(got.bt * 2, want.bt)
