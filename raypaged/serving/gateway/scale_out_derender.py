"""vLLM's derender endpoints: ``/inference/v1/generate``'s tokens (output mode ``tokens``) back into the OpenAI
routes' answers, without generating.

``POST /v1/chat/completions/derender`` answers the chat completion and ``POST /v1/completions/derender`` the
completion that ``chat_request`` (``completion_request``: one answer per prompt) gets on its OpenAI route for
the same tokens: the engine's ``Derender`` runs them through ``Generate``'s own detokenizer, stop strings and
logprob texts (seeded with ``prompt_token_ids``, the answer's own, or the request's prompt rendered), and the
route's own answer builders (``Accumulator``, ``ChunkWriter``: reasoning and tool-call parsing) make the
answer. Its ``id`` is the generate answer's ``request_id``; its usage the generate answer's (``prompt_tokens``
given: that count). Without a request, on a server with no tool or reasoning parser, the text is the message.

``stream`` true derenders one chunk of a generate stream (one choice) and answers the chat (completion) chunk
with the ``stream_state`` to send with the next: the choice's tokens so far, re-derendered each chunk (as
vLLM's parsers do), so each chunk is the one the route's stream sends for it. Stop strings are refused there,
as vLLM does: text already sent could not be cut.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from raypaged.serving.client import EngineClient
from raypaged.serving.gateway.calls import metadata
from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.responses import Accumulator, ChunkWriter, ResponseShape
from raypaged.serving.gateway.scale_out_derender_body import (
    DerenderChatBody,
    DerenderCompletionBody,
    StreamStateBody,
    TokensChoiceBody,
    TokensResponseBody,
    UsageBody,
)
from raypaged.serving.gateway.schemas import UINT32_MAX, ChatCompletionRequest, CompletionRequest, body_doc
from raypaged.serving.messages import Usage
from raypaged.serving.proto import generate_pb2 as pb

if TYPE_CHECKING:
    from raypaged.serving.gateway.scale_out import GatewayParts

_STREAM_STOP = (
    "stop is not supported by streaming derender: text already sent cannot be cut at a stop string; derender "
    "the whole answer (stream false), or generate with output_mode text, which holds stop strings back"
)


def add_derender_routes(app: FastAPI, parts: GatewayParts) -> None:
    @app.post("/v1/chat/completions/derender", openapi_extra=body_doc(DerenderChatBody))
    async def derender_chat_completion(http: Request) -> dict:
        body = await parts.parse(http, DerenderChatBody)
        target = await _Target.of(http, parts, body, body.chat_request, True)
        if body.stream:
            return await target.chunk(http, body, body.prompt_tokens, body.prompt_token_ids)
        return await target.answer(http, body.whole_answers, [body.prompt_tokens], [body.prompt_token_ids])

    @app.post("/v1/completions/derender", openapi_extra=body_doc(DerenderCompletionBody))
    async def derender_completion(http: Request) -> dict:
        body = await parts.parse(http, DerenderCompletionBody)
        target = await _Target.of(http, parts, body, body.completion_request, False)
        if body.stream:
            return await target.chunk(http, body, *body.chunk_prompt())
        return await target.answer(http, body.whole_answers, *body.answer_prompts())


class _Target:
    """The OpenAI request a generate answer derenders as: its engine, engine requests (one per prompt) and
    answer shape."""

    def __init__(self, stub: EngineClient, requests: list[pb.GenerateRequest], shape: ResponseShape) -> None:
        self.stub = stub
        self.requests = requests
        self.shape = shape

    @classmethod
    async def of(
        cls,
        http: Request,
        parts: GatewayParts,
        body: DerenderChatBody | DerenderCompletionBody,
        request: ChatCompletionRequest | CompletionRequest | None,
        chat: bool,
    ) -> _Target:
        """The target of ``request``, as its OpenAI route makes it; without one (only on a server with no
        parser to run), plain detokenization of the answers' choices with their logprob candidates."""
        choices: list[TokensChoiceBody] = [c for a in body.whole_answers for c in a.choices]
        if body.generate_chunk is not None:
            choices = list(body.generate_chunk.choices)
        if request is not None:
            for name, asked in (
                ("echo", request.echo),
                ("use_beam_search", request.use_beam_search),
                ("prompt_logprobs", request.prompt_logprobs is not None),
            ):
                if asked:
                    raise APIError(400, f"{name} is not supported by the derender endpoints", name)
            if body.stream and request.stop:
                raise APIError(400, _STREAM_STOP, "stop")
            model, stub, tools, requests = await parts.engine_requests(request)
            shape = await parts.response_shape(http, request, model, tools)
        else:
            if chat and (parts.tool_parser is not None or parts.reasoning_parser is not None):
                raise APIError(
                    400,
                    "chat_request is required on this server: it parses answers (--tool-call-parser or "
                    "--reasoning-parser), whose markup plain detokenization would leave in the content",
                    "chat_request",
                )
            model, stub = await parts.routes.find(body.model)
            logprobs = [c.logprobs for c in choices if c.logprobs is not None]
            num_candidates = max((len(e.top_logprobs) for lp in logprobs for e in lp.content or ()), default=1)
            n = max((c.index + 1 for c in choices), default=1)
            if n > UINT32_MAX:  # the n its choices imply; the engine checks it against the limit
                raise APIError(400, f"choice {n - 1} is past any request's n (at most {UINT32_MAX})", "index")
            request_of = pb.GenerateRequest(model=model, sampling=pb.SamplingParameters(n=n))
            if logprobs:
                request_of.logprobs = num_candidates  # every candidate shown
            requests = [request_of] * max(len(body.whole_answers), 1)
            shape = ResponseShape(chat, model, n, bool(logprobs), role=parts.response_role)
        if body.model is not None:  # the answer's name for the model: one that is served
            shape.model, _ = await parts.routes.find(body.model)
        return cls(stub, requests, shape)

    async def answer(
        self,
        http: Request,
        answers: list[TokensResponseBody],
        prompt_tokens: list[int | None],
        prompt_token_ids: list[list[int] | None],
    ) -> dict:
        """The whole OpenAI answer of generate's ``answers`` (one per prompt)."""
        shape = self.shape
        if len(answers) != len(self.requests):
            raise APIError(400, f"{len(answers)} generate answers for a request of {len(self.requests)} prompts")
        shape.id = answers[0].request_id
        derendered, usages = [], []
        for index, (answer, request) in enumerate(zip(answers, self.requests)):
            indices = sorted(c.index for c in answer.choices)
            not_0_to_n = APIError(400, f"a generate answer has choices {[c.index for c in answer.choices]}, not 0..n-1")
            if not indices or indices != list(range(len(indices))):
                raise not_0_to_n
            replay = _replay(request, answer.request_id, prompt_token_ids[index] or answer.prompt_token_ids)
            with_logprobs = replay.HasField("logprobs")
            completions = [c.completion(with_logprobs) for c in sorted(answer.choices, key=lambda c: c.index)]
            # the engine checks the request (its n within the limit) before anything here is sized by that n
            derendered.append(await self._derender(http, replay, completions))
            if len(indices) != shape.n:
                raise not_0_to_n
            usages.append(_usage(answer.usage, prompt_tokens[index], sum(len(c.token_ids) for c in completions)))
        accumulator = Accumulator(shape, len(answers))
        for index, responses in enumerate(derendered):
            for response in responses:
                accumulator.add(index, response)
        body = accumulator.body()
        body["usage"] = shape.usage(usages)
        return body

    async def chunk(
        self,
        http: Request,
        body: DerenderChatBody | DerenderCompletionBody,
        prompt_tokens: int | None,
        prompt_token_ids: list[int] | None,
    ) -> dict:
        """The OpenAI stream's chunk of one generate chunk (its choice's tokens so far re-derendered: the steps
        before only set up the parsers), and the stream state to send with the next."""
        generate_chunk = body.generate_chunk
        assert generate_chunk is not None  # stream true: checked with the body
        state = body.stream_state or StreamStateBody()
        shape = self.shape
        shape.id = generate_chunk.request_id
        choices: list[dict] = []
        prompt_ids = None
        if generate_chunk.choices:
            [choice] = generate_chunk.choices
            if choice.index >= shape.n:
                raise APIError(400, f"the chunk's choice {choice.index} is past its request's n={shape.n}")
            prompt_token_ids = prompt_token_ids or generate_chunk.prompt_token_ids
            if len(self.requests) > 1 and not prompt_token_ids:
                raise APIError(
                    400,
                    "a chunk of a request of several prompts needs prompt_token_ids: which prompt it continues",
                    "prompt_token_ids",
                )
            new = list(choice.token_ids or ())
            replay = _replay(self.requests[0], generate_chunk.request_id, prompt_token_ids)
            newest = choice.completion(replay.HasField("logprobs"))
            replay.ClearField("logprobs")  # the steps before are only replayed; the newest's logprobs come below
            completion = pb.GeneratedCompletion()
            completion.CopyFrom(newest)
            completion.ClearField("candidates")
            completion.token_ids[:0] = state.output_token_ids
            completion.step_lens.extend([*state.output_chunk_lens, len(new)])
            steps = await self._derender(http, replay, [completion])
            # made once the engine checked the request: a writer keeps a slot for each of its n choices
            writer = ChunkWriter(shape, 1, include_usage=False)
            if newest.candidates and steps:
                await self._add_logprobs(http, steps[-1].outputs[0], newest)
            for step in steps:
                step.outputs[0].index = choice.index
            for step in steps[:-1]:
                writer.chunks(0, step)
            for found in writer.chunks(0, steps[-1]) if steps else ():
                choices.append(found["choices"][0])
                if "prompt_token_ids" in found:  # the chat stream's first chunk of a choice carries them
                    prompt_ids = found["prompt_token_ids"]
            if shape.chat and not state.role_sent:
                first: dict[str, Any] = (
                    choices[0] if choices else {"index": choice.index, "delta": {"content": ""}, "logprobs": None}
                )
                first["delta"] = {"role": shape.role, **first["delta"]}
                first.setdefault("finish_reason", None)
                choices[:1] = [first]
                state.role_sent = True
            if new:
                state.output_token_ids += new
                state.output_chunk_lens.append(len(new))
        answer = shape.envelope(choices, None, chunk=True)
        answer["usage"] = (
            shape.usage([_usage(generate_chunk.usage, prompt_tokens, 0)]) if generate_chunk.usage is not None else None
        )
        if prompt_ids is not None:
            answer["prompt_token_ids"] = prompt_ids
        return {"chunk": answer, "stream_state": state.answer()}

    async def _derender(
        self, http: Request, request: pb.GenerateRequest, completions: list[pb.GeneratedCompletion]
    ) -> list[pb.GenerateResponse]:
        found = await self.stub.Derender(
            pb.DerenderRequest(request=request, completions=completions), metadata=metadata(http)
        )
        return list(found.responses)

    async def _add_logprobs(self, http: Request, delta: pb.CompletionDelta, completion: pb.GeneratedCompletion) -> None:
        """The newest step's logprobs (their texts need no context: each token is decoded alone)."""
        request = pb.GenerateRequest()
        request.CopyFrom(self.requests[0])
        request.ClearField("prompt")
        for name in ("finish_reason", "stop_reason", "stop_token_id"):  # only the texts are read: no stop to find
            completion.ClearField(name)
        [found] = await self._derender(http, request, [completion])
        count = len(delta.token_ids)
        delta.logprobs.extend(found.outputs[0].logprobs[:count])
        delta.token_texts.extend(found.outputs[0].token_texts[:count])
        delta.top_logprobs.extend(found.outputs[0].top_logprobs[:count])


def _replay(request: pb.GenerateRequest, request_id: str, prompt_token_ids: list[int] | None) -> pb.GenerateRequest:
    """``request`` (an OpenAI route's) as ``Derender`` takes it: under generate's id, and with the prompt's token
    ids when they are given (else its own prompt, which the engine renders)."""
    replay = pb.GenerateRequest()
    replay.CopyFrom(request)
    replay.request_id = request_id
    if prompt_token_ids:
        replay.token_ids.CopyFrom(pb.TokenIds(ids=prompt_token_ids))
        replay.ClearField("truncate_prompt_tokens")  # the ids are the prompt as generate ran it
        replay.ClearField("truncation_side")
    return replay


def _usage(usage: UsageBody | None, prompt_tokens: int | None, num_tokens: int) -> Usage:
    """A generate answer's token counts (``prompt_tokens``: the prompt's, given; ``num_tokens``: its choices'
    tokens, counted when it has no usage)."""
    if usage is None:
        return Usage(prompt_tokens=prompt_tokens or 0, completion_tokens=num_tokens)
    details = usage.prompt_tokens_details
    return Usage(
        prompt_tokens=usage.prompt_tokens if prompt_tokens is None else prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=details.cached_tokens if details is not None else 0,
    )
