"""YOLO26 pieces against Ultralytics 8.4: the end-to-end loss (value and every input gradient, at several points
of its branch schedule), the NMS-free top-k decode, MuSGD (parameters after a few steps; groups, lr and momentum
per iteration) and the end-to-end head's forward.

Runs only where Ultralytics is importable (it is never a dependency; e.g. ``PYTHONPATH=$PWD:/opt/ulib python -m
pytest tests/unit/test_parity_e2e.py``); the same modules' properties are tested without it in
``test_loss_e2e.py``, ``test_topk_decode.py``, ``test_musgd.py`` and ``test_head_e2e.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from _gains import DEFAULT_GAINS
from _ultralytics import offline_ultralytics
from torch import nn

from detrain.nn.loss_e2e import E2EHeadMaps, EndToEndLoss

NC, IMGSZ, BATCH, EPOCHS = 6, 128, 3, 10
STRIDES = (8.0, 16.0, 32.0)


@pytest.fixture(scope="module")
def ul(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    with offline_ultralytics(tmp_path_factory):
        from ultralytics.cfg import get_cfg
        from ultralytics.nn.modules.head import Detect
        from ultralytics.utils.loss import E2ELoss

        yield SimpleNamespace(get_cfg=get_cfg, Detect=Detect, E2ELoss=E2ELoss)


def _labels(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Flat labels: sides from 3 px (below the 16 px middle stride) to 66 px, an empty image and a crowded one."""
    idx, cls, boxes = [], [], []
    for i, k in enumerate((7, 0, 16)):
        side = torch.exp(torch.empty(k, 2).uniform_(1.1, 4.2, generator=gen)) / IMGSZ
        centre = torch.rand(k, 2, generator=gen) * (1 - side) + side / 2
        idx.append(torch.full((k,), float(i)))
        cls.append(torch.randint(0, NC, (k, 1), generator=gen).float())
        boxes.append(torch.cat((centre, side), 1))
    return {"batch_idx": torch.cat(idx), "cls": torch.cat(cls), "bboxes": torch.cat(boxes)}


def _branch_leaves(gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One branch's raw outputs per level as leaves: ltrb distances of 0.3..4.3 strides, class logits near -2."""
    boxes, scores = [], []
    for s in STRIDES:
        side = int(IMGSZ // s)
        boxes.append((torch.rand(BATCH, 4, side, side, generator=gen) * 4 + 0.3).requires_grad_())
        scores.append((torch.randn(BATCH, NC, side, side, generator=gen) * 2 - 2).requires_grad_())
    return boxes, scores


@pytest.mark.parametrize("epoch", [0, 1, 4, EPOCHS - 1])
@pytest.mark.parametrize("seed", [0, 1])
def test_e2e_loss_and_every_input_gradient_agree_with_ultralytics(ul: SimpleNamespace, epoch: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    leaves = {"one2many": _branch_leaves(gen), "one2one": _branch_leaves(gen)}
    batch = _labels(gen)

    # theirs: E2ELoss reads the Detect head (strides, nc, reg_max) and the hyperparameters off a model
    head = ul.Detect(nc=NC, reg_max=1, end2end=True, ch=(8, 8, 8))
    head.stride = torch.tensor(STRIDES)
    holder = nn.Module()
    holder.model = nn.ModuleList([head])
    holder.args = ul.get_cfg(overrides={"epochs": EPOCHS})
    theirs = ul.E2ELoss(holder)
    for _ in range(epoch):  # the trainer calls update() at every epoch's end
        theirs.update()
    preds = {
        name: {
            "boxes": torch.cat([b.view(BATCH, 4, -1) for b in boxes], -1),
            "scores": torch.cat([s.view(BATCH, NC, -1) for s in scores], -1),
            "feats": [b.detach() for b in boxes],
        }
        for name, (boxes, scores) in leaves.items()
    }
    their_loss, their_items = theirs(preds, batch)
    their_loss.sum().backward()
    every_leaf = [t for boxes, scores in leaves.values() for t in boxes + scores]
    their_grads = [t.grad.clone() for t in every_leaf]
    for t in every_leaf:
        t.grad = None

    ours = EndToEndLoss(NC, STRIDES, epochs=EPOCHS, gains=DEFAULT_GAINS)
    ours.set_epoch(epoch)
    maps = E2EHeadMaps(*([torch.cat(pair, 1) for pair in zip(*leaves[name])] for name in ("one2many", "one2one")))
    our_loss, our_items = ours(maps, batch["batch_idx"], batch["cls"], batch["bboxes"])
    our_loss.backward()

    assert ours.weights == pytest.approx((theirs.o2m, theirs.o2o), abs=1e-12)
    assert tuple(their_items) == ("box_loss", "cls_loss", "l1_loss") == ours.item_names
    torch.testing.assert_close(our_items, torch.stack(list(their_items.values())), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(our_loss.detach(), their_loss.detach().sum(), rtol=1e-5, atol=1e-5)
    for ours_grad, ref in zip((t.grad for t in every_leaf), their_grads):
        assert ours_grad is not None
        scale = float(ref.abs().max()) or 1.0
        assert float((ours_grad - ref).abs().max()) <= 1e-5 * scale + 1e-9


@pytest.mark.parametrize("agnostic", [False, True])
@pytest.mark.parametrize("max_det", [300, 17])
def test_topk_decode_agrees_with_ultralytics_end_to_end_postprocess(
    ul: SimpleNamespace, max_det: int, agnostic: bool
) -> None:
    from ultralytics.utils.nms import non_max_suppression

    torch.manual_seed(0)
    head = ul.Detect(nc=NC, reg_max=1, end2end=True, ch=(8, 16, 32)).eval()
    head.stride = torch.tensor(STRIDES)
    head.end2end, head.max_det, head.agnostic_nms = True, max_det, agnostic
    gen = torch.Generator().manual_seed(1)
    feats = [torch.randn(2, c, IMGSZ // int(s), IMGSZ // int(s), generator=gen) for c, s in zip((8, 16, 32), STRIDES)]
    with torch.no_grad():
        their_dets, raw = head(feats)
    # the one-to-one branch's raw outputs, back into per-level maps
    sizes = [f.shape[2] * f.shape[3] for f in feats]
    o2o = torch.cat((raw["one2one"]["boxes"], raw["one2one"]["scores"]), 1).split(sizes, 2)
    maps = [m.reshape(2, 4 + NC, *f.shape[2:]) for m, f in zip(o2o, feats)]

    from detrain.nn.topk_decode import decode_xyxy, filter_detections, topk_detections

    ours = topk_detections(decode_xyxy(maps, STRIDES), max_det=max_det, agnostic=agnostic)
    assert ours.shape == their_dets.shape == (2, min(max_det, sum(sizes)), 6)
    torch.testing.assert_close(ours[..., 4:], their_dets[..., 4:], rtol=0, atol=0)  # scores and classes
    torch.testing.assert_close(ours[..., :4], their_dets[..., :4], rtol=1e-6, atol=1e-4)
    for q in (0.3, 0.8):  # thresholds that keep some of the top-k and drop the rest
        conf = float(their_dets[0, :, 4].quantile(q))
        theirs = non_max_suppression(their_dets, conf, 0.7, max_det=max_det, end2end=True)
        mine = filter_detections(ours, conf, max_det)
        assert [len(d) for d in mine] == [len(d) for d in theirs] and 0 < len(mine[0]) < min(max_det, sum(sizes))
        for d, t in zip(mine, theirs):
            torch.testing.assert_close(d, t, rtol=1e-6, atol=1e-4)


class _TinyHead(nn.Module):
    """The head's names that MuSGD's groups look for: box branches ``cv2``, class branches ``cv3`` and
    ``one2one_cv3`` (3x lr)."""

    def __init__(self) -> None:
        super().__init__()
        self.cv2 = nn.ModuleList([nn.Conv2d(8, 4, 1)])
        self.cv3 = nn.ModuleList([nn.Sequential(nn.Conv2d(8, 8, 3, groups=8), nn.BatchNorm2d(8), nn.Conv2d(8, 6, 1))])
        self.one2one_cv3 = nn.ModuleList([nn.Sequential(nn.Conv2d(8, 6, 1))])


class _Tiny(nn.Module):
    """Shapes that share a batched orthogonalisation (8 columns: 40 and 4 rows, padded and transposed), one that
    stands alone (3 rows beside 64: more than 16x), a matrix and a 1-D weight that is no norm's."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Conv2d(3, 8, 3, bias=False),
            nn.BatchNorm2d(8),
            nn.Conv2d(8, 40, 1),
            nn.Conv2d(40, 8, 3),
            nn.Conv2d(8, 4, 1, bias=False),
            nn.Conv2d(8, 64, 1, bias=False),
            nn.Conv2d(8, 3, 1, bias=False),
            nn.Linear(8, 24),
            _TinyHead(),
        )
        self.scale = nn.Parameter(torch.ones(8))


def _their_optimizer(ul_trainer, model: nn.Module, name: str, iterations: int, decay: float):
    """``BaseTrainer.build_optimizer`` unbound, with a stand-in ``self`` (it reads and may rewrite ``args``)."""
    args = SimpleNamespace(optimizer=name, lr0=0.02, warmup_bias_lr=0.1)
    stand_in = SimpleNamespace(args=args, data={"nc": 6})
    opt = ul_trainer.build_optimizer(
        stand_in, model=model, name=name, lr=0.02, momentum=0.937, decay=decay, iterations=iterations
    )
    return opt, args


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_musgd_groups_and_steps_agree_with_ultralytics(ul: SimpleNamespace, layout: torch.memory_format) -> None:
    from ultralytics.engine.trainer import BaseTrainer

    from detrain.config.cfg import make_cfg
    from detrain.engine.train.recipe.musgd import apply_group_warmup, build_musgd
    from detrain.engine.train.recipe.optim import auto_choice

    torch.manual_seed(0)
    theirs_model = _Tiny().to(memory_format=layout)
    ours_model = _Tiny().to(memory_format=layout)
    ours_model.load_state_dict(theirs_model.state_dict())

    # optimizer=auto over a long run: both pick MuSGD at lr 0.01, momentum 0.9; the same groups in the same order
    their_opt, args = _their_optimizer(BaseTrainer, theirs_model, "auto", 20_000, 0.05)
    name, lr, momentum = auto_choice(make_cfg({"optimizer": "auto"}), 6, 20_000)
    assert (name, lr) == (args.optimizer, args.lr0) and type(their_opt).__name__ == "MuSGD"
    our_opt = build_musgd(ours_model, lr, momentum, 0.05, head=ours_model.model[-1])
    assert (our_opt.muon, our_opt.sgd) == (their_opt.muon, their_opt.sgd)
    index = {id(p): i for i, p in enumerate(theirs_model.parameters())}
    our_index = {id(p): i for i, p in enumerate(ours_model.parameters())}
    assert len(our_opt.param_groups) == len(their_opt.param_groups) == 8
    for ours_group, their_group in zip(our_opt.param_groups, their_opt.param_groups):
        assert [our_index[id(p)] for p in ours_group["params"]] == [index[id(p)] for p in their_group["params"]]
        for key in ("lr", "momentum", "weight_decay", "nesterov", "use_muon", "param_group"):
            assert ours_group[key] == their_group[key], (key, their_group["param_group"])
    assert sum(len(g["params"]) for g in our_opt.param_groups) == len(list(ours_model.parameters()))
    assert any(len(g["params"]) for g in our_opt.param_groups if g["lr"] == 3 * lr and g["use_muon"])

    # a few steps from the same gradients, lr and momentum moving as in warmup: the same parameters
    for group in their_opt.param_groups:
        group["initial_lr"] = group["lr"]  # what their LambdaLR sets
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        apply_group_warmup(our_opt, step + 1, 4, 0.9, bias_lr_start=0.1, momentum_start=0.8, momentum=0.937)
        for ours_group, their_group in zip(our_opt.param_groups, their_opt.param_groups):
            their_group["lr"], their_group["momentum"] = ours_group["lr"], ours_group["momentum"]
        for p, q in zip(ours_model.parameters(), theirs_model.parameters()):
            g = torch.randn(p.shape, generator=gen).to(
                memory_format=layout if p.dim() == 4 else torch.contiguous_format
            )
            p.grad, q.grad = g.clone(), g.clone()
        our_opt.step()
        their_opt.step()
        for (name_, p), q in zip(ours_model.named_parameters(), theirs_model.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=f"step {step}: {name_}")


def test_e2e_head_loads_ultralytics_yolo26_head_by_key_and_gives_its_outputs(ul: SimpleNamespace) -> None:
    from ultralytics.nn.tasks import DetectionModel

    from detrain.nn.head_e2e import DetectE2E

    torch.manual_seed(0)
    theirs = DetectionModel("yolo26n.yaml", nc=NC, verbose=False).model[-1]
    ch = tuple(branch[0].conv.in_channels for branch in theirs.cv2)
    ours = DetectE2E(NC, ch=ch, strides=theirs.stride.tolist())
    with torch.no_grad():  # away from the init, running statistics included, so every weight matters
        for key, t in theirs.state_dict().items():
            if t.is_floating_point():
                t.add_(torch.randn(t.shape) * 0.05)
                if key.endswith("running_var"):
                    t.abs_()
    missing, unexpected = ours.load_state_dict(theirs.state_dict(), strict=True)
    assert not missing and not unexpected

    gen = torch.Generator().manual_seed(2)
    feats = [torch.randn(2, c, IMGSZ // int(s), IMGSZ // int(s), generator=gen) for c, s in zip(ch, STRIDES)]
    their_in = [f.clone().requires_grad_() for f in feats]
    our_in = [f.clone().requires_grad_() for f in feats]
    their_raw = theirs.train()(their_in)
    our_maps = ours.train()(our_in)
    sizes = [f.shape[2] * f.shape[3] for f in feats]
    weights = {}
    total_theirs, total_ours = 0.0, 0.0
    for name in ("one2many", "one2one"):
        raw = torch.cat((their_raw[name]["boxes"], their_raw[name]["scores"]), 1).split(sizes, 2)
        for level, (t, o) in enumerate(zip(raw, getattr(our_maps, name))):
            t = t.reshape(o.shape)
            torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-5)
            w = weights.setdefault((name, level), torch.randn(o.shape, generator=gen))
            total_theirs = total_theirs + (t * w).sum()
            total_ours = total_ours + (o * w).sum()
    total_theirs.backward()
    total_ours.backward()
    for a, b in zip(our_in, their_in):  # the one-to-one branch reads detached features in both
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)
    their_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, their_params[name].grad, rtol=1e-4, atol=1e-5, msg=name)

    theirs.eval().end2end = True
    theirs.max_det = ours.max_det = 50
    with torch.no_grad():
        their_dets, _ = theirs(feats)
        our_dets = ours.eval()(feats)
    torch.testing.assert_close(our_dets, their_dets, rtol=1e-5, atol=1e-4)
    ours.end2end = theirs.end2end = False
    with torch.no_grad():
        their_decoded, _ = theirs(feats)
        torch.testing.assert_close(ours(feats), their_decoded, rtol=1e-5, atol=1e-4)
