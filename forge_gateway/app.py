"""The OpenAI-compatible REST gateway: JSON and SSE in front of the Forge gRPC service.

It holds no tokenizer and no model code: every request becomes one gRPC call per prompt.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
import uuid
from typing import Any, AsyncIterator, Awaitable

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry.trace import Tracer
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from forge_gateway import balancer, convert, embeddings, responses, sse, streams, tokens
from forge_gateway.config import GatewayConfig
from forge_gateway.errors import GatewayError, from_grpc, internal_error, validation_error
from forge_gateway.metrics import GatewayMetrics, ObservabilityMiddleware, client_interceptors
from forge_gateway.models import ChatCompletionRequest, CompletionRequest, _Common
from forge_gateway.limits import RequestGuard, check_request, check_unknown_fields
from forge_service.errors import StartupError
from forge_service.pb import forge_pb2 as pb
from forge_service.pb import forge_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def listen_http(host: str, port: int) -> socket.socket:
    """The gateway's HTTP socket, bound before anything starts: a port in use is a StartupError
    here, where uvicorn, binding it itself, exits the process from inside the event loop."""
    # IPPROTO_TCP named: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say TCP, and an
    # accepted socket says what the listening one said (with proto 0 the first SSE event after the
    # headers waited for the client's delayed ACK: ~40 ms more time to first token).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn sets it
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise StartupError(f"cannot listen for HTTP on {host}:{port}: {error.strerror or error}") from None
    # uvicorn says where it listens only on sockets it binds itself
    log.info("OpenAI API on http://%s:%d", f"[{host}]" if ":" in host else host, sock.getsockname()[1])
    return sock


def create_app(config: GatewayConfig, channel: grpc.aio.Channel | None = None,
               tracer: Tracer | None = None) -> FastAPI:
    """The ASGI app. Without `channel`, channels to config.target's replicas open at startup (their
    calls carry the request id and trace context); `tracer`: trace requests (None: off)."""
    metrics = GatewayMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if channel is not None:
            yield
            return
        async with balancer.open_replicas(config, client_interceptors(metrics, tracer)) as replicas:
            app.state.replicas = replicas
            yield

    app = FastAPI(title="Forge gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(RequestGuard, config=config)  # the API key and the body's bounds, before any parsing
    app.state.config = config
    app.state.metrics = metrics
    if channel is not None:
        app.state.replicas = balancer.replicas_on(channel, config)
    _install_error_handlers(app, config)
    _add_routes(app, config)
    app.add_route("/metrics", metrics.endpoint, methods=["GET"], include_in_schema=False)
    app.add_middleware(ObservabilityMiddleware, metrics=metrics, tracer=tracer)  # outermost: sees every answer
    return app


def _install_error_handlers(app: FastAPI, config: GatewayConfig) -> None:
    async def gateway_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, GatewayError)
        return error.response(config.retry_after_s)

    async def invalid(request: Request, error: Exception) -> Response:
        assert isinstance(error, RequestValidationError)
        return validation_error(list(error.errors())).response()

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, StarletteHTTPException)
        return GatewayError(error.status_code, _routing_message(request, error), code=None).response(
            config.retry_after_s, headers=error.headers)

    app.add_exception_handler(GatewayError, gateway_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)


def _routing_message(request: Request, error: StarletteHTTPException) -> str:
    """What a client that called a wrong URL or method needs to hear (a base URL without /v1 is
    the usual slip): the method and path it sent, and for a wrong method the ones allowed."""
    sent = f"{request.method} {request.url.path}"
    if error.status_code == 404 and error.detail == "Not Found":
        under_v1 = "/v1" + request.url.path
        routes = {getattr(route, "path", None) for route in request.app.routes}
        hint = f"; the OpenAI API is served under /v1 ({under_v1})" if under_v1 in routes else ""
        return f"invalid URL ({sent}): no such route{hint}"
    if error.status_code == 405:
        allowed = (error.headers or {}).get("Allow", "")
        return f"method not allowed ({sent})" + (f"; this route takes {allowed}" if allowed else "")
    return str(error.detail)


def _add_routes(app: FastAPI, config: GatewayConfig) -> None:
    # The API key is checked by RequestGuard, before the body is read.
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_request(body, config)
        return await _guard(_chat(request, body, config), body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_request(body, config)
        return await _guard(_completions(request, body, config), body)

    @app.post("/v1/responses")
    async def create_response(body: responses.ResponsesRequest, request: Request) -> Response:
        return await _guard(_responses(request, body, config))

    @app.post("/v1/embeddings")
    async def create_embeddings(body: embeddings.EmbeddingRequest, request: Request) -> Response:
        check_unknown_fields(body, config.max_unknown_field_bytes)
        return await _guard(_embeddings(request, body, config))

    @app.post("/tokenize")
    async def tokenize(body: tokens.TokenizeRequest, request: Request) -> Response:
        return await _guard(_tokenize(request, body))

    @app.post("/detokenize")
    async def detokenize(body: tokens.DetokenizeRequest, request: Request) -> Response:
        return await _guard(_detokenize(request, body))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await _guard(_models(request))

    @app.get("/v1/models/{model:path}")  # a served name may hold '/' (org/name)
    async def model(model: str, request: Request) -> Response:
        return await _guard(_model(request, model))

    @app.get("/health")
    async def health(request: Request) -> Response:
        return await _health(request)

    @app.get("/livez")
    async def livez() -> Response:
        """Liveness: the gateway's event loop answers (whatever the replicas' state)."""
        return JSONResponse({"status": "alive"})


async def _guard(work: Awaitable[Response], body: _Common | None = None) -> Response:
    """Every route's one error funnel: typed errors pass, gRPC errors map (their param as `body`
    spelt it), bugs get an id."""
    try:
        return await work
    except GatewayError:
        raise
    except sse.ClientDisconnected:
        return Response(status_code=sse.CLOSED_BY_CLIENT)
    except grpc.aio.AioRpcError as error:
        mapped = from_grpc(error)
        if body is not None:
            mapped.param = body.constraint_param(mapped.param)
        raise mapped from None
    except Exception as error:
        raise internal_error(error) from None


def _replicas(request: Request) -> balancer.Replicas:
    return request.app.state.replicas


def _stub(request: Request) -> pb_grpc.ForgeStub:
    return _replicas(request).work


async def _answer(request: Request, call: Any) -> Any:
    """A Generate call's response, once a replica admitted it within the bound."""
    replicas = _replicas(request)
    await replicas.admitted([call])
    return await replicas.one_response(call)


def _ids(request: Request, prefix: str) -> tuple[str, str]:
    """(gRPC request id, OpenAI response id): the client's X-Request-Id or a fresh one."""
    request_id = getattr(request.state, "request_id", None) or request.headers.get("x-request-id") \
        or uuid.uuid4().hex
    return request_id, f"{prefix}-{request_id}"


def _timeout(request: Request, config: GatewayConfig) -> float:
    header = request.headers.get("x-request-timeout")
    if not header:
        return config.request_timeout_s
    try:
        seconds = float(header)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise GatewayError(400, f"X-Request-Timeout must be a positive number of seconds, got {header[:40]!r}",
                           param="X-Request-Timeout", code="invalid_value")
    return min(seconds, config.request_timeout_s)


async def _chat(request: Request, body: ChatCompletionRequest, config: GatewayConfig) -> Response:
    request_id, response_id = _ids(request, "chatcmpl")
    message = convert.chat_request(body, request_id)
    created, timeout = int(time.time()), _timeout(request, config)
    if body.stream:
        formatter = streams.ChatStream(response_id, created, body.model, body.n, body.logprobs, body.include_usage,
                                       body.continuous_usage, echo=body.echoed)
        return await _stream(request, [message], formatter, timeout)
    call = _replicas(request).generate(message, timeout)
    response = await sse.unless_disconnected(request, _answer(request, call), sse.canceller([call]))
    return JSONResponse(convert.chat_completion(response, response_id, created, body.model, body.logprobs,
                                                body.prompt_logprobs, echo=body.echoed))


async def _responses(request: Request, body: responses.ResponsesRequest, config: GatewayConfig) -> Response:
    """The Responses API on the chat path; errors name the Responses request's parameters."""
    try:
        chat = responses.chat_request(body)
        check_request(chat, config)
        check_unknown_fields(body, config.max_unknown_field_bytes)
        request_id = _ids(request, "resp")[0]
        response_id, created, timeout = f"resp_{request_id}", int(time.time()), _timeout(request, config)
        message = convert.chat_request(chat, request_id)
        if body.stream:
            return await _stream(request, [message], responses.ResponsesStream(response_id, created, body), timeout)
        call = _replicas(request).generate(message, timeout)
        answer = await sse.unless_disconnected(request, _answer(request, call), sse.canceller([call]))
        return JSONResponse(responses.response(answer, response_id, created, body))
    except ValidationError as error:
        raise responses.renamed(validation_error(error.errors())) from None
    except grpc.aio.AioRpcError as error:
        raise responses.renamed(from_grpc(error)) from None
    except GatewayError as error:
        raise responses.renamed(error) from None


async def _completions(request: Request, body: CompletionRequest, config: GatewayConfig) -> Response:
    request_id, response_id = _ids(request, "cmpl")
    messages = convert.completion_requests(body, request_id)
    created, timeout = int(time.time()), _timeout(request, config)
    if body.stream:
        formatter = streams.CompletionStream(response_id, created, body.model, body.n, body.logprobs is not None,
                                             body.include_usage, body.continuous_usage,
                                             echo=body.prompts() if body.echo else None,
                                             prompt_only=body.prompt_only, top_k=body.logprobs or 0)
        return await _stream(request, messages, formatter, timeout)
    calls = [_replicas(request).generate(m, timeout) for m in messages]
    responses = await sse.unless_disconnected(request, asyncio.gather(*(_answer(request, c) for c in calls)),
                                              sse.canceller(calls))
    return JSONResponse(convert.text_completion(responses, response_id, created, body))


async def _embeddings(request: Request, body: embeddings.EmbeddingRequest, config: GatewayConfig) -> Response:
    message = embeddings.embed_request(body, _ids(request, "embd")[0])
    call = _stub(request).Embed(message, timeout=_timeout(request, config))
    try:
        answer = await sse.unless_disconnected(request, call, call.cancel)
    except grpc.aio.AioRpcError as error:
        mapped = from_grpc(error)
        if mapped.param and mapped.param.startswith("inputs"):  # the service's name for `input`
            mapped.param = "input" + mapped.param[len("inputs"):]
        raise mapped from None
    return JSONResponse(embeddings.response(answer, body))


async def _tokenize(request: Request, body: tokens.TokenizeRequest) -> Response:
    try:  # the body is checked again as the generation route's request (an empty prompt, say)
        message = tokens.tokenize_request(body, _ids(request, "tok")[0])
    except ValidationError as error:
        raise validation_error(error.errors()) from None
    response = await _stub(request).Tokenize(message, timeout=60)
    return JSONResponse(tokens.tokenize_response(response))


async def _detokenize(request: Request, body: tokens.DetokenizeRequest) -> Response:
    try:
        response = await _stub(request).Detokenize(tokens.detokenize_request(body), timeout=60)
    except grpc.aio.AioRpcError as error:
        raise tokens.detokenize_error(from_grpc(error)) from None
    return JSONResponse({"prompt": response.text})


async def _model_cards(request: Request) -> list[dict[str, Any]]:
    response = await _stub(request).ListModels(pb.ListModelsRequest(), timeout=10)
    # vLLM's fields: "parent" names the base model a LoRA adapter adapts (null for the base model)
    return [{"id": m.id, "object": "model", "created": m.created, "owned_by": "forge", "root": m.id,
             "parent": m.parent or None, "max_model_len": m.max_model_len} for m in response.models]


async def _models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": await _model_cards(request)})


async def _model(request: Request, name: str) -> Response:
    """One model's card (OpenAI's retrieve), 404 model_not_found for a name not served."""
    card = next((c for c in await _model_cards(request) if c["id"] == name), None)
    if card is None:
        raise GatewayError(404, f"model {name!r} is not served here", code="model_not_found", param="model")
    return JSONResponse(card)


async def _health(request: Request) -> Response:
    """Readiness: 200 when a replica is ready, 503 otherwise (loading, draining, unreachable)."""
    try:
        state = await _replicas(request).health()
    except grpc.aio.AioRpcError as error:
        return JSONResponse({"status": "unavailable", "detail": error.details() or error.code().name}, 503)
    body = {"status": pb.ServingState.Name(state.state).removeprefix("SERVING_STATE_").lower(),
            "model": state.model, "num_waiting": state.num_waiting, "num_running": state.num_running,
            "kv_cache_usage": state.kv_cache_usage, "kv_blocks_used": state.kv_blocks_used,
            "kv_blocks_total": state.kv_blocks_total}
    return JSONResponse(body, status_code=200 if state.ready else 503)


async def _stream(request: Request, messages: list[pb.GenerateRequest], formatter: streams.StreamFormatter,
                  timeout: float) -> Response:
    """Start the streams; errors before the first message are HTTP errors, later ones SSE events."""
    calls = [_stub(request).Stream(m, timeout=timeout) for m in messages]
    merged = sse.merge(calls)
    try:
        await sse.unless_disconnected(request, _replicas(request).admitted(calls), sse.canceller(calls))
        first = await sse.unless_disconnected(request, merged.__anext__(), sse.canceller(calls))
    except BaseException:
        await merged.aclose()
        raise
    return StreamingResponse(sse.events(first, merged, formatter), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
