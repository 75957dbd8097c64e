"""The API's documentation, for people: the OpenAPI schema at /openapi.json made complete (the API key as a security
scheme that Swagger UI's Authorize dialog takes, each route's error answers, the core routes' answers described), and
Swagger UI at /docs served from the copy the fastapi-offline package ships rather than from a CDN, so that the page
works on a server that reaches nothing outside. Neither needs the key (``UNKEYED_PATHS``): the page asks for it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel

from mtkit.serving.answers import ErrorMessage, HealthAnswer, ModelsAnswer, TranslateAnswer
from mtkit.serving.routes import BatchedRoute

SECURITY_SCHEME = "APIKey"  # the name the Authorize dialog shows beside the field the key goes in
DOCS = "/docs"
OAUTH2_REDIRECT = "/docs/oauth2-redirect"
OPENAPI = "/openapi.json"
STATIC = Path(fastapi_offline.__file__).parent / "static"  # swagger-ui-dist's bundle, stylesheet and FastAPI's icon
ASSETS = {  # what the page loads, by path: the file of STATIC it is
    "/docs/swagger-ui-bundle.js": "swagger-ui-bundle.js",
    "/docs/swagger-ui.css": "swagger-ui.css",
    "/docs/favicon.png": "favicon.png",
}
# What the gate lets through without the API key: the page, what it loads, and the schema it renders.
UNKEYED_PATHS = frozenset({DOCS, OAUTH2_REDIRECT, OPENAPI, *ASSETS})
UNKEYED_OPERATIONS = frozenset({"/health"})  # the documented paths that need no key

# The 200 answers of the routes that build their answers as plain dicts, by (path, method).
ANSWERS: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/translate", "post"): TranslateAnswer,
    ("/v1/models", "get"): ModelsAnswer,
    ("/health", "get"): HealthAnswer,
}
COMPONENTS = "#/components/schemas/"
Headers = dict[str, tuple[str, str]]  # an answer's headers by name: what each says, and its JSON type
UNAUTHORIZED: tuple[str, Headers] = (
    "An API key is set, and the request's Authorization header is not `Bearer KEY` with it.",
    {"WWW-Authenticate": ('How to authenticate: `Bearer realm="mtkit"`.', "string")},
)
# What a route whose work the batcher does may answer instead of its answer (``routes.BatchedRoute``).
BATCHED_ERRORS: dict[int, tuple[str, Headers]] = {
    408: ("The body did not arrive within the server's receive timeout.", {}),
    413: ("More texts or characters than the server takes in one request, or a body larger than such a request.", {}),
    422: ("The body is not a request this route takes, or asks for what the server does not serve.", {}),
    503: (
        "The queue is full or the server is shutting down: try again after Retry-After seconds.",
        {"Retry-After": ("Seconds to wait before trying again.", "integer")},
    ),
    504: ("No answer within the server's timeout: the request left its search.", {}),
    500: ("The request's search failed; the server's log holds the details under the request's number.", {}),
}


def document(app: FastAPI, keyed: bool) -> None:
    """Make ``app``'s /openapi.json the complete schema of its routes, built once when first asked for; ``keyed``:
    an API key is set. Called once every route is added."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = completed(app, keyed)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to shape the schema


def completed(app: FastAPI, keyed: bool) -> dict[str, Any]:
    """FastAPI's schema of ``app``'s routes, with the security scheme (where ``keyed``), every operation's error
    answers, and the answers of ``ANSWERS``' routes; what a route declared itself is kept."""
    schema = get_openapi(
        title=app.title, version=app.version, openapi_version=app.openapi_version, description=app.description,
        routes=app.routes, servers=app.servers,
    )  # fmt: skip
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    if keyed:
        components["securitySchemes"] = {
            SECURITY_SCHEME: {
                "type": "http",
                "scheme": "bearer",
                "description": "The server's API key (`mtkit serve --api-key`, or MTKIT_API_KEY).",
            }
        }
    for route in app.routes:
        if not (isinstance(route, APIRoute) and route.include_in_schema):
            continue
        for method in sorted(route.methods):
            operation = schema["paths"][route.path_format][method.lower()]
            responses = operation.setdefault("responses", {})
            declared = {str(status) for status in route.responses}
            answer = ANSWERS.get((route.path_format, method.lower()))
            if answer is not None and "200" not in declared and not modelled(route):
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok["content"] = {"application/json": {"schema": component(schemas, answer)}}
            if keyed and route.path_format not in UNKEYED_OPERATIONS:
                operation["security"] = [{SECURITY_SCHEME: []}]
                if not declared & {"401", "403"}:  # a route that refuses a key itself documents how
                    responses["401"] = error_response(*UNAUTHORIZED, component(schemas, ErrorMessage))
            if batched(route) and not any(is_error(status) for status in declared):
                for status, (description, headers) in BATCHED_ERRORS.items():
                    responses.setdefault(
                        str(status), error_response(description, headers, component(schemas, ErrorMessage))
                    )
    return schema


def component(schemas: dict[str, Any], model: type[BaseModel]) -> dict[str, str]:
    """The reference to ``model``'s JSON schema among the schema's components, added there with the models it refers
    to. A name that a route's own model already took for another schema is an error rather than a wrong page."""
    definitions = model.model_json_schema(ref_template=f"{COMPONENTS}{{model}}", mode="serialization")
    for name, definition in {**definitions.pop("$defs", {}), model.__name__: definitions}.items():
        if schemas.setdefault(name, definition) != definition:
            raise ValueError(f"two models are called {name} in the API's schema")
    return {"$ref": COMPONENTS + model.__name__}


def error_response(description: str, headers: Headers, ref: dict[str, str]) -> dict[str, Any]:
    """An error answer of the OpenAPI schema: ``{"detail": str}`` (``ref``) with ``headers``."""
    response: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": ref}}}
    if headers:
        response["headers"] = {
            name: {"description": meaning, "schema": {"type": kind}} for name, (meaning, kind) in headers.items()
        }
    return response


def modelled(route: APIRoute) -> bool:
    """Whether ``route`` declared a model of its answer (a return annotation such as ``dict[str, Any]`` is none)."""
    model = route.response_model
    return isinstance(model, type) and issubclass(model, BaseModel)


def batched(route: APIRoute) -> bool:
    """Whether ``route``'s handler is a method of a route whose work the batcher does."""
    return isinstance(getattr(route.endpoint, "__self__", None), BatchedRoute)


def is_error(status: int | str) -> bool:
    """Whether a status of a route's declared responses is an error's (a number, ``4XX``, ``5XX`` or default)."""
    text = str(status)
    return text == "default" or text[0] in "45"


def add_docs_routes(app: FastAPI) -> None:
    """Swagger UI at /docs, its OAuth2 redirect page, and the files it loads, from the local copy, on ``app``
    made with ``docs_url=None`` (FastAPI's own page loads Swagger UI from a CDN)."""
    if app.docs_url is not None:
        raise ValueError("the application already has FastAPI's /docs: make it with docs_url=None")

    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return get_swagger_ui_html(
            openapi_url=root + OPENAPI,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=root + "/docs/swagger-ui-bundle.js",
            swagger_css_url=root + "/docs/swagger-ui.css",
            swagger_favicon_url=root + "/docs/favicon.png",
            oauth2_redirect_url=root + OAUTH2_REDIRECT,
            swagger_ui_parameters={"validatorUrl": None, **(app.swagger_ui_parameters or {})},  # no outside badge
        )

    async def oauth2_redirect(request: Request) -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    app.add_route(DOCS, swagger_ui, include_in_schema=False)
    app.add_route(OAUTH2_REDIRECT, oauth2_redirect, include_in_schema=False)
    for path, name in ASSETS.items():
        app.add_route(path, asset(STATIC / name), include_in_schema=False)


def asset(path: Path) -> Callable[[Request], Awaitable[FileResponse]]:
    """A handler that answers the file at ``path``."""

    async def answer(request: Request) -> FileResponse:
        return FileResponse(path)

    return answer
