"""``mtkit serve``: a trained model behind an HTTP API (the library side is ``mtkit.serving.server``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from mtkit.commands.common import (
    CpuThreads,
    Device,
    EngineChoice,
    WeightPrecision,
    examples,
    setup_logging,
    user_errors,
)
from mtkit.config import ConfigError, InferenceConfig, ServeConfig

commands = typer.Typer()

LogFormat = Literal["plain", "json"]


@commands.command(
    "serve",
    epilog=examples(
        "mtkit serve runs/m30k",
        "MTKIT_API_KEY=secret mtkit serve runs/m30k --host 0.0.0.0 --port 8080 --max-batch-size 64",
        'curl -s localhost:8000/v1/translate -H "Content-Type: application/json" -d \'{"text": "A dog runs."}\'',
        "mtkit serve opus-en-de --adapter legal=runs/legal-lora --adapter medical=runs/medical-lora",
        "mtkit serve --model en-de=runs/m30k --model en-fr=runs/m30k_fr --model nllb=nllb-600m --max-loaded 2",
        "mtkit serve --models models.toml",
    ),
)
@user_errors
def serve_command(
    model: Annotated[
        str | None,
        typer.Argument(
            help="The model to serve: a run directory (its best/), a checkpoint, or what `mtkit import` wrote; "
            "requests call it by its folder's name.",
            show_default=False,
        ),
    ] = None,
    models: Annotated[
        list[str] | None,
        typer.Option(
            "--model",
            metavar="NAME=PATH",
            help="A model to serve, which requests call NAME (or reach by its languages); repeat it for several.",
            show_default=False,
        ),
    ] = None,
    models_file: Annotated[
        Path | None,
        typer.Option(
            "--models",
            metavar="FILE",
            help="A TOML or YAML file of the models to serve ([[models]] name, path, adapters) and max_loaded.",
            show_default=False,
        ),
    ] = None,
    max_loaded: Annotated[
        int | None,
        typer.Option(
            help="Models in memory at once; a request for another evicts the least recently used idle one. "
            "Default: the models file's max_loaded, else no bound.",
            show_default=False,
        ),
    ] = None,
    adapter: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAME=PATH",
            help="A LoRA adapter of the model at PATH (a LoRA run, one of its checkpoints, or its adapter file), "
            "used by the requests whose 'adapter' is NAME; repeat it for several, all over the one model in memory.",
            show_default=False,
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on; 0.0.0.0 for every interface.")] = ServeConfig.host,
    port: Annotated[int, typer.Option(help="Port to listen on; 0 for any free one (logged).")] = ServeConfig.port,
    device: Device = InferenceConfig.device,
    precision: WeightPrecision = InferenceConfig.precision,
    engine: EngineChoice = InferenceConfig.engine,
    threads: CpuThreads = InferenceConfig.threads,
    max_batch_size: Annotated[
        int, typer.Option(help="Sentences of concurrent requests searched together.")
    ] = ServeConfig.max_batch_size,
    max_wait_ms: Annotated[
        float, typer.Option(help="How long a sentence waits for search-mates before an idle search starts.")
    ] = ServeConfig.max_wait_ms,
    continuous: Annotated[
        bool,
        typer.Option(
            help="Requests join a search already running and leave it as each is done; "
            "--no-continuous: a search takes the requests waiting when it starts and ends with its last."
        ),
    ] = ServeConfig.continuous,
    max_queue: Annotated[
        int, typer.Option(help="Sentences that may wait; a request that would exceed it gets 503.")
    ] = ServeConfig.max_queue,
    max_texts: Annotated[int, typer.Option(help="Texts in one request; more gets 413.")] = ServeConfig.max_texts,
    max_chars: Annotated[
        int, typer.Option(help="Characters of one request's texts together; more gets 413.")
    ] = ServeConfig.max_chars,
    timeout: Annotated[
        float, typer.Option(help="Seconds a request waits for its translations before it gets 504.")
    ] = ServeConfig.timeout,
    receive_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds a client may take to send a request's headers (then the connection closes), "
            "and again its body (then 408)."
        ),
    ] = ServeConfig.receive_timeout,
    max_connections: Annotated[
        int, typer.Option(help="Connections open at once; one more gets 503 and is closed.")
    ] = ServeConfig.max_connections,
    log_format: Annotated[
        LogFormat, typer.Option(help="plain, or json: each log line a JSON object, a request's with its fields.")
    ] = ServeConfig.log_format,
    api_key: Annotated[
        str,
        typer.Option(
            envvar="MTKIT_API_KEY",
            help="Require 'Authorization: Bearer KEY' on every request but /health.",
            show_default=False,
        ),
    ] = ServeConfig.api_key,
) -> None:
    """Translate over HTTP: POST /v1/translate, POST /v1/score, GET /health, GET /v1/models, GET /metrics; API docs
    at /docs.

    One model, or several (--model NAME=PATH ..., or --models FILE): a request names its model, or goes to the
    first that translates its languages; each loads at its first request, at most --max-loaded at once.
    The sentences of concurrent requests are searched together, up to --max-batch-size at a time; a
    request joins a search already running and leaves it as soon as its sentences are done.
    Decoding follows the settings saved with the model unless a request says otherwise; a request may name one
    of the --adapter adapters, whose requests are searched apart from the others'. SIGINT or
    SIGTERM stops taking connections, finishes the requests in flight and exits 0; a second one stops at
    once, and exits 1 if that cut requests off.
    """
    from mtkit.runtime import require

    setup_logging(json_lines=log_format == "json")
    for module in ("fastapi", "uvicorn", "httptools", "prometheus_client"):
        require(module, "mtkit serve", "-e '.[serve]' in mtkit's clone")
    cfg = ServeConfig(
        host=host, port=port, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, continuous=continuous,
        max_queue=max_queue,
        max_texts=max_texts, max_chars=max_chars, timeout=timeout, receive_timeout=receive_timeout,
        max_connections=max_connections, log_format=log_format, api_key=api_key,
    )  # fmt: skip
    from mtkit.serving.model_specs import read_models_file, specs_of
    from mtkit.serving.server import serve

    if models_file is not None:
        if model is not None or models or adapter:
            raise ConfigError("--models FILE names every model and adapter: give no MODEL, --model or --adapter too")
        specs, file_max_loaded = read_models_file(models_file)
        max_loaded = file_max_loaded if max_loaded is None else max_loaded
    else:
        specs = specs_of(model, models or [], adapter or [])
    if max_loaded is not None and max_loaded < 0:
        raise ConfigError(f"--max-loaded must be >= 0 (0: no bound), got {max_loaded}")
    try:
        status = serve(specs, cfg, max_loaded or 0, device=device, precision=precision, engine=engine, threads=threads)
    except KeyboardInterrupt:  # Ctrl-C before the server listens (while the model loads): stop quietly
        raise typer.Exit(130) from None
    raise typer.Exit(status)
