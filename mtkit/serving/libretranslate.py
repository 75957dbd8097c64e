"""LibreTranslate's API on mtkit's server, so that LibreTranslate's clients (libretranslatepy, deep-translator, ...)
work unchanged: ``POST /translate`` and ``GET /languages``, their fields read where LibreTranslate reads them (a JSON
body; otherwise the query string and a form body) and their errors answered as it answers them, ``{"error": ...}``.

A request names languages, never a model: it goes to the first served model that translates ``source`` into
``target`` (``ModelPool.choose``). mtkit identifies no language, so ``source: "auto"`` is refused. Each line of a
text is one segment, as a line is to `mtkit translate`; with ``format: "html"`` each run of text between tags is
one, its character references decoded and its whitespace collapsed as a browser shows it, while the markup (tags,
attributes, comments, scripts and styles) is kept as it came.

The API key: ``api_key`` among the fields, where LibreTranslate's clients send it, or the ``Authorization: Bearer``
header the rest of the server takes. A request with neither gets 403, as from LibreTranslate; the gate lets these
paths through to be checked here (``add_libretranslate_routes`` returns them).
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qsl

import pydantic_core
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError
from starlette.requests import ClientDisconnect

from mtkit.config import ServeConfig
from mtkit.serving.gate import key_matches
from mtkit.serving.requests import echoed, problems, segments
from mtkit.serving.routes import CLIENT_GONE, BatchedRoute

if TYPE_CHECKING:
    from mtkit.serving.batcher import Batcher
    from mtkit.serving.metrics import ServerMetrics
    from mtkit.serving.models import ModelPool
    from mtkit.serving.searches import Answer, Work

MAX_FIELDS = 64  # in a query string or a form; LibreTranslate's requests have six
HTML_SPACE = " \t\n\r\f"  # what HTML calls whitespace; a no-break space is a character of the text
# A part of an HTML text that is not translated, kept as it came: a script or style element whole, a comment, a
# tag (a doctype, a processing instruction). Outside quotes a tag holds no "<", so that a "<" that opens no tag is
# searched past no further than the next one: time linear in the text, whatever it holds.
MARKUP = re.compile(
    r"<(script|style)\b(?:[^<>\"']|\"[^\"]*\"|'[^']*')*>.*?(?:</\1[ \t\n\r\f]*>|\Z)"
    r"|<!--.*?(?:-->|\Z)"
    r"|<[a-zA-Z/!?](?:[^<>\"']|\"[^\"]*\"|'[^']*')*>",
    re.IGNORECASE | re.DOTALL,
)
# English names of common languages by their ISO 639-1 and 639-3 codes (as M2M100 and NLLB-200 name them)
NAMED = [
    ("ar", "arb", "Arabic"), ("bg", "bul", "Bulgarian"), ("ca", "cat", "Catalan"), ("cs", "ces", "Czech"),
    ("da", "dan", "Danish"), ("de", "deu", "German"), ("el", "ell", "Greek"), ("en", "eng", "English"),
    ("es", "spa", "Spanish"), ("et", "est", "Estonian"), ("fa", "pes", "Persian"), ("fi", "fin", "Finnish"),
    ("fr", "fra", "French"), ("ga", "gle", "Irish"), ("he", "heb", "Hebrew"), ("hi", "hin", "Hindi"),
    ("hr", "hrv", "Croatian"), ("hu", "hun", "Hungarian"), ("id", "ind", "Indonesian"), ("it", "ita", "Italian"),
    ("ja", "jpn", "Japanese"), ("ko", "kor", "Korean"), ("lt", "lit", "Lithuanian"), ("lv", "lvs", "Latvian"),
    ("nl", "nld", "Dutch"), ("pl", "pol", "Polish"), ("pt", "por", "Portuguese"), ("ro", "ron", "Romanian"),
    ("ru", "rus", "Russian"), ("sk", "slk", "Slovak"), ("sl", "slv", "Slovenian"), ("sv", "swe", "Swedish"),
    ("th", "tha", "Thai"), ("tr", "tur", "Turkish"), ("uk", "ukr", "Ukrainian"), ("vi", "vie", "Vietnamese"),
    ("zh", "zho", "Chinese"),
]  # fmt: skip
LANGUAGE_NAMES = {code: name for short, long, name in NAMED for code in (short, long)}


class LibreTranslateRequest(BaseModel):
    """The fields of ``POST /translate``, as JSON or as a form (or in the query string); other fields are ignored,
    as LibreTranslate ignores them."""

    model_config = ConfigDict(extra="ignore")

    q: str | list[str] = Field(
        description="A text, or (in JSON) a list of texts; each line of a text is one segment, as one input line is "
        "to `mtkit translate`."
    )
    source: str = Field(
        description="The language of the texts, one of /languages' codes; not `auto`: this server detects no language."
    )
    target: str = Field(description="The language to translate into, one of the source's targets in /languages.")
    format: Literal["text", "html"] = Field(
        "text",
        description="`html`: each run of text between tags is translated (one segment, its whitespace collapsed) "
        "and the markup is kept as it came.",
    )
    alternatives: int = Field(
        0, ge=0, description="Taken as LibreTranslate takes it; this server answers the best translation alone."
    )
    api_key: str | None = Field(
        None, description="The server's API key, where it has one; or send `Authorization: Bearer KEY`."
    )


class LibreTranslateAnswer(BaseModel):
    """How ``POST /translate`` answers."""

    translatedText: str | list[str] = Field(description="The translation of q: of a text, or of each text in order.")
    alternatives: list[str] | list[list[str]] | None = Field(
        None, description="Only when the request asks for alternatives: none (a list for each text, empty)."
    )


class LibreLanguage(BaseModel):
    """A language in ``GET /languages``."""

    code: str = Field(description="The code a request's source and target name it by.")
    name: str = Field(description="Its English name; the code itself where the server knows none.")
    targets: list[str] = Field(description="The languages a served model translates it into.")


class LibreLanguages(RootModel[list[LibreLanguage]]):
    """How ``GET /languages`` answers: each language a served model translates from or into."""


class LibreError(BaseModel):
    """An error, as LibreTranslate answers it."""

    error: str = Field(description="What is wrong, in one line.")


ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": LibreError, "description": description}
    for status, description in [
        (400, "fields missing, malformed or unknown to the server's models; `source: auto`"),
        (403, "the server has an API key, and neither the api_key field nor the Authorization header is it"),
        (408, "the body did not arrive within the receive timeout"),
        (413, "more texts, characters or bytes than the server takes in a request"),
        (500, "translating failed; the server's log has the details"),
        (503, "the queue is full (Retry-After) or the server is shutting down"),
        (504, "no translation within the server's timeout"),
    ]
}


class LibreTranslateRoute(BatchedRoute):
    """``POST /translate`` and ``GET /languages``: the fields read and the key checked; a translation's texts cut
    into segments, translated in the searches every route shares, and put back together."""

    def __init__(
        self, pool: ModelPool, cfg: ServeConfig, batcher: Batcher[Work, Answer], metrics: ServerMetrics
    ) -> None:
        super().__init__(pool, cfg, batcher, metrics)
        self.listed = json.dumps(languages(pool), ensure_ascii=False).encode()

    async def translate(self, request: Request) -> Response:
        """Translate q from source into target: LibreTranslate's answer, or its error."""
        try:
            query = checked(await self._fields(request))
            try:
                name = self.pool.choose(None, query.source, query.target)
            except ValueError as err:
                raise HTTPException(400, str(err)) from None
            answer = await self._translated(request, name, query)
        except HTTPException as err:
            return refusal(err)
        except ClientDisconnect:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(answer)

    async def list_languages(self, request: Request) -> Response:
        """The languages the served models translate, as LibreTranslate lists them."""
        try:
            await self._fields(request)
        except HTTPException as err:
            return refusal(err)
        except ClientDisconnect:
            return Response(status_code=CLIENT_GONE)
        return Response(self.listed, media_type="application/json")

    async def _fields(self, request: Request) -> dict[str, Any]:
        """The request's fields, once its API key is right: 403 before anything else is said of the request (one
        whose fields cannot be read gives no key in them)."""
        body = await self._body(request)
        try:
            fields = fields_of(request, body)
        except HTTPException:
            self._check_key(request, None)
            raise
        self._check_key(request, fields.get("api_key"))
        return fields

    def _check_key(self, request: Request, given: object) -> None:
        """403 unless the Authorization header held the key (the gate says so; always, where the server has none)
        or ``given`` is the key."""
        if request.state.authorized:
            return
        if not (isinstance(given, str) and key_matches(self.cfg.api_key, given)):
            raise HTTPException(403, "missing or wrong API key")

    async def _translated(self, request: Request, name: str, query: LibreTranslateRequest) -> dict[str, Any]:
        """The answer to ``query``: its texts within the limits, their segments translated by model ``name``."""
        texts = [query.q] if isinstance(query.q, str) else query.q
        self._bounded(texts, request, len(texts))  # as /v1/translate's texts, an HTML text's markup counted too
        cut, escape = (html_pieces, _escaped) if query.format == "html" else (text_pieces, str)
        found: list[str] = []
        pieces = [cut(text, found) for text in texts]
        translations = (
            await self.best_translations(request, name, segments(found), query.target, query.source) if found else []
        )
        done = [rendered(text, translations, escape) for text in pieces]
        answer: dict[str, Any] = {"translatedText": done[0] if isinstance(query.q, str) else done}
        if query.alternatives:
            answer["alternatives"] = [] if isinstance(query.q, str) else [[] for _ in done]
        return answer


def fields_of(request: Request, body: bytes) -> dict[str, Any]:
    """A request's fields where LibreTranslate reads them: its query string's, and its body's (a JSON object, or
    a form); 400 if they cannot be read or one is given twice."""
    fields: dict[str, Any] = {}
    for name, value in [*form_fields(request.url.query), *body_fields(request.headers.get("content-type", ""), body)]:
        if name in fields:
            raise HTTPException(400, f"Invalid request: {echoed(name)} is given twice")
        fields[name] = value
    return fields


def body_fields(content_type: str, body: bytes) -> list[tuple[str, Any]]:
    """The fields of a body: a JSON object's (``application/json``), or a form's (``x-www-form-urlencoded``, as a
    body of another type or none is read); multipart is refused."""
    media = content_type.partition(";")[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        try:
            value = pydantic_core.from_json(body)
        except ValueError as err:
            raise HTTPException(400, f"Invalid JSON: {err}") from None
        if not isinstance(value, dict):
            raise HTTPException(400, "Invalid JSON format: the body is an object of the fields")
        return list(value.items())
    if media == "multipart/form-data":
        raise HTTPException(
            400, "send the fields as JSON, as a form (application/x-www-form-urlencoded) or in the query string"
        )
    try:
        return form_fields(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise HTTPException(400, "Invalid request: a form's body is UTF-8") from None


def form_fields(encoded: str) -> list[tuple[str, str]]:
    """The fields of a query string or form, in order; 400 for more than ``MAX_FIELDS``."""
    try:
        return parse_qsl(encoded, keep_blank_values=True, max_num_fields=MAX_FIELDS)
    except ValueError:
        raise HTTPException(400, f"Invalid request: more than {MAX_FIELDS} fields") from None


def checked(fields: dict[str, Any]) -> LibreTranslateRequest:
    """The fields as a translation request, or 400 saying what is wrong with them."""
    try:
        query = LibreTranslateRequest.model_validate(fields)
    except ValidationError as err:
        raise HTTPException(400, f"Invalid request: {problems(err)}") from None
    if query.source == "auto":
        raise HTTPException(400, "this server detects no language: give source")
    return query


def refusal(err: HTTPException) -> JSONResponse:
    """An error as LibreTranslate answers it, ``{"error": ...}``, with the status and headers mtkit's checks gave,
    but for a request they call unprocessable (422), which LibreTranslate's clients know as a bad one (400)."""
    status = 400 if err.status_code == 422 else err.status_code
    return JSONResponse({"error": str(err.detail)}, status, headers=err.headers)


Pieces = list[str | int]  # a text as the parts kept as they came and, in their places, its segments' numbers


def text_pieces(text: str, found: list[str]) -> Pieces:
    """A plain text as its lines (``\\n``, ``\\r\\n`` or ``\\r`` between them), each a segment added to ``found``,
    with ``\\n`` between them."""
    pieces: Pieces = []
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        pieces += ["\n", len(found)] if pieces else [len(found)]
        found.append(line)
    return pieces


def html_pieces(text: str, found: list[str]) -> Pieces:
    """An HTML text as its markup, kept, and the runs of text between, each a segment added to ``found``."""
    pieces: Pieces = []
    start = 0
    for markup in MARKUP.finditer(text):
        pieces += run_pieces(text[start : markup.start()], found)
        pieces.append(markup.group())
        start = markup.end()
    return pieces + run_pieces(text[start:], found)


def run_pieces(run: str, found: list[str]) -> Pieces:
    """A run of HTML text between tags: the whitespace around it kept, and what it says, its character references
    decoded and its whitespace collapsed, a segment added to ``found``; one that says nothing is kept whole."""
    said = " ".join(html.unescape(run).split())
    if not said:
        return [run] if run else []
    core = run.strip(HTML_SPACE)
    lead = run[: len(run) - len(run.lstrip(HTML_SPACE))]
    found.append(said)
    return [lead, len(found) - 1, run[len(lead) + len(core) :]]


def rendered(pieces: Pieces, translations: list[str], escape: Callable[[str], str]) -> str:
    """A text put back together: its pieces kept, and each of its segments' translations as ``escape`` writes it."""
    return "".join(piece if isinstance(piece, str) else escape(translations[piece]) for piece in pieces)


def _escaped(translation: str) -> str:
    """A translation as HTML text: its ``&``, ``<`` and ``>`` escaped, so that it adds no markup."""
    return html.escape(translation, quote=False)


def languages(pool: ModelPool) -> list[dict[str, Any]]:
    """LibreTranslate's list: each language the pool's directions go from or into, in the order the models
    name them, with its English name and the languages it is translated into."""
    targets: dict[str, list[str]] = {}
    for src, tgt in pool.directions():
        targets.setdefault(src, []).append(tgt)
        targets.setdefault(tgt, [])
    return [{"code": code, "name": language_name(code), "targets": into} for code, into in targets.items()]


def language_name(code: str) -> str:
    """A language's English name: by its code, or by a code and script as NLLB-200's (``eng_Latn``: "English
    (Latn)"); a code the server knows no name for is its own name."""
    language, _, script = code.partition("_")
    if code in LANGUAGE_NAMES:
        return LANGUAGE_NAMES[code]
    return f"{LANGUAGE_NAMES[language]} ({script})" if script and language in LANGUAGE_NAMES else code


def add_libretranslate_routes(
    app: FastAPI, pool: ModelPool, cfg: ServeConfig, batcher: Batcher[Work, Answer], metrics: ServerMetrics
) -> frozenset[str]:
    """Adds LibreTranslate's ``POST /translate`` and ``GET /languages`` to ``app``, with their OpenAPI documents.
    Returns their paths: each checks a key given among its fields itself (the gate's ``body_keyed``)."""
    route = LibreTranslateRoute(pool, cfg, batcher, metrics)
    schema = LibreTranslateRequest.model_json_schema()
    app.add_api_route(
        "/translate",
        route.translate,
        methods=["POST"],
        summary="Translate (LibreTranslate's API)",
        openapi_extra={
            "requestBody": {
                "content": {
                    "application/json": {"schema": schema},
                    "application/x-www-form-urlencoded": {"schema": schema},
                },
                "required": True,
            }
        },
        responses={200: {"model": LibreTranslateAnswer, "description": "The translation"}, **ERRORS},
    )
    app.add_api_route(
        "/languages",
        route.list_languages,
        methods=["GET"],
        summary="Languages (LibreTranslate's API)",
        openapi_extra={
            "parameters": [
                {
                    "name": "api_key",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "string"},
                    "description": "The server's API key, where it has one; or send `Authorization: Bearer KEY`.",
                }
            ]
        },
        responses={
            200: {"model": LibreLanguages, "description": "The languages"},
            **{status: ERRORS[status] for status in (400, 403, 408, 413)},
        },
    )
    return frozenset({"/translate", "/languages"})
