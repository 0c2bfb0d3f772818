"""The ``detrain`` command: train / val / predict / checks / convert / export, arguments as key=value.

    detrain train data=coco8.yaml model=n.yaml epochs=3 imgsz=320 device=cpu,cpu
    detrain val model=runs/train/exp/weights/best.pt data=coco8.yaml
    detrain predict model=best.pt source=images/      (or a video, a glob, a .txt list, a camera 0, rtsp://...)

A bad key or value prints one line and exits with code 2.
"""

from __future__ import annotations

import sys
from typing import Any

import typer

from detrain import __version__
from detrain.config import comments, defaults, make_cfg, parse_cli_args
from detrain.errors import DetrainError

_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": ["-h", "--help"]}


def _keys_help(keys: tuple[str, ...] | None = None) -> str:
    """The keys a command takes, with their defaults and comments from cfg/default.yaml."""
    notes = comments()
    lines = []
    for key, value in defaults().items():
        if keys is None or key in keys:
            lines.append(f"{key}={'' if value is None else value}  {notes.get(key, '')}")
    return "\n\n".join(lines)


app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, pretty_exceptions_enable=False,
                  help="Train YOLO-style object detectors on one or many devices and machines. "
                       "Arguments are key=value (or --key value); see 'detrain train --help' for every key.")


def _args(ctx: typer.Context, **fixed: Any) -> dict[str, Any]:
    return {**parse_cli_args(list(ctx.args)), **fixed}


@app.command(context_settings=_EXTRA, epilog=_keys_help())
def train(ctx: typer.Context) -> None:
    """Train a detector: detrain train data=coco8.yaml model=n.yaml epochs=3 device=0,1"""
    cfg = make_cfg(_args(ctx))
    from detrain.runner import run_task

    run_task("train", cfg)


@app.command(context_settings=_EXTRA, epilog=_keys_help(
    ("model", "data", "imgsz", "batch", "device", "split", "conf", "iou", "max_det", "save_json", "predictions",
     "plots", "project", "name", "exist_ok", "workers", "verbose")))
def val(ctx: typer.Context) -> None:
    """Evaluate weights (COCO-exact mAP): detrain val model=best.pt data=coco8.yaml device=cpu,cpu"""
    cfg = make_cfg(_args(ctx))
    from detrain.runner import run_task

    run_task("val", cfg)


@app.command(context_settings=_EXTRA, epilog=_keys_help(
    ("model", "source", "imgsz", "batch", "device", "half", "conf", "iou", "max_det", "classes", "agnostic_nms",
     "save", "save_txt", "save_conf", "line_width", "project", "name", "exist_ok", "verbose")))
def predict(ctx: typer.Context) -> None:
    """Detect objects in images, videos, cameras and streams: detrain predict model=best.pt source=path/to/images"""
    cfg = make_cfg(_args(ctx))
    from detrain.engine.predictor import stream_predict

    results = stream_predict(cfg)
    try:
        for _ in results:  # one picture at a time: a long video or a camera never piles up in memory
            pass
    finally:
        results.close()  # on Ctrl-C too: the video written so far is finished and kept


@app.command(context_settings=_EXTRA, epilog=_keys_help(("model", "format", "imgsz", "opset", "dynamic")))
def export(ctx: typer.Context) -> None:
    """Export weights to ONNX: detrain export model=best.pt format=onnx"""
    from detrain.model import Model

    args = _args(ctx)
    path = Model(args.pop("model", defaults()["model"])).export(**args)
    typer.echo(f"exported {path}")


@app.command()
def convert(src: str = typer.Argument(..., help="a YOLOv8 (Ultralytics) or detrain .pt"),
            dst: str = typer.Argument(..., help="the detrain checkpoint to write")) -> None:
    """Convert a YOLOv8 checkpoint into a detrain one that loads with torch.load(weights_only=True)."""
    from detrain.checkpoint import load_checkpoint, save_checkpoint

    ckpt = load_checkpoint(src)
    save_checkpoint({k: v for k, v in ckpt.items() if k not in ("format", "version", "date")}, dst)
    typer.echo(f"wrote {dst} ({ckpt['model']['scale']}, {ckpt['model']['nc']} classes)")


@app.command()
def checks() -> None:
    """Print the environment: versions, CUDA / NCCL / gloo availability and devices."""
    from detrain.env_report import report

    typer.echo(report())


@app.command()
def version() -> None:
    """Print detrain's version."""
    typer.echo(__version__)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors become one line on stderr and exit code 2."""
    try:
        app(args=argv, standalone_mode=False)
    except DetrainError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as e:  # the parser's own usage errors (no such command) are usage errors too
        if type(e).__name__ in ("UsageError", "NoSuchOption", "BadParameter", "MissingParameter") and hasattr(e, "show"):
            e.show()
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
