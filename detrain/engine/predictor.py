"""``detrain predict``: detections on images, drawn and written as YOLO-format text.

>>> from detrain.config import make_cfg
>>> results = predict(make_cfg({"model": "best.pt", "source": "images/"}))  # doctest: +SKIP
>>> results[0]["boxes"][0]   # [x1, y1, x2, y2] in the image's pixels                      # doctest: +SKIP
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

from detrain.boxes import scale_boxes_to_original
from detrain.config import Cfg
from detrain.data.augment import letterbox
from detrain.devices import parse_device
from detrain.engine.build import build_model, increment_run_dir, select_device
from detrain.engine.validator import predict_batch
from detrain.errors import ConfigError
from detrain.log import console
from detrain.palette import class_color
from detrain.preflight import check_inputs

IMAGE_SUFFIXES = {".bmp", ".dng", ".jpeg", ".jpg", ".mpo", ".png", ".tif", ".tiff", ".webp", ".pfm"}
PREDICT_CONF = 0.25


def list_sources(source: str) -> list[Path]:
    """An image file, a folder (its images, sorted) or a glob -> image paths."""
    if not source:
        raise ConfigError("predict needs source=<image, folder or glob>")
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    elif path.is_file():
        files = [path]
    else:
        files = sorted(Path(p) for p in glob.glob(source, recursive=True) if Path(p).suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ConfigError(f"source '{source}' has no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return files


def draw(img_bgr: np.ndarray, det: np.ndarray, names: dict[int, str], line_width: int = 0) -> np.ndarray:
    """Boxes with '<name> <score>' labels drawn on a copy of the image."""
    out = img_bgr.copy()
    lw = line_width or max(round(sum(out.shape[:2]) / 2 * 0.003), 2)
    for x1, y1, x2, y2, score, cls in det.tolist():
        color = class_color(int(cls))
        p1, p2 = (int(x1), int(y1)), (int(x2), int(y2))
        cv2.rectangle(out, p1, p2, color, lw, cv2.LINE_AA)
        label = f"{names.get(int(cls), str(int(cls)))} {score:.2f}"
        scale = lw / 3
        (tw, th), _ = cv2.getTextSize(label, cv2.FONT_HERSHEY_SIMPLEX, scale, max(lw - 1, 1))
        top = p1[1] - th - 3 >= 0
        x0 = max(0, min(p1[0], out.shape[1] - tw))  # keep the label inside the image
        q1, q2 = (x0, p1[1]), (x0 + tw, p1[1] - th - 3 if top else p1[1] + th + 3)
        cv2.rectangle(out, q1, q2, color, -1, cv2.LINE_AA)
        cv2.putText(out, label, (x0, p1[1] - 2 if top else p1[1] + th + 2), cv2.FONT_HERSHEY_SIMPLEX, scale,
                    (255, 255, 255), max(lw - 1, 1), cv2.LINE_AA)
    return out


def predict(cfg: Cfg, model: torch.nn.Module | None = None) -> list[dict[str, Any]]:
    """Run the model on every image of ``cfg.source``; writes runs/predict/<name>/ and returns plain data."""
    files = list_sources(cfg.source)
    parse_device(cfg.device)  # the same device rules as train and val: one clear line for a bad value
    check_inputs("predict", cfg)
    device = select_device(cfg.device if not isinstance(cfg.device, list) else cfg.device[0])
    if model is None:
        model, _ = build_model(cfg.model, weights_sha256=cfg.weights_sha256)
    model = model.to(device).eval()
    if hasattr(model, "fuse"):
        model.fuse()
    imgsz = cfg.imgsz
    conf = PREDICT_CONF if cfg.conf is None else cfg.conf
    save_dir = increment_run_dir(cfg.project, cfg.name, "predict", cfg.exist_ok)
    (save_dir / "labels").mkdir(parents=True, exist_ok=True)
    results = []
    for path in files:
        img0 = cv2.imread(str(path))
        if img0 is None:
            console.print(f"skipped {path}: not a readable image")
            continue
        img, ratio, pad = letterbox(img0, (imgsz, imgsz), auto=True, stride=32)
        tensor = torch.from_numpy(np.ascontiguousarray(img[:, :, ::-1].transpose(2, 0, 1)))[None]
        det = predict_batch(model, tensor, device, conf, cfg.iou, cfg.max_det)[0].float().cpu()
        scale_boxes_to_original(det[:, :4], float(ratio[0]), tuple(pad), img0.shape[:2])
        det_np = det.numpy()
        if cfg.save:
            cv2.imwrite(str(save_dir / path.name), draw(img0, det_np, model.names, cfg.line_width))
        if cfg.save_txt:
            _write_txt(save_dir / "labels" / f"{path.stem}.txt", det_np, img0.shape[:2], cfg.save_conf)
        results.append({"file": str(path), "boxes": det_np[:, :4].tolist(), "scores": det_np[:, 4].tolist(),
                        "classes": det_np[:, 5].astype(int).tolist(),
                        "names": [model.names.get(int(c), str(int(c))) for c in det_np[:, 5]]})
        if cfg.verbose:
            counts: dict[str, int] = {}
            for name in results[-1]["names"]:
                counts[name] = counts.get(name, 0) + 1
            console.print(f"{path.name}: " + (", ".join(f"{n} {k}" for k, n in counts.items()) or "no detections"))
    console.print(f"results in {save_dir}")
    return results


def _write_txt(path: Path, det: np.ndarray, shape_hw: tuple[int, int], with_conf: bool) -> None:
    h, w = shape_hw
    lines = []
    for x1, y1, x2, y2, score, cls in det.tolist():
        row = [int(cls), (x1 + x2) / 2 / w, (y1 + y2) / 2 / h, (x2 - x1) / w, (y2 - y1) / h]
        text = f"{row[0]} " + " ".join(f"{v:.6f}" for v in row[1:])
        lines.append(text + (f" {score:.5f}" if with_conf else ""))
    path.write_text("\n".join(lines) + ("\n" if lines else ""))
