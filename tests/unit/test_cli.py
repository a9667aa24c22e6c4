"""`forge generate` end to end on a tiny model."""
from __future__ import annotations

import json
import subprocess
import sys

from forge_service import LLM, SamplingParams
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


def test_generate_reports_bad_input(tmp_path):
    cmd = [sys.executable, "-m", "forge_service.cli", "generate", "--model", str(tmp_path / "missing.gguf"),
           "--prompt", "x"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 2
    assert res.stderr.startswith("error: cannot load") and "missing.gguf" in res.stderr
    assert "Traceback" not in res.stderr
