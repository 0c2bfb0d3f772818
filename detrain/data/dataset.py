"""DetectionDataset: verified label records -> samples (the dict of docs/architecture.md) -> batches.

Training (``augment=True``): mosaic, random affine, mixup, cutmix, flips and HSV (``train_sample.py``), drawn from
``np.random.default_rng([seed, epoch, index])``, so what a run sees does not depend on how many dataloader
workers, processes or ranks produce it. Mosaic partners come from that same generator: from the index's *pool*
when the sampler gives one (``Pick``: its slot group in the recent batches of its sampler lane, see ``loader.py``),
else from the whole dataset. A per-process decode cache (``decode_cache.py``) keeps the lane's recent decodes, so
partners cost no second decode.

Validation (``augment=False``): YOLOv8's preprocessing exactly (``load_image``, i.e. ``image_io.resize_long_side``,
then ``letterbox`` with ``scaleup=False``; with ``rect=True`` images sorted by aspect ratio and letterboxed to their
batch's shape).

The epoch and the close-mosaic switch live in a small shared-memory tensor, so ``set_epoch`` reaches persistent
dataloader workers. An image that cannot be read any more (it passed verification) is replaced: training draws
another index deterministically, validation yields a grey image without labels; either way one warning per file
and a count (``skipped_images``), never a crash mid-epoch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from detrain.config.keys import MAX_PIXELS, PREPARE_TIMEOUT_S, Augment
from detrain.data.image_header import image_byte_limit, pixel_problem
from detrain.data.image_io import (
    check_disk_cache_fits,
    is_jpeg,
    jpeg_header,
    load_size,
    pixel_extent,
    read_image,
    read_npy,
    reduced_jpeg_grid,
    resize_long_side,
)
from detrain.data.memory.batch_memory import Batch, BatchBlock, whole_block
from detrain.data.memory.decode_cache import LANES, DecodeCache
from detrain.data.memory.ram_cache import RamCache, cache_key, run_tag
from detrain.data.samples.augment import apply_hsv, letterbox
from detrain.data.samples.device_render import DeviceBatch, EncodedJpeg
from detrain.data.samples.instances import Labels
from detrain.data.samples.train_sample import SamplePlan, SampleSource, place_sample, plan_sample, render_geometry
from detrain.errors import ConfigError, DatasetError
from detrain.system.input_file import read_input_array

AUGMENT_DEVICES = ("cpu", "gpu")  # where training samples' pixels are drawn (device_render.py)
MAX_SUBSTITUTIONS = 16  # unreadable images in a row before giving up on a sample
_EPOCH, _CLOSED, _SKIPPED = 0, 1, 2  # slots of the shared state tensor


def _decoded(decoded: Mapping[tuple[int, int], np.ndarray | None], i: int, r: int) -> np.ndarray:
    """Image ``i`` at reduction ``r`` of a plan whose images all decoded (else it was replaced)."""
    img = decoded[(i, r)]
    assert img is not None
    return img


class Pick(NamedTuple):
    """A sampler's key for the dataset: ``index``, its mosaic ``pool`` (the indices partners are drawn from), the
    pool's ``lane`` (pools of one lane slide over the same batches, see ``decode_cache.py``; -1: none) and the
    ``epoch`` it belongs to (its draws are (seed, epoch, index)'s; -1: the epoch ``set_epoch`` gave). A loader that
    runs on into the next epoch before the trainer has begun it hands out keys of that epoch (``loader.py``)."""

    # shadows tuple.index (which mypy reports); the samplers, the loader and the tests all read pick.index
    index: int  # type: ignore[assignment]
    pool: tuple[int, ...]
    lane: int = -1
    epoch: int = -1


def _augment_device(value: str) -> str:
    if value not in AUGMENT_DEVICES:
        raise ConfigError(f"augment_device={value!r} is not valid: use cpu or gpu")
    return value


def cache_mode(cache: str | bool | None) -> str | None:
    """``cache`` argument -> 'ram', 'disk' or None. ``cache_mode(True)`` -> 'ram'."""
    if cache in (None, False, "", "none", "None", "false", "False"):
        return None
    if cache in (True, "ram", "true", "True"):
        return "ram"
    if cache == "disk":
        return "disk"
    raise ConfigError(f"cache={cache!r} is not valid: use ram, disk or False")


def rect_batch_shapes(
    shapes_hw: np.ndarray, batch_size: int, imgsz: int, stride: int, pad: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """YOLO's rectangular batches: (order, batch index per sorted image, batch shapes (nb, 2) as h, w).

    Images are sorted by aspect ratio h/w; batch ``i`` holds sorted images ``i*batch_size ...``; its shape is
    [1, 1], or [max ar, 1] if all are wider than tall, or [1, 1 / min ar] if all are taller than wide, then
    ``ceil(shape * imgsz / stride + pad) * stride``.

    >>> order, bi, shapes = rect_batch_shapes(np.array([[480, 640], [640, 480]]), 1, 640, 32, 0.5)
    >>> order.tolist(), shapes.tolist()
    ([0, 1], [[512, 672], [672, 512]])
    """
    ar = shapes_hw[:, 0] / shapes_hw[:, 1]
    order = ar.argsort()  # numpy's default sort, as YOLOv8: ties keep the same order as there
    ar = ar[order]
    bi = np.floor(np.arange(len(ar)) / batch_size).astype(int)
    nb = int(bi[-1]) + 1
    shapes = [[1.0, 1.0]] * nb
    for i in range(nb):
        ari = ar[bi == i]
        mini, maxi = ari.min(), ari.max()
        if maxi < 1:
            shapes[i] = [maxi, 1]
        elif mini > 1:
            shapes[i] = [1, 1 / mini]
    return order, bi, np.ceil(np.array(shapes) * imgsz / stride + pad).astype(int) * stride


class _DeviceSource(NamedTuple):
    """Image pixels for ``augment_device=gpu``: their (h, w) and extent as the numpy path would decode them, and
    the JPEG to decode on the device or the decoded array (HWC uint8 BGR)."""

    shape_hw: tuple[int, int]
    extent: tuple[float, float, float, float]
    jpeg: EncodedJpeg | None = None
    array: np.ndarray | None = None


class _Rendered(NamedTuple):
    """A sample before it becomes the contract's dict: HWC BGR pixels and the labels in them; for training also
    the HSV gains still to apply (the colour step writes straight into the batch's memory)."""

    img: np.ndarray
    labels: Labels
    image_index: int
    ratio_pad: tuple[tuple[float, float], tuple[float, float]]
    hsv: np.ndarray | None = None


class DetectionDataset(Dataset):
    """Samples for training (augmented) or validation (YOLOv8-exact letterbox) from label records.

    ``records`` are ``LabelRecord``-like (``im_file``, ``shape_hw``, ``cls`` (n,), ``bboxes_xywhn`` (n, 4));
    ``hyp`` is the config's augment section as it is (``cfg.augment``; None: its defaults, ``Augment()``).
    ``close_mosaic_epoch``: from this epoch on (``set_epoch``) mosaic, mixup and cutmix are off.
    ``cache``: None (decode the files, at reduced JPEG scale where a sample shows an image small enough), 'disk'
    (decoded originals as ``.npy`` beside the images: the same samples) or 'ram' (load-size images, once per node
    in shared memory, as YOLOv8's RAM cache: training pixels are resampled twice, so they differ slightly);
    ``cache_timeout_s``: how long the other local ranks wait for local rank 0 to fill the RAM cache;
    ``local_rank`` and ``launched``: this process's place on its node, from its ``World`` (local rank 0 fills the
    RAM cache; the local ranks a launcher started share it); ``max_pixels``: an image whose header declares more
    (it changed since it was verified) is replaced as unreadable, never decoded.

    >>> from detrain.data.labels.verify import LabelRecord
    >>> _ = cv2.imwrite("a.png", np.zeros((48, 64, 3), np.uint8))
    >>> records = [LabelRecord("a.png", (48, 64), np.array([1]), np.array([[0.5, 0.5, 0.25, 0.5]], np.float32))]
    >>> ds = DetectionDataset(records, imgsz=64, augment=False, rect=True, batch_size=1)
    >>> sample = ds[0]; sample["img"].shape, sample["ratio_pad"], sample["cls"].tolist()
    (torch.Size([3, 64, 96]), ((1.0, 1.0), (16, 8)), [[1.0]])
    """

    def __init__(
        self,
        records: Sequence[Any],
        imgsz: int,
        augment: bool,
        hyp: Augment | None = None,
        rect: bool = False,
        batch_size: int = 16,
        stride: int = 32,
        seed: int = 0,
        cache: str | bool | None = None,
        pad: float = 0.5,
        *,
        close_mosaic_epoch: int | None = None,
        cache_timeout_s: float | None = None,
        local_rank: int = 0,
        launched: bool = False,
        max_pixels: int = MAX_PIXELS,
        augment_device: str = "cpu",
        fixed_hw: tuple[int, int] | None = None,
    ):
        if not records:
            raise DatasetError("the dataset has no images")
        self.imgsz, self.augment, self.rect = int(imgsz), bool(augment), bool(rect)
        # what an unaugmented image without rect is letterboxed to: (h, w), by default the square of imgsz
        self.fixed_hw = fixed_hw or (self.imgsz, self.imgsz)
        self.batch_size, self.stride, self.pad = int(batch_size), int(stride), float(pad)
        self.seed = int(seed) % 2**32
        self.hyp = Augment() if hyp is None else hyp
        self.close_mosaic_epoch, self.augment_device = close_mosaic_epoch, _augment_device(augment_device)
        records = list(records)
        self.batch_shapes: np.ndarray | None = None  # (nb, 2) h, w per rect batch
        self.batch_index: np.ndarray | None = None  # rect batch of each (sorted) image
        if self.rect:
            shapes = np.array([tuple(r.shape_hw) for r in records], dtype=np.float64)
            order, self.batch_index, self.batch_shapes = rect_batch_shapes(
                shapes, self.batch_size, self.imgsz, self.stride, self.pad
            )
            records = [records[i] for i in order]
        self.records = records
        self.im_files = [str(r.im_file) for r in records]
        self.shapes_hw = [(int(r.shape_hw[0]), int(r.shape_hw[1])) for r in records]
        self.load_sizes_hw = [load_size(s, self.imgsz) for s in self.shapes_hw]
        self.cache = cache_mode(cache)
        self.max_pixels = int(max_pixels)
        self._source = SampleSource(
            [(w, h) for h, w in self.load_sizes_hw], [max(s) for s in self.shapes_hw], can_reduce=self.cache is None
        )
        # epoch, mosaic closed by close_mosaic(), images replaced: shared with (persistent) dataloader workers.
        self._state = torch.zeros(3, dtype=torch.int64).share_memory_()
        self._warned: set[str] = set()
        self._decode_cache = DecodeCache()  # per process: each loader worker fills its own
        self._ram: RamCache | None = None  # while the cache fills, images are read from their files
        self._ram = self._open_cache(local_rank, launched, cache_timeout_s)

    def _open_cache(self, local_rank: int, launched: bool, timeout_s: float | None) -> RamCache | None:
        """``cache=ram``: the node's shared decoded images (filled once per node, :class:`RamCache`); ``cache=disk``:
        checked to fit the disk first; else None."""
        if self.cache == "ram":
            key = cache_key(self.im_files, self.shapes_hw, self.imgsz, run_tag(launched))
            return RamCache.build(
                key,
                self.load_sizes_hw,
                self._load_for_cache,
                local_rank=local_rank,
                timeout_s=timeout_s or PREPARE_TIMEOUT_S,
            )
        if self.cache == "disk":
            check_disk_cache_fits(self.im_files, self.shapes_hw)
        return None

    # -- epoch and mosaic switch (shared with workers) --------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Draw this epoch's augmentations (also in persistent workers) and apply ``close_mosaic_epoch``."""
        self._state[_EPOCH] = int(epoch)

    @property
    def epoch(self) -> int:
        """The epoch set by :meth:`set_epoch` (0 before)."""
        return int(self._state[_EPOCH])

    def close_mosaic(self) -> None:
        """Switch mosaic, mixup and cutmix off for good (also in persistent workers)."""
        self._state[_CLOSED] = 1

    @property
    def mosaic_active(self) -> bool:
        """Whether mosaic (and mixup and cutmix) can still be drawn this epoch."""
        return self.mosaic_active_at(self.epoch)

    def mosaic_active_at(self, epoch: int) -> bool:
        """Whether mosaic (and mixup and cutmix) can be drawn in ``epoch``."""
        if int(self._state[_CLOSED]):
            return False
        return self.close_mosaic_epoch is None or epoch < self.close_mosaic_epoch

    @property
    def skipped_images(self) -> int:
        """How many times an unreadable image was replaced, over all processes."""
        return int(self._state[_SKIPPED])

    # -- samples ---------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, key: int | Pick) -> dict[str, Any]:
        """The sample of ``key`` (an index, or a sampler's :class:`Pick`); ``img`` is a contiguous (3, H, W)."""
        sample = self.__getitems__([key])[0]
        if isinstance(sample, DeviceBatch):  # augment_device=gpu: drawn here, on the CPU
            batch = sample.render("cpu")
            return {k: v[0] if isinstance(v, list) else v for k, v in batch.items() if k != "batch_idx"} | {
                "img": batch["img"][0].contiguous()
            }
        sample["img"] = sample["img"].contiguous()
        return sample

    def __getitems__(self, keys: Sequence[int | Pick]) -> list[dict[str, Any]]:
        """A batch of samples; images shared by several mosaics of the batch are decoded once.

        With ``rect`` every sample takes the shape of the first key's rectangular batch: a batch is one group
        of the sorted images, except where the sampler padded the last one by wrapping around to the start."""
        picks = [k if isinstance(k, Pick) else Pick(int(k[0] if isinstance(k, tuple) else k), ()) for k in keys]
        out_hw = self.batch_shape(picks[0].index) if self.rect and picks else None
        if not self.augment:
            return self._finish([self._val_sample(p.index, out_hw) for p in picks])
        epoch = picks[0].epoch if picks and picks[0].epoch >= 0 else self.epoch  # a batch is of one epoch
        mosaic_on = self.mosaic_active_at(epoch)
        plans = [self._plan(p, epoch, 0, mosaic_on, out_hw) for p in picks]
        decoded: dict[tuple[int, int], Any] = {}  # this batch's pixels (or sources), whatever the cache evicts
        on_device = self.augment_device == "gpu"
        if not on_device:
            self._decode_cache.set_budget(self._decode_budget(picks))
            for lane, pool in {p.lane: p.pool for p in picks if p.lane >= 0}.items():
                self._decode_cache.retire(lane, pool)  # what this lane's pools no longer hold is never drawn again
        plans = [self._readable(pick, plan, epoch, mosaic_on, out_hw, decoded) for pick, plan in zip(picks, plans)]
        if on_device:
            return [self._device_batch(plans, decoded)]  # type: ignore[list-item]
        samples = []
        for plan in plans:
            img, labels = render_geometry(plan, lambda i, r: _decoded(decoded, i, r), self._labels_at_load_size)
            h0, w0 = self.shapes_hw[plan.index]
            lh, lw = self.load_sizes_hw[plan.index]
            samples.append(_Rendered(img, labels, plan.index, ((lh / h0, lw / w0), (0, 0)), plan.hsv))
        return self._finish(samples)

    def _readable(
        self,
        pick: Pick,
        plan: SamplePlan,
        epoch: int,
        mosaic_on: bool,
        out_hw: tuple[int, int] | None,
        decoded: dict[tuple[int, int], Any],
    ) -> SamplePlan:
        """``plan``, or the plan of a replacement when one of its images cannot be read; the pixels (or, for
        ``augment_device=gpu``, the sources) of every image it shows added to ``decoded``."""
        for attempt in range(1, MAX_SUBSTITUTIONS + 1):
            needed = [(t.index, t.reduce) for layer in plan.layers for t in layer.tiles]
            for k in needed:
                if k not in decoded:
                    if self.augment_device == "gpu":
                        decoded[k] = self._device_source(*k)
                    elif self._ram is None:
                        decoded[k] = self._decode_cache.get(k, self._decode, pick.lane)
                    else:
                        decoded[k] = self._pixels(*k)
            bad = [i for i, r in needed if decoded[(i, r)] is None]
            if not bad:
                return plan
            self._skip(bad, "another image is used in its place")
            plan = self._plan(pick, epoch, attempt, mosaic_on, out_hw)
        raise DatasetError(
            f"{MAX_SUBSTITUTIONS} unreadable images in a row around "
            f"{self.im_files[pick.index]}: were the images moved or deleted?"
        )

    def _device_source(self, index: int, reduce: int) -> _DeviceSource | None:
        """What the training device draws image ``index`` at 1/``reduce`` from: the JPEG file's bytes (decoded
        there), else (other formats, caches, a header that cannot be read) the pixels decoded here."""
        if self._ram is None and self.cache != "disk":
            try:
                data = read_input_array(self.im_files[index], image_byte_limit(self.max_pixels))
            except OSError:
                return None
            if not data.size or pixel_problem(data, self.max_pixels) is not None:
                return None
            header = jpeg_header(data) if is_jpeg(data) else None
            if header is not None:
                width, height, orientation = header
                shape, extent = reduced_jpeg_grid(width, height, orientation, reduce)
                return _DeviceSource(shape, extent, jpeg=EncodedJpeg(torch.from_numpy(data), orientation))
        img = self._pixels(index, reduce)
        if img is None:
            return None
        return _DeviceSource((img.shape[0], img.shape[1]), pixel_extent(img), array=np.asarray(img))

    def _device_batch(self, plans: Sequence[SamplePlan], sources: Mapping[tuple[int, int], Any]) -> DeviceBatch:
        """The batch of ``plans`` for ``augment_device=gpu``: layouts and labels made here, pixels left to draw."""

        def shape(i: int, r: int) -> tuple[tuple[int, int], tuple[float, float, float, float]]:
            src = sources[(i, r)]
            return src.shape_hw, src.extent

        layouts = [place_sample(plan, shape, self._labels_at_load_size) for plan in plans]
        jpegs = {k[0]: s.jpeg for k, s in sources.items() if s is not None and s.jpeg is not None}
        arrays = {k: s.array for k, s in sources.items() if s is not None and s.array is not None}
        w, h = layouts[0].layers[0].out_wh
        counts = [len(lay.labels) for lay in layouts]
        ratio_pad = []
        for plan in plans:
            (h0, w0), (lh, lw) = self.shapes_hw[plan.index], self.load_sizes_hw[plan.index]
            ratio_pad.append(((lh / h0, lw / w0), (0.0, 0.0)))
        return DeviceBatch.pack(
            layouts,
            jpegs,
            arrays,
            cls=np.concatenate([lay.labels.cls for lay in layouts]).astype(np.float32).reshape(-1, 1),
            bboxes=np.concatenate([lay.labels.to_xywhn(w, h) for lay in layouts]).reshape(-1, 4),
            batch_idx=np.repeat(np.arange(len(plans), dtype=np.float32), counts),
            im_file=[self.im_files[p.index] for p in plans],
            ori_shape=[self.shapes_hw[p.index] for p in plans],
            ratio_pad=ratio_pad,
        )

    def batch_shape(self, index: int) -> tuple[int, int]:
        """(h, w) of the rectangular batch of ``index`` (``rect`` only)."""
        assert self.batch_shapes is not None and self.batch_index is not None, "rect=True only"
        h, w = (int(v) for v in self.batch_shapes[self.batch_index[index]])
        return h, w

    def _plan(
        self, pick: Pick, epoch: int, attempt: int, mosaic_on: bool, out_hw: tuple[int, int] | None
    ) -> SamplePlan:
        """Attempt 0 is the index itself; a replacement (attempt k) is drawn from (seed, epoch, index, k)."""
        if attempt == 0:
            rng, index = np.random.default_rng([self.seed, epoch, pick.index]), pick.index
        else:
            rng = np.random.default_rng([self.seed, epoch, pick.index, attempt])
            index = int(rng.integers(len(self)))
        return plan_sample(index, rng, self._source, self.hyp, self.imgsz, mosaic_on, out_hw, pick.pool or None)

    def _val_sample(self, index: int, shape: tuple[int, int] | None) -> _Rendered:
        h0, w0 = self.shapes_hw[index]
        img = self.load_image(index)
        labels = self._labels_at_load_size(index)
        if img is None:
            self._skip([index], "evaluated as an empty grey image")
            lh, lw = self.load_sizes_hw[index]
            img, labels = np.full((lh, lw, 3), 114, np.uint8), Labels.empty()
        h, w = img.shape[:2]
        img, (r, _), (left, top) = letterbox(img, shape or self.fixed_hw, auto=False, scaleup=False)
        ratio_pad = ((h / h0 * r, w / w0 * r), (left, top))
        return _Rendered(img, labels.scaled(r, r, left, top), index, ratio_pad)

    def _finish(self, rendered: Sequence[_Rendered]) -> list[dict[str, Any]]:
        """The contract's dicts, written straight into one block of memory for the whole batch
        (``batch_memory.py``: shared memory inside a dataloader worker) that ``collate`` hands on without copying.

        Training images are laid out channels-last: the colour step (HSV, BGR -> RGB) writes them in place and the
        trainer's ``contiguous(memory_format=torch.channels_last)`` has nothing left to do; each ``img`` is still
        a (3, H, W) RGB view. Validation images are plain contiguous (3, H, W): one cv2.split into the planes."""
        counts = [len(r.labels) for r in rendered]
        channels_last = self.augment
        if len({r.img.shape for r in rendered}) == 1:
            h, w = rendered[0].img.shape[:2]
            block = BatchBlock.allocate(len(rendered), h, w, counts, channels_last, recycle=self.augment)
            views = [block.sample(i) for i in range(len(rendered))]
        else:  # images of different sizes cannot form one batch: separate tensors
            channels_last = False
            views = [
                (torch.empty((3, *r.img.shape[:2]), dtype=torch.uint8), torch.empty((c, 1)), torch.empty((c, 4)))
                for r, c in zip(rendered, counts)
            ]
        out = []
        for r, (img, cls, bboxes) in zip(rendered, views):
            h, w = r.img.shape[:2]
            if channels_last:
                assert r.hsv is not None  # a training sample carries its gains
                apply_hsv(r.img, r.hsv, to_rgb=True, dst=img.permute(1, 2, 0).numpy())
            else:
                bgr = r.img if r.hsv is None else apply_hsv(r.img, r.hsv)
                planes = img.numpy()
                cv2.split(bgr, [planes[2], planes[1], planes[0]])
            cls.view(-1).numpy()[:] = r.labels.cls
            bboxes.numpy()[:] = r.labels.to_xywhn(w, h)
            out.append(
                {
                    "img": img,
                    "cls": cls,
                    "bboxes": bboxes,
                    "im_file": self.im_files[r.image_index],
                    "ori_shape": self.shapes_hw[r.image_index],
                    "ratio_pad": r.ratio_pad,
                }
            )
        return out

    # -- pixels ----------------------------------------------------------------------------------------------
    def load_image(self, index: int) -> np.ndarray | None:
        """Image ``index`` BGR at load size (YOLOv8's ``load_image``), from the cache if any; None if unreadable."""
        if self._ram is not None:
            return self._ram.get(index)
        img = self._read(index)
        return None if img is None else resize_long_side(img, self.imgsz)

    def _load_for_cache(self, index: int) -> np.ndarray | None:
        img = self._read(index)
        if img is None:
            return None
        h, w = self.load_sizes_hw[index]
        img = resize_long_side(img, self.imgsz)
        # The file disagrees with its verified shape (e.g. EXIF rotation read differently): fit the promised slot.
        return img if img.shape[:2] == (h, w) else cv2.resize(img, (w, h), interpolation=cv2.INTER_LINEAR)

    def _decode_budget(self, picks: Sequence[Pick]) -> int:
        """Bytes this process may keep decoded: the batch's pools at load size, half as much again for decodes at
        other reductions, for each sampler lane this process serves (the DataLoader deals batch b to worker
        b mod workers, so each of w workers serves ``LANES / w`` lanes; the main process all of them)."""
        pooled = len(set().union(*(p.pool for p in picks)))
        if not pooled:
            return 0
        info = torch.utils.data.get_worker_info()
        lanes = math.ceil(LANES / info.num_workers) if info is not None else LANES
        return int(1.5 * max(pooled, len(picks)) * lanes * self.imgsz * self.imgsz * 3)

    def _decode(self, key: tuple[int, int]) -> np.ndarray | None:
        return self._pixels(*key)

    def _pixels(self, index: int, reduce: int) -> np.ndarray | None:
        """Decoded pixels for training at any resolution (the warp scales them to the load size)."""
        if self._ram is not None:
            return self._ram.get(index)
        return self._read(index, reduce)

    def _read(self, index: int, reduce: int = 1) -> np.ndarray | None:
        """Image ``index`` decoded (at 1/``reduce`` where that saves work), or from the disk cache; None when it
        cannot be read or its header now declares more than ``max_pixels`` pixels (it changed since verified)."""
        if self.cache == "disk":
            return read_npy(self.im_files[index], self.max_pixels)
        return read_image(self.im_files[index], reduce, self.max_pixels)

    def _labels_at_load_size(self, index: int) -> Labels:
        rec = self.records[index]
        h, w = self.load_sizes_hw[index]
        return Labels.from_xywhn(rec.cls, rec.bboxes_xywhn, w, h)

    def _skip(self, indices: Sequence[int], what: str) -> None:
        for i in indices:
            self._state[_SKIPPED] += 1
            if self.im_files[i] not in self._warned:
                self._warned.add(self.im_files[i])
                warnings.warn(f"{self.im_files[i]}: image unreadable since verification; {what}", stacklevel=3)

    # -- batches ---------------------------------------------------------------------------------------------
    @staticmethod
    def collate(batch: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Samples -> ``img`` (B, 3, H, W) uint8, ``batch_idx`` (M,) float32 (as YOLOv8), ``cls`` (M, 1),
        ``bboxes`` (M, 4); ``im_file``, ``ori_shape``, ``ratio_pad`` as lists. A batch made by one
        ``__getitems__`` call already lies in one block: it is returned as views, without copying (training
        batches channels-last, see ``_finish``)."""
        if len(batch) == 1 and isinstance(batch[0], DeviceBatch):
            return batch[0]  # type: ignore[return-value]  # augment_device=gpu: drawn by the trainer
        imgs = [b["img"] for b in batch]
        if len({tuple(t.shape) for t in imgs}) != 1:
            raise ValueError(f"images of one batch differ in size: {sorted({tuple(t.shape) for t in imgs})}")
        block = whole_block(imgs, [b["cls"] for b in batch])
        if block is not None:
            arrays = {"img": block.img, "batch_idx": block.batch_idx, "cls": block.cls, "bboxes": block.bboxes}
        else:
            counts = torch.tensor([len(b["cls"]) for b in batch], dtype=torch.int64)
            arrays = {
                "img": default_collate(imgs),
                "batch_idx": torch.repeat_interleave(torch.arange(len(batch), dtype=torch.float32), counts),
                "cls": torch.cat([b["cls"] for b in batch], 0),
                "bboxes": torch.cat([b["bboxes"] for b in batch], 0),
            }
        return Batch(
            **arrays,
            im_file=[b["im_file"] for b in batch],
            ori_shape=[b["ori_shape"] for b in batch],
            ratio_pad=[b["ratio_pad"] for b in batch],
        )
