"""Metrics and logs of a real `forge serve`: after a known set of requests the counters equal what
the responses' `usage` blocks report, the gauges are back to 0, and every log line is JSON."""
from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.serving.servers import SERVER_THREADS, ForgeProcess, running_forge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server() -> Iterator[ForgeProcess]:
    with running_forge([*SERVER_THREADS, "--log-format", "json", "--log-level", "info"]) as forge:
        forge.wait_ready()
        yield forge


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a /metrics page, parsed by prometheus_client."""
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name` over the samples whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def sse_usage(text: str) -> tuple[dict[str, int], list[str]]:
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    usage = next(e["usage"] for e in events if e.get("usage"))
    reasons = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    return usage, reasons


def post(server: ForgeProcess, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def test_counters_equal_the_usage_blocks_and_the_gauges_return_to_zero(server: ForgeProcess) -> None:
    model = server.health().model
    metrics_url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    before_service, before_gateway = scrape(metrics_url), scrape(server.url + "/metrics")
    usages: list[dict[str, int]] = []
    reasons: list[str] = []
    chat = {"model": model, "messages": [{"role": "user", "content": "Say hello."}]}
    for body in ({**chat, "max_tokens": 7}, {**chat, "max_tokens": 200, "temperature": 0}):
        answer = post(server, CHAT, body)
        assert answer.status_code == 200, answer.text
        usages.append(answer.json()["usage"])
        reasons += [c["finish_reason"] for c in answer.json()["choices"]]
    streamed = post(server, CHAT, {**chat, "max_tokens": 9, "n": 2, "stream": True,
                                   "stream_options": {"include_usage": True}})
    usage, streamed_reasons = sse_usage(streamed.text)
    usages.append(usage)
    reasons += streamed_reasons
    texts = post(server, COMPLETIONS, {"model": model, "prompt": ["One, two,", "Red, green,"], "max_tokens": 5})
    assert texts.status_code == 200, texts.text
    usages.append(texts.json()["usage"])
    reasons += [c["finish_reason"] for c in texts.json()["choices"]]
    too_long = post(server, CHAT, {**chat, "max_tokens": 100_000})  # INVALID_ARGUMENT from the service
    unknown = post(server, CHAT, {**chat, "model": "no-such-model"})  # NOT_FOUND
    assert (too_long.status_code, unknown.status_code) == (400, 404)
    server.wait_idle()

    service = scrape(metrics_url)
    delta = {key: value - before_service.get(key, 0.0) for key, value in service.items()}
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    completion_tokens = sum(u["completion_tokens"] for u in usages)
    assert total(delta, "forge_prompt_tokens_total", model_name=model) == prompt_tokens
    assert total(delta, "forge_generation_tokens_total", model_name=model) == completion_tokens
    assert len(reasons) == 2 + 2 + 2 == total(delta, "forge_requests_finished_total")
    for reason in ("stop", "length"):
        assert total(delta, "forge_requests_finished_total", finished_reason=reason) == reasons.count(reason)
    assert total(delta, "forge_time_to_first_token_seconds_count") == len(reasons)
    assert total(delta, "forge_inter_token_latency_seconds_count") == completion_tokens - len(reasons)
    assert total(delta, "forge_request_generation_tokens_sum") == completion_tokens
    assert total(service, "forge_num_requests_running", model_name=model) == 0
    assert total(service, "forge_num_requests_waiting", model_name=model) == 0
    assert total(service, "forge_kv_cache_blocks_used") == 0
    assert total(service, "forge_kv_cache_blocks_total") == server.health().kv_blocks_total > 0

    gateway = scrape(server.url + "/metrics")
    gdelta = {key: value - before_gateway.get(key, 0.0) for key, value in gateway.items()}
    requests = "forge_gateway_http_requests_total"
    assert total(gdelta, requests, route=CHAT, status_code="200") == 3
    assert total(gdelta, requests, route=COMPLETIONS, status_code="200") == 1
    assert total(gdelta, requests, route=CHAT, status_code="400") == 1
    assert total(gdelta, requests, route=CHAT, status_code="404") == 1
    assert total(gdelta, "forge_gateway_http_request_duration_seconds_count", route=CHAT) == 5
    assert total(gateway, "forge_gateway_sse_streams_open") == 0
    errors = "forge_gateway_grpc_errors_total"
    assert total(gdelta, errors, code="INVALID_ARGUMENT") == 1 and total(gdelta, errors, code="NOT_FOUND") == 1
    assert total(gdelta, errors) == 2


def test_json_logs_carry_the_request_id_and_log_each_completion_once(server: ForgeProcess) -> None:
    model = server.health().model
    chat = {"model": model, "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 6}
    named = post(server, CHAT, chat, **{"X-Request-Id": "obs-log-1"})
    unnamed = post(server, CHAT, chat)
    bad = post(server, CHAT, chat, **{"X-Request-Id": "has spaces"})  # not a usable id: a new one
    assert named.headers["x-request-id"] == "obs-log-1"
    generated = unnamed.headers["x-request-id"]
    assert len(generated) == 32 and bad.headers["x-request-id"] not in ("has spaces", generated)
    assert named.json()["id"] == "chatcmpl-obs-log-1"
    server.wait_idle()
    lines = [line for line in server.log_tail(1_000_000).splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"timestamp", "level", "logger", "message"} <= set(e) for e in entries)
    for request_id, answer in (("obs-log-1", named), (generated, unnamed)):
        done = [e for e in entries if e["logger"] == "forge.requests" and e.get("request_id") == request_id]
        assert len(done) == 1, done
        usage = answer.json()["usage"]
        line = done[0]
        assert line["level"] == "INFO" and line["status"] == "OK" and line["model"] == model
        assert (line["prompt_tokens"], line["completion_tokens"]) == (usage["prompt_tokens"],
                                                                      usage["completion_tokens"])
        assert line["finish_reason"] == answer.json()["choices"][0]["finish_reason"]
        assert 0 < line["ttft_s"] <= line["total_s"]
        assert "trace_id" not in line  # tracing is off
        gateway_lines = [e for e in entries if e.get("request_id") == request_id and e["logger"] != "forge.requests"]
        assert gateway_lines, f"no gateway log line names {request_id}"
