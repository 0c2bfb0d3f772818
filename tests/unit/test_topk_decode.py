"""NMS-free top-k decoding without Ultralytics: boxes from hand-made distances, the two-step top-k against a
brute-force one over every (anchor, class) pair, class-agnostic picks, and the confidence filter."""

from __future__ import annotations

import torch

from detrain.nn.topk_decode import decode_xyxy, filter_detections, topk_detections


def test_decode_places_each_level_s_anchors_in_pixels() -> None:
    maps = [torch.zeros(1, 4 + 2, 2, 2), torch.zeros(1, 4 + 2, 1, 1)]
    maps[0][0, :4, 1, 0] = torch.tensor([0.5, 1.0, 1.5, 2.0])  # row 1, column 0 of the stride-8 level
    maps[1][0, :4, 0, 0] = 1.0
    maps[1][0, 4 + 1, 0, 0] = 2.0
    out = decode_xyxy(maps, [8.0, 16.0])
    assert out.shape == (1, 6, 5)
    # anchor (0.5, 1.5) strides = (4, 12) px: x1 = 4 - 4, y1 = 12 - 8, x2 = 4 + 12, y2 = 12 + 16
    assert out[0, :4, 2].tolist() == [0.0, 4.0, 16.0, 28.0]
    assert out[0, :4, 4].tolist() == [-8.0, -8.0, 24.0, 24.0]  # the stride-16 anchor at (8, 8) px
    assert out[0, 4:, 4].tolist() == [0.5, torch.sigmoid(torch.tensor(2.0)).item()]


def test_two_step_topk_is_the_topk_over_every_anchor_and_class() -> None:
    gen = torch.Generator().manual_seed(0)
    preds = torch.rand(3, 4 + 7, 500, generator=gen)
    dets = topk_detections(preds, max_det=40)
    assert dets.shape == (3, 40, 6)
    for b in range(3):
        scores = preds[b, 4:].T  # (N, nc)
        top, flat = scores.flatten().topk(40)
        anchor, label = flat // 7, flat % 7
        torch.testing.assert_close(dets[b, :, 4], top, rtol=0, atol=0)
        assert dets[b, :, 5].tolist() == label.float().tolist()
        torch.testing.assert_close(dets[b, :, :4], preds[b, :4, anchor].T, rtol=0, atol=0)
    assert bool((dets[..., 4][:, :-1] >= dets[..., 4][:, 1:]).all())  # best first


def test_agnostic_gives_each_anchor_once_with_its_best_class() -> None:
    gen = torch.Generator().manual_seed(1)
    preds = torch.rand(2, 4 + 5, 60, generator=gen)
    dets = topk_detections(preds, max_det=20, agnostic=True)
    for b in range(2):
        best, labels = preds[b, 4:].max(0)
        top, anchor = best.topk(20)
        assert dets[b, :, 4].tolist() == top.tolist()
        assert dets[b, :, 5].tolist() == labels[anchor].float().tolist()
        assert len({tuple(r) for r in dets[b, :, :4].tolist()}) == 20  # 20 distinct anchors


def test_fewer_anchors_than_max_det_and_the_confidence_filter() -> None:
    preds = torch.zeros(2, 4 + 2, 3)
    preds[0, 4] = torch.tensor([0.9, 0.25, 0.1])  # 0.25 is among the top 3 pairs, but not above 0.25
    preds[0, 5] = torch.tensor([0.0, 0.6, 0.0])
    dets = topk_detections(preds, max_det=300)
    assert dets.shape == (2, 3, 6)
    out = filter_detections(dets, conf_thres=0.25)
    assert dets[0, :, 4].tolist() == torch.tensor([0.9, 0.6, 0.25]).tolist()
    assert [d[:, 4].tolist() for d in out] == [torch.tensor([0.9, 0.6]).tolist(), []]
    assert out[0][:, 5].tolist() == [0.0, 1.0]
    assert out[1].shape == (0, 6)
    assert [len(d) for d in filter_detections(dets, conf_thres=0.0, max_det=2)] == [2, 0]
    assert filter_detections(dets, conf_thres=0.25, classes=[1])[0][:, 5].tolist() == [1.0]
    assert filter_detections(dets.half())[0].dtype == torch.float32
