"""`forge generate` end to end on a tiny model, and `forge serve` and the gateway failing to start."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from forge_service import LLM, SamplingParams
from tests.ports import free_port
from tests.tiny_models import CHATML_TEMPLATE, random_weights, tiny_arch, tiny_tokenizer_json, write_safetensors_dir


def test_generate_prints_the_offline_result(tmp_path):
    arch = tiny_arch()
    write_safetensors_dir(tmp_path, arch, random_weights(arch), tokenizer_json=tiny_tokenizer_json(),
                          chat_template=CHATML_TEMPLATE)
    cmd = [sys.executable, "-m", "forge_service.cli", "generate", "--model", str(tmp_path), "--prompt", "hi there",
           "--chat", "--max-tokens", "5", "--dtype", "float32", "--json"]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    ref = LLM(model=str(tmp_path), dtype="float32").chat([{"role": "user", "content": "hi there"}],
                                                          SamplingParams(max_tokens=5, temperature=0))[0]
    assert out["token_ids"] == ref.outputs[0].token_ids
    assert out["finish_reason"] == ref.outputs[0].finish_reason
    assert out["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)


def test_generate_with_a_chat_template_of_its_own(tmp_path):
    arch = tiny_arch()
    write_safetensors_dir(tmp_path, arch, random_weights(arch), tokenizer_json=tiny_tokenizer_json())  # no template
    cmd = [sys.executable, "-m", "forge_service.cli", "generate", "--model", str(tmp_path), "--prompt", "hi there",
           "--chat", "--max-tokens", "2", "--dtype", "float32", "--json"]
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    out = json.loads(subprocess.run([*cmd, "--chat-template", template], check=True, capture_output=True,
                                    text=True).stdout)
    want = LLM(model=str(tmp_path), dtype="float32").tokenizer.encode("[hi there]", add_special_tokens=False)
    assert out["usage"]["prompt_tokens"] == len(want)
    bad = subprocess.run([*cmd, "--chat-template", "{% for %}"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: chat_template: chat template does not compile")
    assert "Traceback" not in bad.stderr


def test_generate_reports_bad_input(tmp_path):
    cmd = [sys.executable, "-m", "forge_service.cli", "generate", "--model", str(tmp_path / "missing.gguf"),
           "--prompt", "x"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 2
    assert res.stderr.startswith("error: cannot load") and "missing.gguf" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("taken, expected", [
    (None, "cannot load {model}: no such file or directory"),
    ("--http-port", "cannot listen for HTTP on 127.0.0.1:{port}: Address already in use"),
    ("--grpc-port", "cannot listen for gRPC on 127.0.0.1:{port}: the address is in use"),
    ("--metrics-port", "cannot serve metrics on 127.0.0.1:{port}: Address already in use"),
])
def test_serve_that_cannot_start_says_why_in_one_line_and_exits_2(tmp_path, taken, expected):
    # A port in use or a missing model is the operator's to fix: one error line, no traceback.
    ports = {flag: free_port() for flag in ("--http-port", "--grpc-port", "--metrics-port")}
    model = tmp_path / ("missing.gguf" if taken is None else "unused.gguf")
    cmd = [sys.executable, "-m", "forge_service.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
           *(str(part) for item in ports.items() for part in item)]
    assert_start_fails(cmd, ports.get(taken), expected.format(model=model, port=ports.get(taken)))


@pytest.mark.parametrize("args, expected", [
    (["--target", "127.0.0.1:1"], "cannot listen for HTTP on 127.0.0.1:{port}: Address already in use"),
    (["--target", "127.0.0.1:1,127.0.0.1"], "'127.0.0.1' in the target list is not HOST:PORT"),
    (["--target", "127.0.0.1:1", "--grpc-ca-file", "/missing-ca.pem"], "cannot read /missing-ca.pem"),
])
def test_gateway_that_cannot_start_says_why_in_one_line_and_exits_2(args, expected):
    port = free_port()
    cmd = [sys.executable, "-m", "forge_gateway", "--host", "127.0.0.1", "--port", str(port), *args]
    # The port is taken in every case: the first fails on it, the others before binding.
    assert_start_fails(cmd, port, expected.format(port=port))


def assert_start_fails(cmd: list[str], taken_port: int | None, reason: str) -> None:
    """`cmd`, run while `taken_port` (if any) has a listener, exits 2 with one `cannot start` line."""
    with socket.socket() as occupant:
        if taken_port is not None:
            occupant.bind(("127.0.0.1", taken_port))
            occupant.listen()
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    output = res.stdout + res.stderr
    assert res.returncode == 2, output
    assert "Traceback" not in output and "was never awaited" not in output, output
    assert "ERROR forge: cannot start: " + reason in output, output


def test_serve_with_a_setting_out_of_range_is_a_usage_error():
    cmd = [sys.executable, "-m", "forge_service.cli", "serve", "--max-num-seqs", "0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip() == "forge serve: error: max_num_seqs must be >= 1, got 0"


def test_serve_renders_chats_with_its_own_chat_template(tmp_path):
    # A model without a template of its own serves chats with the one --chat-template names.
    import httpx

    from forge_service.tokenizer import Tokenizer
    from tests.integration.serving.servers import running_forge

    arch = tiny_arch()
    model = tmp_path / "model"
    write_safetensors_dir(model, arch, random_weights(arch), tokenizer_json=tiny_tokenizer_json())
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}")
    args = ["--model", str(model), "--chat-template", str(template), "--dtype", "float32", "--log-level", "warning"]
    with running_forge(args) as server:
        server.wait_ready()
        name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
        counted = httpx.post(server.url + "/tokenize", json={"model": name, "messages": messages}).json()
        chat = httpx.post(server.url + "/v1/chat/completions",
                          json={"model": name, "messages": messages, "max_tokens": 3, "temperature": 0}, timeout=60)
    want = Tokenizer.from_path(str(model)).encode("<system>be brief\n<user>hi there\n", add_special_tokens=False)
    assert counted["tokens"] == want, counted
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(want)


@pytest.mark.parametrize("value, reason", [
    ("{dir}/missing.jinja", "chat_template: '{dir}/missing.jinja' is neither a file nor a Jinja template"),
    ("{{% if %}}", "chat_template: chat template does not compile: "),
])
def test_serve_with_a_chat_template_that_cannot_serve_says_why(tmp_path, value, reason):
    ports = [str(part) for flag in ("--http-port", "--grpc-port", "--metrics-port") for part in (flag, free_port())]
    cmd = [sys.executable, "-m", "forge_service.cli", "serve", "--host", "127.0.0.1", *ports,
           "--chat-template", value.format(dir=tmp_path)]
    assert_start_fails(cmd, None, reason.format(dir=tmp_path))


def test_serve_gives_requests_the_model_s_sampling_defaults(tmp_path):
    # generation_config.json says temperature 0: a request that sets none is greedy.
    import httpx

    from tests.integration.serving.servers import running_forge

    arch = tiny_arch()
    write_safetensors_dir(tmp_path, arch, random_weights(arch), tokenizer_json=tiny_tokenizer_json(),
                          generation={"temperature": 0.0})
    with running_forge(["--model", str(tmp_path), "--dtype", "float32", "--log-level", "warning"]) as server:
        server.wait_ready()
        name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]

        def tokens(**fields) -> list[str]:
            body = {"model": name, "prompt": "hi there", "max_tokens": 8, "seed": 5, "logprobs": 0,
                    "ignore_eos": True, **fields}
            answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["logprobs"]["tokens"]

        unset, greedy, sampled = tokens(), tokens(temperature=0), tokens(temperature=1.0)
    assert unset == greedy != sampled
