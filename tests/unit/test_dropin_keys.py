"""Ultralytics' spellings that detrain takes as Ultralytics means them (issue 38 item 3): device=-1, freeze by
name, half for val and export, imgsz=[h, w]; each refused in one line where the meaning does not carry over."""

from __future__ import annotations

import pytest
import torch

from detrain.config.cfg import make_cfg
from detrain.config.keys import ULTRALYTICS_ONLY
from detrain.distributed.launch import devices
from detrain.errors import ConfigError


def _fake_gpus(monkeypatch, free_total, busy=None):
    """``free_total``: (free, total) bytes per visible GPU; ``busy``: utilisation per GPU, or None (no NVML)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(free_total))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(free_total))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: free_total[i])

    def utilization(i):
        if busy is None:
            raise ModuleNotFoundError("pynvml")
        return busy[i]

    monkeypatch.setattr(torch.cuda, "utilization", utilization)


def test_device_minus_one_without_a_gpu_runs_on_the_cpu_with_one_line(monkeypatch, capsys):
    _fake_gpus(monkeypatch, [])
    for given in (-1, "-1", [-1], "-1,-1"):
        cfg = make_cfg({"device": given}, "val")
        assert cfg.distributed.device == ""  # the default device: the CPU here, as Ultralytics falls back
        lines = capsys.readouterr().out.strip().splitlines()
        assert len(lines) == 1 and "no CUDA GPU here" in lines[0] and "using the CPU" in lines[0], lines
    assert devices.parse_device(make_cfg({"device": -1}).distributed.device).kind == "cpu"


def test_device_minus_one_picks_the_idlest_gpu_with_memory_free(monkeypatch, capsys):
    gib = 2**30
    # GPU 0: busy; GPU 1: idle but 10% free (too full); GPU 2: idle, most free; GPU 3: idle, less free
    _fake_gpus(monkeypatch, [(50 * gib, 80 * gib), (8 * gib, 80 * gib), (70 * gib, 80 * gib), (40 * gib, 80 * gib)])
    monkeypatch.setattr(torch.cuda, "utilization", lambda i: [90, 0, 0, 0][i])
    assert make_cfg({"device": -1}, "predict").distributed.device == "2"
    assert "cuda:2" in capsys.readouterr().out
    assert make_cfg({"device": "-1,-1"}, "train").distributed.device == "2,3"
    assert make_cfg({"device": "2,-1"}, "train").distributed.device == "2,3"  # a GPU named is not picked again
    # no utilisation to ask (no NVML): free memory alone ranks them
    _fake_gpus(monkeypatch, [(50 * gib, 80 * gib), (70 * gib, 80 * gib)])
    assert make_cfg({"device": -1}, "val").distributed.device == "1"
    # none with 20% free: dropped as Ultralytics drops it, the default device runs, one line says so
    _fake_gpus(monkeypatch, [(1 * gib, 80 * gib)])
    capsys.readouterr()
    assert make_cfg({"device": -1}, "val").distributed.device == ""
    out = capsys.readouterr().out
    assert "0 of the 1 GPU(s)" in out and "default device" in out


def test_other_devices_are_left_as_given():
    assert make_cfg({"device": "cpu,cpu"}, "train").distributed.device == "cpu,cpu"
    assert make_cfg({"device": 0}, "train").distributed.device == 0
    assert devices.resolve_idle("cpu,,") == ("cpu,,", "")  # parse_device's own line names what is wrong


def test_freeze_takes_ultralytics_names_below_a_layer():
    assert make_cfg({"freeze": "[0, 22.cv3]"}).train.freeze == [0, "22.cv3"]
    assert make_cfg({"freeze": ["model.22.cv2", 1]}).train.freeze == [1, "22.cv2"]
    assert make_cfg({"freeze": 10}).train.freeze == 10  # a count and indices as before
    assert make_cfg({"freeze": "0,1,2"}).train.freeze == [0, 1, 2]
    with pytest.raises(ConfigError, match=r"invalid value for 'freeze': '22\.c-v3'.*no layer's name"):
        make_cfg({"freeze": "22.c-v3"})


def test_freeze_by_name_fixes_only_those_parameters():
    from detrain.engine.train.freeze import freeze_layers, parameter_names
    from detrain.nn.model import DetectionModel

    model = DetectionModel(nc=2)
    touched = freeze_layers(model, make_cfg({"freeze": "0,22.cv3"}).train.freeze)
    assert touched == [0, 22]
    fixed = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert {n for n in fixed if n.startswith("model.22.")} == {
        n for n, _ in model.named_parameters() if n.startswith(("model.22.cv3.", "model.22.dfl."))
    }
    assert all(p.requires_grad for n, p in model.named_parameters() if n.startswith("model.22.cv2."))
    assert parameter_names(model, touched) == fixed  # the EMA copies exactly these
    with pytest.raises(ConfigError, match=r"'22\.cv9' names no parameter of the model \(layer 22 holds cv2, cv3"):
        freeze_layers(DetectionModel(nc=2), ["22.cv9"])
    with pytest.raises(ConfigError, match="not layer 40"):
        freeze_layers(DetectionModel(nc=2), ["40.cv1"])


def test_working_keys_are_no_longer_listed_as_ultralytics_only():
    from detrain.config.keys import SECTION_OF

    assert not ULTRALYTICS_ONLY & set(SECTION_OF)


# --- augment: test-time augmentation ---------------------------------------------------------------------------


class WhiteSquare(torch.nn.Module):
    """Every anchor of every level answers with the bounding box (xywh) of the white pixels it is given, score 0.9:
    what a pass sees, in the pixels of its own (scaled, flipped) input, in a detector's inference layout."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stride", torch.tensor([8.0, 16.0, 32.0]))
        self.seen: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(tuple(x.shape[2:]))
        h, w = x.shape[2:]
        n = sum((h // s) * (w // s) for s in (8, 16, 32))
        ys, xs = torch.nonzero((x[0] > 0.9).all(0), as_tuple=True)
        x1, x2, y1, y2 = float(xs.min()), float(xs.max()) + 1, float(ys.min()), float(ys.max()) + 1
        row = torch.tensor([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1, 0.9])
        return row[None, :, None].expand(x.shape[0], 5, n).clone()


def test_augmented_forward_brings_every_pass_back_to_the_input_pixels():
    from detrain.engine.tta import augmented_forward

    x = torch.zeros(1, 3, 128, 192)
    x[:, :, 20:60, 30:90] = 1.0  # a white box at x 30-90, y 20-60: off centre, so a flip not undone shows
    net = WhiteSquare()
    out = augmented_forward(net, x)
    assert net.seen == [(128, 192), (128, 160), (96, 160)]  # 1, 0.83 (106 x 159 padded), 0.67 (85 x 128 padded)
    n1, n2, n3 = (sum((h // s) * (w // s) for s in (8, 16, 32)) for h, w in net.seen)
    assert out.shape == (1, 5, n1 - n1 // 21 + n2 + n3 - (n3 // 21) * 16)  # the tails Ultralytics cuts
    boxes = out[0, :4].T
    want = torch.tensor([60.0, 40.0, 60.0, 40.0])  # xywh of the white box
    assert (boxes - want).abs().max() < 2.0, boxes.unique(dim=0)  # every pass's box, de-scaled and de-flipped


def test_descale_undoes_the_scale_and_the_left_right_flip():
    from detrain.engine.tta import descale

    # a box at x 100 (centre), y 50, 20 x 10 in a 640-wide input, seen in the flipped pass at 0.83
    seen = torch.tensor(
        [
            [
                [(640 - 100) * 0.83, 100 * 0.67],
                [50 * 0.83, 50 * 0.67],
                [20 * 0.83, 20 * 0.67],
                [10 * 0.83, 10 * 0.67],
                [0.9, 0.8],
            ]
        ]
    )
    flipped = descale(seen[..., :1], True, 0.83, 640)
    assert torch.allclose(flipped[0, :, 0], torch.tensor([100.0, 50.0, 20.0, 10.0, 0.9]), atol=1e-4)
    plain = descale(seen[..., 1:], False, 0.67, 640)
    assert torch.allclose(plain[0, :, 0], torch.tensor([100.0, 50.0, 20.0, 10.0, 0.8]), atol=1e-4)


def test_augment_is_a_val_and_predict_key_and_refused_elsewhere():
    from detrain.config.cfg import parse_cli_args

    assert make_cfg({"augment": "true"}, "val").predict.augment is True
    assert make_cfg({"augment": True}, "predict").predict.augment is True
    with pytest.raises(ConfigError, match="argument 'augment' is not used by 'detrain train'"):
        parse_cli_args(["augment=true"], "train")
    with pytest.raises(ConfigError, match="invalid value for 'augment': 'maybe'; expected true or false"):
        make_cfg({"augment": "maybe"}, "val")
