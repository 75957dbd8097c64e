"""OpenAI's chat completions API over the served models: ``POST /v1/chat/completions`` translates the last user
message, so that OpenAI's client libraries, and tools that let a user type no more than a base URL, a key and a model
name, translate with mtkit.

The request's ``model`` says the model and the languages. A served model's name holds no ':' and a language code
none either, so the string splits at its colons into one of:

    NAME            the served model NAME in its own direction (its only target; a model told its languages by
                    tokens: its default direction)
    NAME:TGT        NAME into the language TGT
    NAME:SRC:TGT    NAME from SRC into TGT
    SRC:TGT         the first served model, in the operator's order, that translates SRC into TGT

A first part that is a served model's name is that model, so ``NAME:TGT`` wins over ``SRC:TGT``. A string that
names no served model is 404, as OpenAI answers an unknown model.

The text translated is the last message whose role is "user" (a string, or text parts joined by line breaks); the
other messages, a system prompt among them, are ignored: the model string alone says what to do. Each line is one
segment, as a line is to `mtkit translate`, and the translations are joined by line breaks again. Each line counts
as a text against the server's limits, which all hold as for ``/v1/translate``.

OpenAI's other fields are ignored where they change nothing a translation needs (temperature, top_p, seed,
max_tokens, stop, penalties, user, metadata, tools, ...: the search follows the model's saved decode settings) and
refused where an answer would mislead the client that sent them: ``n`` over 1, ``logprobs``, and a
``response_format`` other than text. With ``stream``, the answer is OpenAI's server-sent events: a chunk with the
role, one with the whole translation, one with the finish reason (and with ``stream_options.include_usage`` one with
the usage), then ``[DONE]``; they are sent once the translation is done, so an error is still an HTTP status.

Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with the status that OpenAI's clients
raise their matching exception for: 400 for a malformed request or languages the model does not translate, 404 for
an unknown model, and the translate API's statuses for the limits (408, 413, 503 with Retry-After, 504, 500).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import ClientDisconnect

from mtkit.config import LANGUAGE_CODE, ServeConfig
from mtkit.serving.batcher import Batcher
from mtkit.serving.metrics import ServerMetrics
from mtkit.serving.models import ModelPool
from mtkit.serving.requests import echoed, problems, segments
from mtkit.serving.routes import CLIENT_GONE, BatchedRoute
from mtkit.serving.searches import Answer, Work

MODEL_HELP = (
    "The served model and the languages: NAME (its own direction), NAME:TGT, NAME:SRC:TGT, or SRC:TGT (the first "
    "served model that translates SRC into TGT); a first part that is a served model's name is that model."
)
MODEL_FORMS = "a model is NAME, NAME:TGT, NAME:SRC:TGT or SRC:TGT; /v1/models lists the names and their languages"
EVENTS = "text/event-stream"  # the media type of a streamed answer
ERROR_CODES = {  # OpenAI's error code for each status this route answers
    400: "invalid_request",
    404: "model_not_found",
    408: "request_timeout",
    413: "request_too_large",
    500: "server_error",
    503: "overloaded",
    504: "timeout",
}


class ContentPart(BaseModel):
    """A part of a message's content; only text parts of the message translated are taken."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: str = Field(description='"text"; other parts (images, audio, files) are refused in the message translated.')
    text: str | None = Field(None, description="The part's text.")


class ChatMessage(BaseModel):
    """A message of the conversation; only the last user message is read."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = Field(
        None, description="A string, or a list of parts: the last user message's are text parts, joined by line breaks."
    )


class StreamOptions(BaseModel):
    """What a streamed answer includes."""

    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = Field(None, description="A last chunk with the usage, before [DONE].")


class ResponseFormat(BaseModel):
    """The answer's format: a translation is text."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: str = Field(description='"text"; others are refused.')


class ChatRequest(BaseModel):
    """The body of ``POST /v1/chat/completions``: OpenAI's, of which the model, the last user message and the stream
    settings are read; other fields are accepted and ignored, but for those that a translation would answer falsely
    (n over 1, logprobs, a response format other than text), which are refused."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(description=MODEL_HELP)
    messages: list[ChatMessage] = Field(
        min_length=1, description="The conversation; its last user message is translated, line by line."
    )
    stream: bool | None = Field(False, description="Answer in server-sent events, as OpenAI streams.")
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, description="1, or left out: a translation has one answer.")
    logprobs: bool | None = Field(None, description="false, or left out: no log-probabilities are given.")
    response_format: ResponseFormat | None = Field(None, description='{"type": "text"}, or left out.')

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError("this server gives one choice, its model's best translation: n is 1")
        return n

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: bool | None) -> bool | None:
        if logprobs:
            raise ValueError("this server gives no log-probabilities (POST /v1/translate gives scores)")
        return logprobs

    @field_validator("response_format")
    @classmethod
    def _text(cls, response_format: ResponseFormat | None) -> ResponseFormat | None:
        if response_format is not None and response_format.type != "text":
            raise ValueError(f"a translation is text, not {echoed(response_format.type)}")
        return response_format

    def lines(self) -> list[str]:
        """The last user message's lines, each a segment as `mtkit translate` reads a line (a line's ending '\\r'
        dropped, NUL characters replaced by spaces); ``ChatError`` 400 where there is none or it holds other parts
        than text."""
        last = next((message for message in reversed(self.messages) if message.role == "user"), None)
        if last is None or last.content is None:
            raise ChatError(400, "the last user message is what is translated, and there is none", "messages")
        content = last.content
        if not isinstance(content, str):
            refused = next((part.type for part in content if part.type != "text" or part.text is None), None)
            if refused is not None:
                raise ChatError(
                    400, f"only text is translated; the last user message has a part of type {echoed(refused)}",
                    "messages",
                )  # fmt: skip
            content = "\n".join(part.text or "" for part in content)
        return segments([line.removesuffix("\r") for line in content.split("\n")])


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str = Field(description="The translation, a line for each line of the last user message.")


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop"] = "stop"
    logprobs: None = None


class Usage(BaseModel):
    prompt_tokens: int = Field(description="The tokens of the text translated, as the model's tokenizer cuts it.")
    completion_tokens: int = Field(description="The tokens of its translation, as the model's tokenizer cuts it.")
    total_tokens: int


class ChatCompletion(BaseModel):
    """The answer of ``POST /v1/chat/completions``: OpenAI's ``chat.completion``."""

    id: str = Field(description='"chatcmpl-" and a random hexadecimal number.')
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(description="When it was answered, in seconds since 1970.")
    model: str = Field(description="The name of the served model that translated.")
    choices: list[Choice]
    usage: Usage | None = Field(None, description="The tokens counted; none for a model of no tokenizers.")


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed answer: OpenAI's ``chat.completion.chunk``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description='"invalid_request_error" for a 4xx status, "server_error" for a 5xx one.')
    param: str | None = Field(None, description="The request's field at fault, where one is.")
    code: str = Field(description="model_not_found, request_too_large, overloaded, timeout, ...")


class ErrorAnswer(BaseModel):
    """An error, as OpenAI answers one."""

    error: ErrorDetail


class ChatError(Exception):
    """A request this route refuses: its status, message for the client, and the field at fault (if one is)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    @classmethod
    def of(cls, err: HTTPException) -> ChatError:
        """The translate API's error as this route's: its status, but 400, at fault the model string that says them,
        for languages the model does not translate (422 there)."""
        if err.status_code == 422:
            return cls(400, f"{err.detail} (the model says the languages: NAME:TGT or NAME:SRC:TGT)", "model")
        return cls(err.status_code, str(err.detail), headers=err.headers)

    def answer(self) -> JSONResponse:
        """The error in OpenAI's shape."""
        detail = ErrorDetail(
            message=self.message,
            type="server_error" if self.status >= 500 else "invalid_request_error",
            param=self.param,
            code=ERROR_CODES.get(self.status, "invalid_request"),
        )
        return JSONResponse(ErrorAnswer(error=detail).model_dump(), self.status, headers=self.headers)


class ChatRoute(BatchedRoute):
    """``POST /v1/chat/completions``: the model string routed, the last user message translated line by line
    through the batcher as ``/v1/translate``'s texts are, answered as OpenAI's chat completion or its chunks."""

    async def complete(self, request: Request) -> Response:
        """Translate the last user message with the model and into the language ``model`` says."""
        try:
            query = checked(await self._body(request))
            name, src_lang, tgt_lang = chosen(self.pool, query.model)
            lines = query.lines()
            translations = await self.best_translations(request, name, lines, tgt_lang, src_lang)
        except ClientDisconnect:
            return Response(status_code=CLIENT_GONE)
        except HTTPException as err:
            return ChatError.of(err).answer()
        except ChatError as err:
            return err.answer()
        usage = self.usage(request.state.tokens)  # a message has a line at least: best_translations counted
        text, answered = "\n".join(translations), f"chatcmpl-{uuid.uuid4().hex}"
        if query.stream:
            include_usage = query.stream_options is not None and bool(query.stream_options.include_usage)
            return Response(events(answered, name, text, usage if include_usage else None), media_type=EVENTS)
        choice = Choice(message=AssistantMessage(content=text))
        completion = ChatCompletion(id=answered, created=int(time.time()), model=name, choices=[choice], usage=usage)
        return JSONResponse(completion.model_dump())

    @staticmethod
    def usage(tokens: tuple[int, int] | None) -> Usage | None:
        """The usage of the tokens the metrics counted, (lines, translations); None for a model of no tokenizers."""
        if tokens is None:
            return None
        prompt, completion = tokens
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def checked(body: bytes) -> ChatRequest:
    """The body as a chat request; ``ChatError`` 400 saying what is wrong with it, naming the field first at
    fault."""
    try:
        return ChatRequest.model_validate_json(body)
    except ValidationError as err:
        first = next(iter(err.errors(include_url=False)[0]["loc"]), None)
        param = str(first) if first in ChatRequest.model_fields else None
        raise ChatError(400, problems(err), param) from None


def chosen(pool: ModelPool, model: str) -> tuple[str, str | None, str | None]:
    """The served model's name, the source language and the target language (None: the model's own) that a
    request's ``model`` says (this module's docstring gives its forms); ``ChatError`` 404 where it names no served
    model (or a direction none translates), 400 where it names one with a part that is no language code."""
    parts = model.split(":", 3)
    first, languages = parts[0], parts[1:]
    if first in pool.cards and len(languages) <= 2:
        for code in languages:
            if LANGUAGE_CODE.fullmatch(code) is None:
                raise ChatError(400, f"{echoed(code)} in the model {echoed(model)} is no language code", "model")
        src_lang, tgt_lang = [None, None, *languages][-2:]
        return first, src_lang, tgt_lang
    if len(languages) == 1 and all(LANGUAGE_CODE.fullmatch(code) for code in parts):
        src_lang, tgt_lang = parts
        try:
            name = pool.choose(None, src_lang, tgt_lang)
        except ValueError:
            name = None
        if name is not None and pool.cards[name].translates(src_lang, tgt_lang):
            return name, src_lang, tgt_lang
        raise ChatError(
            404, f"no served model is called {first!r} or translates {first} into {tgt_lang}; {MODEL_FORMS}", "model"
        )
    raise ChatError(404, f"this server has no model {echoed(model)}; {MODEL_FORMS}", "model")


def events(answered: str, name: str, text: str, usage: Usage | None) -> str:
    """A streamed answer as OpenAI streams one: server-sent events of a chunk with the role, one with the text, one
    with the finish reason, one with the usage where it is given, then [DONE]."""
    created = int(time.time())

    def chunk(choices: list[ChunkChoice], counted: Usage | None = None) -> str:
        event = ChatCompletionChunk(id=answered, created=created, model=name, choices=choices, usage=counted)
        return f"data: {event.model_dump_json()}\n\n"

    chunks = [
        chunk([ChunkChoice(delta=Delta(role="assistant", content=""))]),
        chunk([ChunkChoice(delta=Delta(content=text))]),
        chunk([ChunkChoice(delta=Delta(), finish_reason="stop")]),
    ]
    if usage is not None:
        chunks.append(chunk([], usage))
    return "".join(chunks) + "data: [DONE]\n\n"


def add_chat_routes(
    app: FastAPI, pool: ModelPool, cfg: ServeConfig, batcher: Batcher[Work, Answer], metrics: ServerMetrics
) -> dict[str, dict[str, Any]]:
    """``POST /v1/chat/completions`` on ``app``, with its request body, its answer and its errors in the API's
    documentation; what the gate answers it for a missing or wrong key (OpenAI's 401), by path."""
    errors: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorAnswer, "description": f"OpenAI's error, code {code}"}
        for status, code in ERROR_CODES.items()
    }
    streamed = {EVENTS: {"schema": {"type": "string"}, "example": "data: {...chat.completion.chunk...}\n\n"}}
    app.add_api_route(
        "/v1/chat/completions",
        ChatRoute(pool, cfg, batcher, metrics).complete,
        methods=["POST"],
        openapi_extra={
            "requestBody": {"content": {"application/json": {"schema": inlined(ChatRequest)}}, "required": True}
        },
        response_model=ChatCompletion,
        responses={
            200: {"content": streamed, "description": "The translation; with stream, server-sent events."},
            **errors,
        },
        summary="OpenAI's chat completions: the last user message translated",
    )
    refused = ErrorDetail(message="missing or wrong API key", type="invalid_request_error", code="invalid_api_key")
    return {"/v1/chat/completions": ErrorAnswer(error=refused).model_dump()}


def inlined(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with the schemas of the models it holds written where they are used: an OpenAPI
    document has no ``$defs`` for their references to point into."""
    schema = model.model_json_schema()
    defined = schema.pop("$defs", {})

    def resolved(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return resolved(defined[node["$ref"].rsplit("/", 1)[1]])
            return {key: resolved(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolved(value) for value in node]
        return node

    return resolved(schema)
