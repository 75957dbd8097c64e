"""``mtkit train`` and ``mtkit run``: training a model, alone or as one stage of a recipe."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Annotated

import typer

from mtkit.commands.common import Overrides, examples, setup_logging, user_errors
from mtkit.config import Precision

commands = typer.Typer()
log = logging.getLogger("mtkit")


@commands.command(
    "train",
    epilog=examples(
        "mtkit train m30k.yaml -o runs/m30k --set train.lr=0.001 --precision bf16",
        "mtkit train m30k.yaml --dry-run",
        "mtkit train m30k.yaml -o runs/m30k --nproc-per-node 4",
    ),
)
@user_errors
def train_command(
    config: Annotated[Path, typer.Argument(help="YAML config with data, tokenizer, model, train and decode sections.")],
    overrides: Overrides = [],
    out: Annotated[
        Path | None, typer.Option("--output", "-o", "--out", help="Run directory (default: runs/<config name>).")
    ] = None,
    precision: Annotated[
        Precision | None, typer.Option(help="Sets train.precision (auto: bf16 where native, else fp32; fp16: GPU).")
    ] = None,
    save_every: Annotated[int | None, typer.Option(help="Checkpoint every N updates (sets train.save_every).")] = None,
    keep_last: Annotated[
        int | None, typer.Option(help="Checkpoints kept for resuming and averaging; 0 keeps all (train.keep_last).")
    ] = None,
    compile_model: Annotated[
        bool, typer.Option("--compile", help="torch.compile the encoder-decoder (sets train.compile).")
    ] = False,
    tensorboard: Annotated[
        bool, typer.Option("--tensorboard", help="Also write TensorBoard events to RUN_DIR/tensorboard.")
    ] = False,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            "--nproc-per-node",
            help="Start this many training processes on this machine through torch.distributed.run "
            "(one per GPU: NCCL, gloo on CPU), 1 included; without it, one process trains alone. For several "
            "machines call torchrun yourself.",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the resolved config, batch and LR schedule; do not train.")
    ] = False,
    restart: Annotated[
        bool, typer.Option("--restart", help="Start over even if the run directory holds a checkpoint.")
    ] = False,
) -> None:
    """Train a Transformer; re-running on the same run directory resumes from its newest checkpoint.

    Under torchrun (torchrun --nproc-per-node N -m mtkit train CONFIG) every process trains on its
    share of each update's batches with DistributedDataParallel; rank 0 validates and writes.
    """
    from mtkit.config import ConfigError, read_config
    from mtkit.training.distributed import launched_by_torchrun

    flags = {
        "precision": precision,
        "save_every": save_every,
        "keep_last": keep_last,
        "compile": compile_model or None,
        "tensorboard": tensorboard or None,
    }
    overrides = [*overrides, *(f"train.{key}={value}" for key, value in flags.items() if value is not None)]
    cfg = read_config(config, overrides)
    if cfg.backtranslation.monolingual:
        raise ConfigError(
            "backtranslation is a chain of stages that `mtkit run` carries out (reverse model, back-translation, "
            f"training): run `mtkit run {config}`"
        )
    if cfg.distillation.enabled:
        raise ConfigError(
            "distillation is a chain of stages that `mtkit run` carries out (teacher, its translations, filters, "
            f"the student's training): run `mtkit run {config}`"
        )
    out = out or Path("runs") / config.stem
    if dry_run:
        typer.echo(_plan(cfg, out, nproc_per_node or 1), nl=False)
        return
    if nproc_per_node is not None and nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if nproc_per_node is not None and not launched_by_torchrun():
        from mtkit.training.trainer import check_trainable

        check_trainable(cfg)  # here, once, rather than in every rank
        command = ["train", str(config), "--out", str(out), *(a for o in overrides for a in ("--set", o))]
        _hand_over_to_torchrun(nproc_per_node, [*command, *(["--restart"] if restart else [])])
        return
    setup_logging(quiet=int(os.environ.get("RANK", "0")) != 0)
    _run_training(cfg, out, restart)


def _plan(cfg, out: Path, processes: int) -> str:
    """What --dry-run prints: the resolved config, then the run directory, the batch and the LR schedule."""
    from mtkit.config import config_yaml
    from mtkit.training.schedule import schedule_preview

    tc = cfg.train
    schedule = ", ".join(f"update {step}: {lr:.3g}" for step, lr in schedule_preview(cfg))
    start = f"# model and tokenizer: those of {tc.init_from} (train.init_from)\n" if tc.init_from else ""
    return (
        f"{config_yaml(cfg)}{start}# run directory: {out}\n"
        f"# effective batch: {tc.batch_tokens * tc.accum * processes} padded tokens per side per update "
        f"({tc.batch_tokens} x accum {tc.accum} x {processes} process(es))\n"
        f"# learning rate: {schedule}\n"
    )


def _stopped(stop, out: Path, restart: bool) -> typer.Exit:
    """What a training stopped by a signal says, and the exit status it ends with."""
    typer.echo(f"{stop}: last checkpoint saved in {out}; {_to_resume(restart)}", err=True)
    return typer.Exit(128 + stop.signum)


def _to_resume(restart: bool) -> str:
    """How to resume a command a signal stopped: the same command, less a --restart that would start over again."""
    return "run the command again without --restart to resume" if restart else "run the same command to resume"


def _run_training(cfg, out: Path, restart: bool) -> None:
    from mtkit.training.distributed import MAIN_EXIT_GRACE_S, DistributedError, from_environment
    from mtkit.training.reporting import TrainingProgress
    from mtkit.training.stop_signals import TrainingStopped
    from mtkit.training.trainer import run_training

    dist = from_environment(cfg.train.device, cfg.train.ddp_timeout)
    try:
        result = run_training(cfg, out, TrainingProgress(cfg.train.log_every), restart=restart, dist=dist)
    except TrainingStopped as stop:
        if dist.is_main:
            raise _stopped(stop, out, restart) from None
        raise typer.Exit(128 + stop.signum) from None
    except DistributedError as err:
        if not dist.is_main:  # rank 0 says what failed; a peer that lost it only notes it
            log.warning("%s", err)
            if err.main_exited:
                time.sleep(MAIN_EXIT_GRACE_S)
            raise typer.Exit(1) from None
        raise
    finally:
        dist.close()
    if dist.is_main:
        if result["stop"]["stopped_by"] == "max_time":
            typer.echo(f"training {result['stop']['reason']}: the run is incomplete", err=True)
        if "valid_bleu" in result:
            typer.echo(f"final validation BLEU {result['valid_bleu']:.2f} ({result['bleu_signature']})", err=True)
        typer.echo(f"run directory: {out}", err=True)


def _hand_over_to_torchrun(nproc_per_node: int, command: list[str]) -> None:
    """Run ``mtkit COMMAND`` in ``nproc_per_node`` processes under torch.distributed.run; exit as they did."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from mtkit.training.distributed import torchrun_arguments

    args = get_args_parser().parse_args(torchrun_arguments(nproc_per_node, command))
    # The launcher's own log of a failed rank repeats what the rank printed and what is said below.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except SignalException as stop:  # torchrun has passed the signal on; the ranks save and exit
        name = signal.Signals(stop.sigval).name
        typer.echo(f"stopped by {name}: the ranks saved a checkpoint; run the same command to resume", err=True)
        raise typer.Exit(128 + stop.sigval) from None
    except ChildFailedError as err:
        codes = sorted({failure.exitcode for failure in err.failures.values()})
        if err.failures.get(0) is None or err.failures[0].exitcode != 1:  # exit 1: rank 0 printed why
            typer.echo(f"error: training processes failed (exit status {', '.join(map(str, codes))})", err=True)
        raise typer.Exit(1 if codes != [codes[0]] or codes[0] < 0 else codes[0]) from None


@commands.command(
    "run",
    epilog=examples(
        "mtkit run recipes/multi30k_en_de.yaml -o runs/m30k --mirror ../shared/data/multi30k",
        "mtkit run recipes/multi30k_en_de.yaml -o runs/m30k --set decode.beam=4",
        "mtkit run recipes/multi30k_en_de_student.yaml -o runs/student --restart train",
    ),
)
@user_errors
def run_command(
    recipe: Annotated[
        Path, typer.Argument(help="A recipe: a config with a recipe section, e.g. recipes/multi30k_en_de.yaml.")
    ],
    out: Annotated[
        Path | None, typer.Option("--output", "-o", "--out", help="Run directory (default runs/<recipe name>).")
    ] = None,
    mirror: Annotated[
        str | None, typer.Option(help="Fetch the corpus from here (a folder, file:// or http(s):// base).")
    ] = None,
    overrides: Overrides = [],
    restart: Annotated[
        list[str],
        typer.Option(
            "--restart",
            metavar="STAGE",
            help="Start this training over from update 0, repeatable: train (the run's model), reverse (the "
            "back-translation model), teacher (the distillation teachers). For a training whose data changed.",
        ),
    ] = [],
) -> None:
    """Run a recipe end to end: prepare the corpus, train, average checkpoints, translate the test set,
    score it, and write RUN/report.md and RUN/report.json (and RUN/curves.png with matplotlib).

    Re-running redoes only what is missing or out of date: training resumes from its newest checkpoint.
    The report says whether the test BLEU falls in the recipe's expected range (recipe.bleu_min/max).
    """
    from mtkit.config import read_config
    from mtkit.training.reporting import TrainingProgress
    from mtkit.training.stop_signals import StageStopped, TrainingStopped
    from mtkit.workflows.recipe import run_recipe as run_all
    from mtkit.workflows.report import render_report

    setup_logging()
    cfg = read_config(recipe, overrides)
    out = out or Path("runs") / recipe.stem
    try:
        report = run_all(cfg, recipe, out, mirror, TrainingProgress(cfg.train.log_every), restart)
    except TrainingStopped as stop:
        raise _stopped(stop, out, bool(restart)) from None
    except StageStopped as stop:
        typer.echo(f"{stop}; {_to_resume(bool(restart))}", err=True)
        raise typer.Exit(128 + stop.signum) from None
    typer.echo(render_report(report))
    typer.echo(f"report: {out / 'report.md'}", err=True)
