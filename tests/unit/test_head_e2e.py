"""DetectE2E without Ultralytics: what training and inference return, the detached one-to-one branch, the
state-dict names a YOLO26 checkpoint uses, and a class-count reset of both branches."""

from __future__ import annotations

import torch
from _gains import DEFAULT_GAINS

from detrain.nn.head_e2e import DetectE2E
from detrain.nn.loss_e2e import E2EHeadMaps, EndToEndLoss
from detrain.nn.topk_decode import decode_xyxy, topk_detections

CH, STRIDES = (16, 32, 64), (8.0, 16.0, 32.0)


def _feats(batch: int = 2, size: int = 64, grad: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(batch, c, size // int(s), size // int(s), generator=gen).requires_grad_(grad)
        for c, s in zip(CH, STRIDES)
    ]


def test_training_returns_both_branches_maps_and_the_one_to_one_branch_reads_detached_features() -> None:
    head = DetectE2E(nc=3, ch=CH, strides=STRIDES).train()
    feats = _feats(grad=True)
    out = head(feats)
    assert isinstance(out, E2EHeadMaps)
    assert (
        [m.shape for m in out.one2one]
        == [m.shape for m in out.one2many]
        == [
            torch.Size([2, 7, 8, 8]),
            torch.Size([2, 7, 4, 4]),
            torch.Size([2, 7, 2, 2]),
        ]
    )
    sum(m.sum() for m in out.one2one).backward()
    assert all(f.grad is None for f in feats)  # the one-to-one loss never reaches the features
    assert all(p.grad is not None for p in head.one2one_cv3.parameters())
    assert all(p.grad is None for p in head.cv3.parameters())
    sum(m.sum() for m in out.one2many).backward()
    assert all(f.grad is not None for f in feats)


def test_inference_is_the_top_k_of_the_one_to_one_branch() -> None:
    head = DetectE2E(nc=3, ch=CH, strides=STRIDES, max_det=20).eval()
    with torch.no_grad():
        dets = head(_feats())
        expected = topk_detections(decode_xyxy(head.branch_maps(_feats(), one2one=True), STRIDES), 20)
    assert dets.shape == (2, 20, 6)
    torch.testing.assert_close(dets, expected, rtol=0, atol=0)
    head.max_det = 500  # more than the 84 anchors: every anchor's best pairs, still a fixed shape
    with torch.no_grad():
        assert head(_feats()).shape == (2, 84, 6)
    head.end2end = False
    with torch.no_grad():
        assert head(_feats()).shape == (2, 4 + 3, 84)  # the one-to-many branch, decoded for NMS


def test_state_dict_names_are_yolo26_s_and_the_loss_takes_the_training_output() -> None:
    head = DetectE2E(nc=3, ch=CH, strides=STRIDES)
    keys = set(head.state_dict())
    for key in (
        "cv2.0.0.conv.weight",
        "cv2.2.2.bias",
        "cv3.1.0.0.conv.weight",
        "cv3.1.1.1.bn.running_var",
        "one2one_cv2.0.1.bn.weight",
        "one2one_cv3.2.2.weight",
    ):
        assert key in keys, key
    assert not any(k.startswith("stride") or "dfl" in k for k in keys)
    assert head.cv3[0][0][0].conv.groups == 16  # depthwise
    loss, items = EndToEndLoss(3, STRIDES, epochs=2, gains=DEFAULT_GAINS)(
        head.train()(_feats()), torch.zeros(1), torch.ones(1, 1), torch.tensor([[0.5, 0.5, 0.3, 0.3]])
    )
    loss.backward()
    assert torch.isfinite(loss) and items.shape == (3,)
    assert all(p.grad is not None for p in head.parameters())


def test_reset_classes_changes_both_branches() -> None:
    head = DetectE2E(nc=80, ch=CH, strides=STRIDES)
    head.reset_classes(2)
    assert {b[2].out_channels for b in head.cv3} | {b[2].out_channels for b in head.one2one_cv3} == {2}
    assert head.train()(_feats()).one2one[0].shape[1] == 6
