"""forge.v1.Forge's servicer: proto <-> engine types, cancellation, deadlines, status codes. The
service it answers for (server.ForgeService) admits each call and prepares its request."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

import grpc

from forge_service import convert, embeddings
from forge_service.errors import ForgeError, QueueFull, bounded_details, error_metadata, grpc_status
from forge_service.pb import forge_pb2 as pb
from forge_service.pb import forge_pb2_grpc as pb_grpc
from forge_service.prepare import LoadedModel, Prepared, check_model

if TYPE_CHECKING:
    from forge_service.server import ForgeService

log = logging.getLogger(__name__)

# Response header of every admitted generation RPC. Sent at admission, it also commits the call:
# a client's retry policy retries UNAVAILABLE only for calls that never reached a replica.
REPLICA_HEADER = "forge-replica"
# Inputs of one Embed call in the engine at once: a large batch neither fills the engine's waiting
# queue (--max-waiting) nor holds back the requests that come after it.
EMBED_IN_FLIGHT = 32


class ForgeServicer(pb_grpc.ForgeServicer):
    """forge.v1.Forge: proto <-> engine types, cancellation, deadlines, status codes."""

    def __init__(self, service: ForgeService) -> None:
        self._service = service

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        with self._service.observe("Generate", request, context) as rpc:
            async with self._rpc(context) as model:
                prepared = await self._service.prepare(request, model)
                name = model.served_name(prepared.params)
                rpc.prepared(name, prepared.prompt, prepared.params)
                result = convert.GenerateAccumulator(prepared.request_id, name, len(prepared.prompt),
                                                     prepared.output, prepared.first_prompt_token)
                async with contextlib.aclosing(model.engine.generate(*_args(prepared))) as outputs:
                    async for output in outputs:
                        result.add(output)
                        rpc.output(output)
                return result.response()

    async def Stream(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        with self._service.observe("Stream", request, context) as rpc:
            async with self._rpc(context) as model:
                prepared = await self._service.prepare(request, model)
                rpc.prepared(model.served_name(prepared.params), prepared.prompt, prepared.params)
                encoder = convert.StreamEncoder(prepared.request_id, len(prepared.prompt), prepared.output,
                                                prepared.first_prompt_token)
                async with contextlib.aclosing(model.engine.generate(*_args(prepared))) as outputs:
                    async for output in outputs:
                        rpc.output(output)
                        for message in encoder.messages(output):
                            await context.write(message)

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        with self._service.observe("Embed", request, context) as rpc:
            async with self._rpc(context) as model:
                params = embeddings.embed_params(check_model(request.model, model))
                prompts = await self._service.embed_prompts(request, model)
                rpc.prepared(model.served_name(params), [t for p in prompts for t in p], params)
                limit = asyncio.Semaphore(EMBED_IN_FLIGHT)
                try:
                    async with asyncio.TaskGroup() as group:  # one input failing cancels the others
                        tasks = [group.create_task(_embedding(model, prompt, params, request.request_id, limit))
                                 for prompt in prompts]
                except BaseExceptionGroup as failed:  # the first failure, as a lone error is answered
                    raise failed.exceptions[0] from None
                dimensions = request.dimensions if request.HasField("dimensions") else None
                normalize = not request.HasField("normalize") or request.normalize
                response = pb.EmbedResponse(request_id=request.request_id, model=model.served_name(params))
                for prompt, task in zip(prompts, tasks):
                    hidden, cached = task.result()
                    response.embeddings.add(values=embeddings.pooled(hidden, dimensions, normalize),
                                            prompt_tokens=len(prompt))
                    response.usage.cached_tokens += cached
                response.usage.prompt_tokens = sum(len(p) for p in prompts)
                return response

    async def Tokenize(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        async with self._rpc(context) as model:
            ids = await self._service.tokenize(request, model)
            return pb.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=model.max_model_len)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        async with self._rpc(context) as model:
            return pb.DetokenizeResponse(text=await self._service.detokenize(request, model))

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return self._service.health_response()

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        model = self._service.model
        if model is None:
            return pb.ListModelsResponse()
        info = pb.ModelInfo(id=model.name, max_model_len=model.max_model_len, created=model.created)
        adapters = [pb.ModelInfo(id=name, max_model_len=model.max_model_len, created=model.created, parent=model.name)
                    for name in model.adapters]
        return pb.ListModelsResponse(models=[info, *adapters])

    @contextlib.asynccontextmanager
    async def _rpc(self, context: grpc.aio.ServicerContext) -> AsyncIterator[LoadedModel]:
        """Admission, the RPC's deadline, and the one mapping from errors to status codes."""
        deadline = asyncio.timeout(_time_remaining(context))
        try:
            with self._service.track() as model:
                await context.send_initial_metadata(((REPLICA_HEADER, self._service.replica),))
                async with deadline:
                    yield model
        except TimeoutError as error:
            if not deadline.expired():
                await _abort_internal(context, error)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before generation finished")
        except ForgeError as error:
            if isinstance(error, QueueFull):
                self._service.metrics.count_rejected()
            await context.abort(grpc_status(error), bounded_details(str(error)), error_metadata(error))
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # a bug: INTERNAL with an id that is also in the log
            await _abort_internal(context, error)


async def _embedding(model: LoadedModel, prompt: list[int], params, label: str,
                     limit: asyncio.Semaphore) -> tuple[list[float], int]:
    """One input's last hidden state and its prefix-cache hit, as an engine request of its own."""
    hidden, cached = None, 0
    async with limit:
        stream = model.engine.generate(uuid.uuid4().hex, prompt, params, label)
        async with contextlib.aclosing(stream) as outputs:
            async for output in outputs:
                cached = max(cached, output.num_cached_tokens)
                hidden = next((o.embedding for o in output.outputs if o.embedding is not None), hidden)
    if hidden is None:  # the engine ends an embedding with its one token, which carries it
        raise RuntimeError("an embedding request finished without its hidden state")
    return hidden, cached


def _args(prepared: Prepared) -> tuple[str, list[int], Any, str]:
    return prepared.engine_id, prepared.prompt, prepared.params, prepared.request_id


def _time_remaining(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    # Without a deadline some grpc versions report a huge number rather than None.
    return None if remaining is None or remaining > 1e8 else max(remaining, 0.0)


async def _abort_internal(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error [error id %s]", error_id, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error [error id {error_id}]")
