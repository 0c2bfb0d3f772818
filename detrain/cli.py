"""The ``detrain`` command: train / val / predict / info / export / convert / checks, arguments as key=value.

    detrain train data=coco8.yaml model=n.yaml epochs=3 imgsz=320 device=cpu,cpu
    detrain val model=runs/train/exp/weights/best.pt data=coco8.yaml
    detrain predict model=best.pt source=images/      (or a video, a glob, a .txt list, a camera 0, rtsp://...)
    detrain export model=best.pt format=onnx          (then val and predict take model=best.onnx)
    detrain info model=yolov8n.pt imgsz=640

A bad key or value prints one line and exits with code 2; a run preempted by SIGTERM or SIGUSR1 saves and exits 75.
"""

from __future__ import annotations

import sys
from typing import Any

import typer

from detrain import __version__
from detrain.config.cfg import COMMAND_KEYS, TASK, command_values, comments, defaults, make_cfg, parse_cli_args
from detrain.config.keys import SECTION_OF, TITLES
from detrain.errors import EXIT_PREEMPTED, DetrainError, Preempted

_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": ["-h", "--help"]}


def _keys_help(command: str) -> str:
    """The keys a command takes, under their sections' headings, with their defaults and help lines (the source
    of both: detrain/config/keys.py)."""
    notes = comments()
    lines = []
    section = None
    for key, value in defaults().items():
        if key in COMMAND_KEYS[command]:
            if SECTION_OF[key] != section:
                section = SECTION_OF[key]
                lines.append(f"--- {TITLES[section]} ---")
            lines.append(f"{key}={'' if value is None else value}  {notes[key]}")
    return "\n\n".join(lines)


app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    help="Train YOLO-style object detectors on one or many devices and machines. "
    "Arguments are key=value (or --key value); see 'detrain train --help' for every key. "
    "As with Ultralytics' yolo: cfg=FILE reads keys from a yaml (a run's args.yaml; the command line wins), "
    "task=detect and mode=<the command> are accepted, and 'detrain detect train ...' or 'detrain mode=train ...' "
    "name the command. Exit codes: 0 done, 2 a bad argument or file (one line), 75 preempted by SIGTERM or "
    "SIGUSR1 after saving weights/mid.pt (resumable: the line says how), 130 interrupted.",
)

COMMAND_NAMES = ("train", "val", "predict", "export", "info")


def _args(ctx: typer.Context) -> dict[str, Any]:
    """The command's key=value arguments; keys of other commands are errors."""
    return parse_cli_args(list(ctx.args), ctx.command.name)


@app.command(context_settings=_EXTRA, epilog=_keys_help("train"))
def train(ctx: typer.Context) -> None:
    """Train a detector: detrain train data=coco8.yaml model=n.yaml epochs=3 device=0,1"""
    cfg = make_cfg(_args(ctx), "train")
    from detrain.run.task import run_task

    run_task("train", cfg)


@app.command(context_settings=_EXTRA, epilog=_keys_help("val"))
def val(ctx: typer.Context) -> None:
    """Evaluate weights (COCO-exact mAP): detrain val model=best.pt data=coco8.yaml device=cpu,cpu"""
    cfg = make_cfg(_args(ctx), "val")
    from detrain.run.task import run_task

    run_task("val", cfg)


@app.command(context_settings=_EXTRA, epilog=_keys_help("predict"))
def predict(ctx: typer.Context) -> None:
    """Detect objects in images, videos, cameras and streams: detrain predict model=best.pt source=path/to/images"""
    cfg = make_cfg(_args(ctx), "predict")
    from detrain.engine.predict.predictor import stream_predict

    results = stream_predict(cfg)
    try:
        for _ in results:  # one picture at a time: a long video or a camera never piles up in memory
            pass
    finally:
        results.close()  # on Ctrl-C too: the video written so far is finished and kept


@app.command(context_settings=_EXTRA, epilog=_keys_help("export"))
def export(ctx: typer.Context) -> None:
    """Export weights to ONNX or TorchScript at their training imgsz: detrain export model=best.pt format=torchscript"""
    from detrain.api import Model
    from detrain.engine.build import check_exported, is_exported

    args = command_values(_args(ctx), "export")  # a cfg= file's keys beneath the command line's
    sha256 = make_cfg({"weights_sha256": args.pop("weights_sha256", "")}).inputs.weights_sha256
    model = str(args.pop("model", defaults()["model"]))
    if is_exported(model):  # one line before anything is read
        check_exported(model, "export")
    path = Model(model, weights_sha256=sha256).export(**args)
    typer.echo(f"exported {path}")


@app.command(context_settings=_EXTRA, epilog=_keys_help("info"))
def info(ctx: typer.Context) -> None:
    """Describe a model: layers, parameters, GFLOPs at imgsz, strides, classes: detrain info model=best.pt"""
    cfg = make_cfg(_args(ctx), "info")
    from detrain.api import Model
    from detrain.engine.build import check_exported, is_exported

    if is_exported(cfg.inputs.model):
        check_exported(cfg.inputs.model, "info")
    from detrain.nn.info import print_info

    model = Model(cfg.inputs.model, weights_sha256=cfg.inputs.weights_sha256)
    print_info(model.info(imgsz=cfg.inputs.imgsz, verbose=False), title=cfg.inputs.model, table=cfg.output.verbose)


@app.command()
def convert(
    src: str = typer.Argument(..., help="an Ultralytics (YOLOv8, YOLO11, YOLO26) or detrain .pt"),
    dst: str = typer.Argument(..., help="the detrain checkpoint to write"),
) -> None:
    """Convert an Ultralytics checkpoint into a detrain one that loads with torch.load(weights_only=True)."""
    from detrain.weights.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint

    ckpt = load_checkpoint(src)
    model_from_checkpoint(ckpt, source=src)  # a file detrain cannot build is refused here, not when it is used
    save_checkpoint({k: v for k, v in ckpt.items() if k not in ("format", "version", "date")}, dst)
    typer.echo(f"wrote {dst} ({ckpt['model']['scale']}, {ckpt['model']['nc']} classes)")


@app.command()
def checks() -> None:
    """Print the environment: versions, CUDA / NCCL / gloo availability and devices."""
    from detrain.system.env_report import report

    typer.echo(report())


@app.command()
def version() -> None:
    """Print detrain's version."""
    typer.echo(__version__)


def _one_line(message: str) -> str:
    """The message with anything unprintable escaped (a newline or escape code from a file name, bytes that are
    not UTF-8): the error stays one line and cannot forge others or fail to print."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


def command_first(argv: list[str]) -> list[str]:
    """The words in the order the commands read them, from Ultralytics' orders too: ``detect train k=v`` (the
    task first) and ``mode=train k=v`` (the command as a key) become ``train k=v`` (``mode=`` stays: it matches).

    >>> command_first(["detect", "train", "epochs=3"]), command_first(["task=detect", "mode=val", "data=a.yaml"])
    (['train', 'epochs=3'], ['val', 'task=detect', 'mode=val', 'data=a.yaml'])
    """
    words = list(argv)
    if words[:1] == [TASK]:
        words = words[1:]
    if words and "=" in words[0] and not words[0].startswith("-"):
        modes = [w.split("=", 1)[1].strip() for w in words if w.startswith("mode=")]
        if len(modes) == 1 and modes[0] in COMMAND_NAMES:
            words = [modes[0], *words]
    return words


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors become one line on stderr and exit code 2."""
    try:
        args = command_first(sys.argv[1:] if argv is None else argv)
        app(args=args, prog_name="detrain", standalone_mode=False)
    except DetrainError as e:
        typer.echo(f"error: {_one_line(str(e))}", err=True)
        sys.exit(2)
    except Preempted as e:  # saved where it stood on SIGTERM / SIGUSR1: the same command may run again
        typer.echo(_one_line(str(e)), err=True)
        sys.exit(EXIT_PREEMPTED)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as e:
        # the parser's own usage errors (no such command, a missing or extra argument); matched by name, as
        # typer may bring its own copy of click
        if not any(c.__name__ == "UsageError" for c in type(e).__mro__):
            raise
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `detrain`: the help, as `yolo` and click < 8.2 give it
            typer.echo(ctx.get_help() if ctx else "run 'detrain --help'")
            sys.exit(0)
        format_message = getattr(e, "format_message", None)  # every click UsageError has it
        message = " ".join(str(format_message() if callable(format_message) else e).split()).rstrip(".")
        typer.echo(f"error: {_one_line(message)}; run '{ctx.command_path if ctx else 'detrain'} --help'", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
