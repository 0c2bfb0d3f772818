"""The head seam (:mod:`detrain.nn.head`): a yaml's module name picks the head from one registry, the head owns its
criterion (its gains as a mapping with their defaults), its loss item names, its postprocess, its output kind, its
class branches and its arguments for ``info``, and the engine reaches a head only through them.

Two heads stand behind the seam here: YOLOv8/YOLO11's ``Detect`` (DFL boxes, NMS) and YOLO26's ``DetectE2E`` (two
branches, the end-to-end loss, top-k without NMS). ``_e2e_model`` puts a ``DetectE2E`` on a YOLOv8n body, so these
tests hold for any body the builder makes. A third, registered from the tests' own files, trains in
``tests/integration/test_custom_head.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from _gains import DEFAULT_LOSS
from torch import nn

from detrain.engine.evaluate.validator import predict_batch
from detrain.engine.export import OUTPUTS
from detrain.errors import ConfigError
from detrain.nn.head import (
    OUTPUT_KINDS,
    InferenceOptions,
    detections,
    head_class,
    head_gains,
    register_head,
    registered_heads,
    set_inference,
)
from detrain.nn.head_e2e import DetectE2E
from detrain.nn.info import model_info
from detrain.nn.loss import DetectionLoss
from detrain.nn.loss_e2e import E2EHeadMaps, EndToEndLoss
from detrain.nn.model import DetectionModel, family, load_model_yaml
from detrain.nn.modules import Detect

PACKAGE = Path(__file__).resolve().parents[2] / "detrain"
# what only nn/ may name: the heads, their losses and decoders, and the loss item names
HEAD_WORDS = re.compile(
    r"\b(Detect|DetectE2E|DetectionLoss|EndToEndLoss|non_max_suppression|topk_detections|cv3|one2one_cv3)\b"
    r"|['\"](box|cls|dfl|l1)_loss['\"]"
)


def _e2e_model(nc: int = 2) -> DetectionModel:
    """A YOLOv8n body with YOLO26's end-to-end head in place of its Detect layer."""
    torch.manual_seed(0)
    m = DetectionModel("yolov8.yaml", scale="n", nc=nc)
    old = m.model[-1]
    ch = [branch[0].conv.in_channels for branch in old.cv2]
    new = DetectE2E(nc, ch, m.stride.tolist())
    new.f, new.i, new.type = old.f, old.i, "Detect"
    m.model[-1] = new
    return m


def _engine_code_lines() -> list[tuple[Path, int, str]]:
    """Every line of code (docstrings and comments left out) of the package outside ``nn/``."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "nn":
            continue
        source = path.read_text()
        docstrings = {
            n
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
            and isinstance(node.body[0].value.value, str)
            for n in range(node.body[0].lineno, (node.body[0].end_lineno or node.body[0].lineno) + 1)
        }
        for n, line in enumerate(source.splitlines(), 1):
            code = line.split("#", 1)[0]
            if n not in docstrings and code.strip():
                out.append((path.relative_to(PACKAGE), n, code))
    return out


def test_outside_nn_no_code_names_a_head_its_loss_or_its_decoder() -> None:
    found = [f"{p}:{n}: {code.strip()}" for p, n, code in _engine_code_lines() if HEAD_WORDS.search(code)]
    assert not found, "the engine must reach the head through DetectionModel's seam:\n" + "\n".join(found)


def test_the_scan_sees_engine_code() -> None:
    """The scan above reads the trainer's code (so a hard-coded loss name there would be found)."""
    lines = [code for p, _, code in _engine_code_lines() if p.as_posix() == "engine/train/trainer.py"]
    assert any("self.loss_names" in code for code in lines)
    assert HEAD_WORDS.search('LOSS_NAMES = ("box_loss", "cls_loss", "dfl_loss")')


def test_each_head_brings_its_own_criterion_and_loss_names() -> None:
    v8, e2e = DetectionModel("yolov8.yaml", scale="n", nc=2), _e2e_model()
    loss = {"box": 1.0, "cls": 2.0, "dfl": 3.0}  # the config's loss section, as the trainer passes it
    c8, ce = v8.criterion(loss, epochs=10, world_size=2), e2e.criterion(loss, epochs=10, world_size=2)
    assert isinstance(c8, DetectionLoss) and c8.gains == (1.0, 2.0, 3.0) and c8.world_size == 2
    assert isinstance(ce, EndToEndLoss) and ce.epochs == 10 and ce.world_size == 2
    assert ce.one2one.gains == (1.0, 2.0, 3.0)  # the dfl gain weighs the L1 term of a reg_max 1 head
    assert v8.loss_names == c8.item_names == ("box_loss", "cls_loss", "dfl_loss")
    assert e2e.loss_names == ce.item_names == ("box_loss", "cls_loss", "l1_loss")


def test_the_criterion_follows_the_epoch_through_the_seam() -> None:
    ce = _e2e_model().criterion(DEFAULT_LOSS, epochs=5)
    ce.set_epoch(0)
    first = ce.weights
    ce.set_epoch(4)
    assert first == pytest.approx((0.8, 0.2)) and ce.weights == pytest.approx((0.1, 0.9))
    DetectionModel(nc=1).criterion(DEFAULT_LOSS, epochs=5).set_epoch(3)  # no schedule: accepted, nothing changes


def test_training_the_e2e_model_reaches_its_loss_and_every_branch() -> None:
    m = _e2e_model().train()
    maps = m(torch.rand(2, 3, 64, 64))
    assert isinstance(maps, E2EHeadMaps)
    criterion = m.criterion(DEFAULT_LOSS, epochs=3)
    targets = criterion.assign(maps, torch.tensor([0.0, 1.0]), torch.tensor([[0.0], [1.0]]), torch.rand(2, 4) * 0.5)
    loss, items = criterion.score(targets, None, None)
    loss.backward()
    head = m.model[-1]
    assert items.shape == (3,) and torch.isfinite(loss)
    assert head.one2one_cv2[0][2].weight.grad is not None and head.cv3[0][2].weight.grad is not None


def test_postprocess_is_the_heads_own() -> None:
    x = torch.rand(2, 3, 64, 64)
    e2e = _e2e_model().eval()
    with torch.no_grad():
        out = e2e(x)
    assert out.shape == (2, 84, 6)  # top-k of every (anchor, class) pair: min(300, N) rows, already final
    dets = e2e.postprocess(out, InferenceOptions(conf=0.0, max_det=5))
    assert [d.shape for d in dets] == [(5, 6), (5, 6)]
    assert torch.equal(dets[0], out[0, :5])  # no NMS: the top-k, in order
    v8 = DetectionModel(nc=2).eval()
    with torch.no_grad():
        boxes = v8(x)
    assert boxes.shape == (2, 6, 84)
    assert all(len(d) <= 84 for d in v8.postprocess(boxes, InferenceOptions(conf=0.0, iou=0.5)))


def test_set_inference_shapes_the_end_to_end_output_and_nms_switches_branch() -> None:
    x = torch.rand(1, 3, 64, 64)
    m = _e2e_model().eval()
    with torch.no_grad():
        m.set_inference(max_det=7)
        assert m(x).shape == (1, 7, 6)
        m.set_inference(nms=True)
        boxes = m(x)  # the one-to-many branch, every anchor, for NMS
        assert boxes.shape == (1, 6, 84)
        nms_dets = m.postprocess(boxes, InferenceOptions(conf=0.0, iou=0.5, max_det=300))[0]
        assert 0 < len(nms_dets) < 84 * 2  # NMS removed overlapping boxes
        m.set_inference()
        assert m(x).shape == (1, 84, 6) and m.head.end2end


def test_validator_and_predictor_use_the_model_postprocess() -> None:
    m = _e2e_model().eval()
    imgs = torch.randint(0, 255, (2, 3, 64, 64), dtype=torch.uint8)
    set_inference(m, max_det=4)
    dets = predict_batch(m, imgs, torch.device("cpu"), conf=0.0, iou=0.7, max_det=4)
    with torch.no_grad():
        want = m(imgs.float() / 255)
    assert [d.shape for d in dets] == [(4, 6), (4, 6)]
    torch.testing.assert_close(torch.stack(dets), want)
    # a module without a postprocess of its own gives decoded boxes and scores: NMS
    plain = detections(nn.Identity(), DetectionModel(nc=2).eval()(imgs.float() / 255), InferenceOptions(conf=0.0))
    assert len(plain) == 2 and all(d.shape[1] == 6 for d in plain)


# ------------------------------------------------------------------------------------------------ the registry


def _yolo26_as(name: str) -> dict:
    """YOLO26n's yaml with its last row naming ``name`` and no ``end2end`` flag."""
    d, _ = load_model_yaml("yolo26n.yaml")
    d.pop("end2end")
    d["head"][-1][2] = name
    return d


def test_the_rows_module_name_picks_the_head_from_the_registry() -> None:
    assert head_class("Detect") is Detect and head_class("DetectE2E") is DetectE2E
    assert {"Detect", "DetectE2E"} <= set(registered_heads())
    torch.manual_seed(0)
    ultralytics_form = DetectionModel("yolo26n.yaml", nc=3)  # Ultralytics' spelling: Detect under end2end: True
    torch.manual_seed(0)
    named = DetectionModel(_yolo26_as("DetectE2E"), scale="n", nc=3)
    assert type(named.head) is type(ultralytics_form.head) is DetectE2E and named.family == "yolo26"
    want = ultralytics_form.state_dict()
    assert list(named.state_dict()) == list(want)  # the same parameter names, so checkpoints load by key
    assert all(torch.equal(v, want[k]) for k, v in named.state_dict().items())
    plain = DetectionModel(_yolo26_as("Detect"), scale="n", nc=3)  # no flag: YOLOv8's head on the YOLO26 body
    assert type(plain.head) is Detect and plain.family == "yolo11"
    assert family(_yolo26_as("DetectE2E")) == "yolo26"


def test_a_row_the_head_refuses_or_a_name_no_head_has_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"\(DetectE2E \[3\]\) cannot be built: an end-to-end head with reg_max 16"):
        DetectionModel({**_yolo26_as("DetectE2E"), "reg_max": 16}, scale="n", nc=3)
    with pytest.raises(ConfigError, match=r"unknown module 'Bogus'; known: .*Detect, DetectE2E"):
        DetectionModel(_yolo26_as("Bogus"), scale="n", nc=3)
    d, _ = load_model_yaml("yolov8n.yaml")
    d["head"][-1] = [-1, 1, "Conv", [64, 3, 1]]
    with pytest.raises(ConfigError, match=r"the last model layer must be Detect or another head \(Detect, DetectE2E"):
        DetectionModel(d, scale="n")


def test_register_head_refuses_what_is_no_head_and_a_taken_name() -> None:
    class Bare(nn.Module):
        pass

    with pytest.raises(TypeError, match=r"head Bare lacks from_row, decode, criterion"):
        register_head(Bare)
    with pytest.raises(TypeError, match=r"head name Detect is taken by detrain.nn.modules.Detect"):
        register_head(DetectE2E, "Detect")
    with pytest.raises(TypeError, match=r"an nn.Module class"):
        register_head(int)  # type: ignore[type-var]
    assert register_head(Detect) is Detect and head_class("Detect") is Detect  # again: nothing changes


def test_the_head_names_its_gains_with_their_defaults_and_takes_the_runs_values() -> None:
    for head in (Detect, DetectE2E):
        assert dict(head.loss_gains) == dict(DEFAULT_LOSS)  # the config's loss section: its defaults, one place
    model = DetectionModel(nc=2)
    assert head_gains(model.head, {**DEFAULT_LOSS, "box": 2.0, "obj": 9.0}) == {**DEFAULT_LOSS, "box": 2.0}
    assert model.criterion({**DEFAULT_LOSS, "cls": 4.0}, epochs=1).gains == (
        DEFAULT_LOSS["box"],
        4.0,
        DEFAULT_LOSS["dfl"],
    )

    class Own:  # a head with a gain the config does not hold keeps its own default for it
        loss_gains: ClassVar[dict[str, float]] = {"box": 1.0, "obj": 3.0}

    assert head_gains(Own(), DEFAULT_LOSS) == {"box": DEFAULT_LOSS["box"], "obj": 3.0}


def test_every_output_kind_a_head_may_give_is_one_export_writes_and_serves() -> None:
    assert set(OUTPUTS) == set(OUTPUT_KINDS) == {"boxes", "detections"}
    e2e = _e2e_model()
    assert DetectionModel(nc=2).head.output == "boxes" and e2e.head.output == "detections"
    e2e.set_inference(nms=True)
    assert e2e.head.output == "boxes"


def test_info_shows_the_heads_own_arguments() -> None:
    v8, e2e = model_info(DetectionModel(nc=2), 64), model_info(DetectionModel("yolo26n.yaml", nc=2), 64)
    assert v8.table[-1].args == [2, [64, 128, 256]] and e2e.table[-1].args == [2, [64, 128, 256], "end2end"]
