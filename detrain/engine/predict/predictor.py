"""``detrain predict``: detections on images, videos, cameras and streams; drawn, written as YOLO text, returned.

Pictures are letterboxed as validation letterboxes them (the long side to ``imgsz``, the short one padded to
the next multiple of the stride) and go through the model in batches of up to ``batch`` consecutive pictures
of the same letterboxed shape: a folder of same-sized photos or a video runs ``batch`` at a time, a mix of
shapes runs in smaller batches, and every picture is predicted exactly as it would be alone. A camera or
stream runs one frame at a time, as frames arrive.

:func:`stream_predict` yields one :class:`~detrain.engine.predict.results.Results` per picture and holds at most one
batch
in memory (the CLI uses it); :func:`predict` returns the list. Both check their arguments before the first
picture: a bad source, device or ``classes`` raises at once.

>>> import cv2
>>> from detrain.config.cfg import make_cfg
>>> _ = cv2.imwrite("a.png", np.zeros((48, 64, 3), np.uint8))
>>> cfg = make_cfg({"model": "n.yaml", "source": "a.png", "imgsz": 64, "device": "cpu", "save": False,
...                 "verbose": False})
>>> for r in stream_predict(cfg):  # a video gives one Results per frame, r.frame its number
...     print(r.path, r.frame, r.orig_shape, r.boxes.xyxy.shape[1:])
a.png None (48, 64) (4,)
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from detrain.config.cfg import Cfg
from detrain.config.values import image_hw
from detrain.data.frames import Frame, read_frames
from detrain.data.samples.augment import letterbox
from detrain.data.sources import Source, parse_source, shown
from detrain.distributed.launch.devices import parse_device
from detrain.engine.backends import ExportedModel, load_exported
from detrain.engine.build import (
    build_model,
    check_model,
    check_output_folder,
    increment_run_dir,
    is_exported,
    run_dir_problem,
)
from detrain.engine.predict.output import PredictionWriter
from detrain.engine.predict.results import Results, show_image
from detrain.engine.tta import augmented_forward, tta_problem
from detrain.errors import ConfigError, DatasetError
from detrain.log import console
from detrain.nn.boxes import scale_boxes_to_original
from detrain.nn.head import InferenceOptions, detections, set_inference
from detrain.system.process_env import has_display

PREDICT_CONF = 0.25
Batch = list[tuple[Frame, np.ndarray, float, tuple[int, int]]]  # (frame, letterboxed BGR, gain, (pad x, pad y))


def say(text: str) -> None:
    """One line on the console; file names are printed as they are, never read as rich markup."""
    console.print(text, markup=False, highlight=False)


def project_dir(cfg: Cfg) -> Path:
    """The folder predict's run folders go in (``runs/predict`` or ``project``): never read as a source."""
    return Path(cfg.output.project) if cfg.output.project else Path("runs") / "predict"


def inference_device(cfg: Cfg, note: bool = True) -> tuple[torch.device, bool]:
    """(device, half): the first device ``device`` names (the same rules as train and val: one clear line for a bad
    value); half precision only on CUDA (else a ``note``)."""
    device = torch.device(parse_device(cfg.distributed.device).device_for(0))
    return device, use_half(cfg, device, note)


def use_half(cfg: Cfg, device: torch.device, note: bool = True) -> bool:
    """Whether to predict in half precision on ``device``: ``half=True`` on CUDA only (elsewhere a ``note``)."""
    if cfg.predict.half and device.type != "cuda" and note:
        say(f"half=True runs on CUDA only; predicting in float32 on {device.type}")
    return cfg.predict.half and device.type == "cuda"


def prepare_model(model: nn.Module, device: torch.device, half: bool, copy_first: bool = True) -> nn.Module:
    """The model for inference: on ``device``, eval mode, BatchNorm folded, fp16 with ``half``, no gradients.

    ``copy_first`` leaves ``model`` itself untouched (``Model.net`` stays trainable and where it was)."""
    net = copy.deepcopy(model) if copy_first else model
    net = net.to(device).eval()
    fuse = getattr(net, "fuse", None)  # DetectionModel folds its BatchNorms; any other module stays as it is
    if callable(fuse):
        fuse()
    if half:
        net.half()
    net.requires_grad_(False)
    return net


def exported_half(cfg: Cfg, net: ExportedModel, half: bool) -> bool:
    """An exported graph runs in the float32 it was exported in: ``half=True`` is a note, not an error."""
    if half:
        say(f"half=True: {cfg.inputs.model} is an exported float32 graph; predicting in float32")
    return False


def input_shape(cfg: Cfg, net: nn.Module) -> tuple[tuple[int, int], bool]:
    """((h, w), auto) of the letterbox: ``imgsz`` (a rectangle ``[h, w]``, or the square of one size: each picture
    scaled to fit in it) with the short side padded only to the next multiple of the stride (``auto``), or the one
    input size of an exported graph that has one, padded to it whole (a line when ``imgsz`` says otherwise)."""
    fixed = net.fixed_imgsz if isinstance(net, ExportedModel) else None
    if fixed is None:
        return image_hw(cfg.inputs.imgsz), True
    if fixed != image_hw(cfg.inputs.imgsz):
        size = str(fixed[0]) if fixed[0] == fixed[1] else f"{fixed[0]},{fixed[1]}"
        say(
            f"note: {cfg.inputs.model} was exported at imgsz={size}: predicting at {size} (imgsz={cfg.inputs.imgsz} is "
            "not used; an exported model's input size is fixed)"
        )
    return fixed, False


def check_classes(classes: list[int] | None, names: dict[int, str]) -> None:
    """``classes`` must name classes the model has."""
    unknown = [c for c in classes or [] if c not in names]
    if unknown:
        raise ConfigError(
            f"invalid value for 'classes': {unknown} not among the model's {len(names)} classes (0 to {len(names) - 1})"
        )


def batches(
    frames: Iterable[Frame],
    size: int,
    shape: tuple[int, int],
    stride: int,
    auto: bool = True,
    letterbox_s: list[float] | None = None,
) -> Iterator[Batch]:
    """Consecutive frames letterboxed to ``shape`` (with ``auto``, padded only to a multiple of ``stride``) and
    grouped: up to ``size`` of one shape; a live source's frames alone. ``letterbox_s``: its one number grows by
    the seconds spent letterboxing (the caller reads and resets it per batch)."""
    pending: Batch = []
    for frame in frames:
        started = time.perf_counter()
        img, (gain, _), pad = letterbox(frame.image, shape, auto=auto, stride=stride)
        if letterbox_s is not None:
            letterbox_s[0] += time.perf_counter() - started
        if pending and pending[0][1].shape != img.shape:
            yield pending
            pending = []
        pending.append((frame, img, gain, pad))
        if len(pending) >= size or frame.item.live:
            yield pending
            pending = []
    if pending:
        yield pending


@torch.no_grad()
def infer(
    net: nn.Module,
    images: list[np.ndarray],
    device: torch.device,
    half: bool,
    conf: float,
    iou: float,
    max_det: int,
    classes: list[int] | None = None,
    agnostic: bool = False,
    times: dict[str, float] | None = None,
    augment: bool = False,
) -> list[torch.Tensor]:
    """Detections (n, 6: x1 y1 x2 y2 conf cls, float32, CPU) per letterboxed BGR image of one shape, in its pixels.
    ``times`` gets the seconds of each stage: ``preprocess`` (to a tensor), ``inference``, ``postprocess``;
    ``augment``: the forward at three scales and a flip (:mod:`detrain.engine.tta`), merged by the one NMS."""
    clock = [time.perf_counter()]

    def lap(stage: str) -> None:
        if times is not None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            clock.append(time.perf_counter())
            times[stage] = clock[-1] - clock[-2]

    x = torch.from_numpy(np.stack(images)).to(device)  # (B, H, W, 3) BGR uint8
    x = x.flip(-1).permute(0, 3, 1, 2)  # RGB, (B, 3, H, W) in channels-last memory, as validation feeds it
    x = (x.half() if half else x.float()).div_(255)
    lap("preprocess")
    preds = augmented_forward(net, x) if augment else net(x)
    if isinstance(preds, (tuple, list)):
        preds = preds[0]
    lap("inference")
    max_wh = max(7680, 2 * max(x.shape[2:]))  # class offsets in NMS must exceed any coordinate
    options = InferenceOptions(conf=conf, iou=iou, max_det=max_det, classes=classes, agnostic=agnostic, max_wh=max_wh)
    out = [d.float().cpu() for d in detections(net, preds, options)]
    lap("postprocess")
    return out


def stream_predict(
    cfg: Cfg,
    model: nn.Module | None = None,
    source: Any = None,
    *,
    prepared: bool = False,
    collecting: bool = False,
    device: torch.device | None = None,
) -> Generator[Results, None, None]:
    """Results one picture at a time for ``cfg`` (``source`` overrides ``cfg.predict.source``: a path, a list of them,
    image arrays). ``model``: a module to use instead of building ``cfg.inputs.model`` (copied first unless
    ``prepared``, see :func:`prepare_model`); ``device``: where it runs, as :func:`inference_device` resolved it
    (resolved here from ``cfg.distributed.device`` when not given). Arguments are checked here; pictures are read as the
    caller asks for results. Outputs go to ``runs/predict/<name>/`` when ``save`` or ``save_txt``."""
    project = project_dir(cfg)
    if device is None:
        device = inference_device(cfg, note=False)[0]  # the same device rules as train and val
    if model is None:  # the files predict names, before any picture is read or folder made
        check_model(cfg.inputs.model)
        if cfg.distributed.node_rank == 0:
            check_output_folder(cfg.output.project, "predict", cfg.output)
    src = parse_source(cfg.predict.source if source is None else source, exclude=project)
    half = use_half(cfg, device)
    if model is None and is_exported(cfg.inputs.model):
        model, prepared = load_exported(cfg.inputs.model, device, trust=cfg.inputs.trust_export), True
    if model is None:
        net = prepare_model(
            build_model(cfg.inputs.model, verbose=False, weights_sha256=cfg.inputs.weights_sha256)[0],
            device,
            half,
            copy_first=False,
        )
    else:
        net = model if prepared else prepare_model(model, device, half)
    if isinstance(net, ExportedModel):
        half = exported_half(cfg, net, half)
    set_inference(net, cfg.predict.max_det, cfg.predict.agnostic_nms, cfg.predict.nms)
    names = {int(k): str(v) for k, v in dict(getattr(net, "names", {})).items()}
    check_classes(cfg.inputs.classes, names)
    if collecting and any(item.is_video for item in src.items):
        say(
            "note: a video's results all stay in memory until it ends; predict(..., stream=True) gives them one "
            "frame at a time"
        )
    save_dir = (
        increment_run_dir(cfg.output.project, cfg.output.name, "predict", cfg.output.exist_ok)
        if _draws_files(cfg) or cfg.predict.save_txt or cfg.predict.save_crop
        else None
    )
    problem = run_dir_problem(save_dir) if save_dir is not None else None
    if problem is not None:
        raise ConfigError(problem)
    return _run(cfg, net, names, src, device, half, save_dir)


def _draws_files(cfg: Cfg) -> bool:
    """Whether the drawn pictures are written: ``save``, or ``show`` where no window can open (they are shown
    where they are saved)."""
    return cfg.output.save or (cfg.predict.show and not has_display())


def predict(cfg: Cfg, model: nn.Module | None = None, source: Any = None) -> list[Results]:
    """Every picture's :class:`Results`, in source order (see :func:`stream_predict`)."""
    return list(stream_predict(cfg, model, source, collecting=True))


def _run(
    cfg: Cfg,
    net: nn.Module,
    names: dict[int, str],
    src: Source,
    device: torch.device,
    half: bool,
    save_dir: Path | None,
) -> Generator[Results, None, None]:
    """The loop of :func:`stream_predict`: batches of pictures through ``net``, one :class:`Results` per picture,
    written to ``save_dir`` (kept whole when the caller stops early) with a line each when verbose."""
    conf = PREDICT_CONF if cfg.predict.conf is None else cfg.predict.conf
    stride = max(int(getattr(net, "stride", torch.tensor([32.0])).max()), 32)
    show: Callable[[str], None] = say if cfg.output.verbose else (lambda text: None)
    shape, auto = input_shape(cfg, net)
    order = {item: i for i, item in enumerate(src.items, 1)}
    p = cfg.predict
    writer, draw, augment = _prepare_output(cfg, net, src, save_dir)
    count, seconds, keep = 0, 0.0, False
    try:  # a generator: nothing read yet
        frames = read_frames(src, warn=say, max_pixels=cfg.inputs.max_pixels, vid_stride=p.vid_stride)
        letterbox_s = [0.0]
        for batch in batches(frames, cfg.train.batch_images, shape, stride, auto, letterbox_s):
            prep_s, letterbox_s[0] = letterbox_s[0], 0.0  # this batch's letterboxing (the next batch's not begun)
            start = time.perf_counter()
            times: dict[str, float] = {}
            dets = _infer_batch(cfg, net, batch, device, half, conf, times, augment)
            elapsed = time.perf_counter() - start
            seconds += elapsed
            for (frame, _, gain, pad), det in zip(batch, dets):
                result = _timed_result(frame, det, gain, pad, names, prep_s, times, len(batch))
                drawn = writer.add(frame, result) if writer is not None else None
                if p.show and has_display():
                    image = drawn if drawn is not None else result.plot(p.line_width, **draw)
                    show_image(str(result.path), image, 1 if frame.index is not None else 300)
                count += 1
                show(
                    f"{_where(frame, order[frame.item], len(src.items))}: {result.summary()}, "
                    f"{1000 * elapsed / len(batch):.1f}ms"
                )
                yield result
        if not count:
            raise DatasetError(
                f"source '{shown(str(cfg.predict.source))}': none of its {len(src.items)} image(s) or video(s) "
                "could be read"
            )
        keep = True
    except (KeyboardInterrupt, GeneratorExit):
        keep = True  # what was written until the user stopped is whole and worth keeping
        raise
    finally:
        if writer is not None:
            writer.close(keep)
        if count and cfg.output.verbose:
            say(
                f"{count} picture(s), {1000 * seconds / count:.1f}ms each (inference and NMS, batch up to "
                f"{cfg.train.batch})"
            )
        if save_dir is not None and save_dir.exists():
            say(f"results in {save_dir}")


def _timed_result(
    frame: Frame,
    det: torch.Tensor,
    gain: float,
    pad: tuple[int, int],
    names: dict[int, str],
    prep_s: float,
    times: dict[str, float],
    n: int,
) -> Results:
    """The picture's :class:`Results` with its ``speed``: its share of the batch's ``n`` pictures' letterboxing
    (``prep_s``) and of ``times`` (preprocess, inference, postprocess seconds), plus its own result's making."""
    started = time.perf_counter()
    result = _result(frame, det, gain, pad, names)
    result.speed = {
        "preprocess": 1000 * (prep_s + times["preprocess"]) / n,
        "inference": 1000 * times["inference"] / n,
        "postprocess": 1000 * (times["postprocess"] / n + time.perf_counter() - started),
    }
    return result


def _prepare_output(
    cfg: Cfg, net: nn.Module, src: Source, save_dir: Path | None
) -> tuple[PredictionWriter | None, dict[str, bool], bool]:
    """What :func:`_run` writes and how: the writer of ``save_dir``'s files (None without one), the drawing options,
    whether the forward is augmented (``augment``, where ``net`` can be); each a line said once (files skipped,
    augment not possible, show without a display)."""
    p = cfg.predict
    if src.skipped:
        first = ", ".join(src.skipped[:3]) + (", ..." if len(src.skipped) > 3 else "")
        say(f"skipped {len(src.skipped)} file(s) that are neither images nor videos: {first}")
    draw = {"boxes": p.show_boxes, "labels": p.show_labels, "conf": p.show_conf}
    writer = (
        PredictionWriter(
            save_dir, _draws_files(cfg), p.save_txt, p.save_conf, p.line_width, save_crop=p.save_crop, draw=draw
        )
        if save_dir
        else None
    )
    problem = tta_problem(net) if p.augment else None
    if problem is not None:
        say(f"note: augment=True: {problem}; predicting at one scale")
    if p.show and not has_display():
        say(f"show=True: no display here; the drawn pictures are saved in {save_dir}")
    return writer, draw, p.augment and problem is None


def _infer_batch(
    cfg: Cfg,
    net: nn.Module,
    batch: Batch,
    device: torch.device,
    half: bool,
    conf: float,
    times: dict[str, float] | None = None,
    augment: bool = False,
) -> list[torch.Tensor]:
    """The detections of a batch of letterboxed pictures, (n, 6) each on the letterboxed size, after NMS."""
    return infer(
        net,
        [img for _, img, _, _ in batch],
        device,
        half,
        conf,
        cfg.predict.iou,
        cfg.predict.max_det,
        cfg.inputs.classes,
        cfg.predict.agnostic_nms,
        times=times,
        augment=augment,
    )


def _result(frame: Frame, det: torch.Tensor, gain: float, pad: tuple[int, int], names: dict[int, str]) -> Results:
    """One picture's :class:`Results`, its boxes scaled back from the letterbox to the picture (in place)."""
    scale_boxes_to_original(det[:, :4], gain, pad, frame.image.shape[:2])
    d = det.numpy()
    return Results(
        frame.item.name,
        frame.index,
        frame.image.shape[:2],
        d[:, :4].copy(),
        d[:, 4].copy(),
        d[:, 5].astype(np.int64),
        dict(names),
        frame.image,
    )


def _where(frame: Frame, index: int, total: int) -> str:
    """``image 2/5 path``, ``video 1/1 (frame 3/120) path``, ``camera 0 (frame 3)``."""
    if frame.index is None:
        return f"image {index}/{total} {frame.item.name}"
    of = f"/{frame.total}" if frame.total else ""
    if frame.item.live:
        return f"{frame.item.name} (frame {frame.index + 1})"
    return f"video {index}/{total} (frame {frame.index + 1}{of}) {frame.item.name}"
