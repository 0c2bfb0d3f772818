"""AutoBatch (``batch=-1`` or a fraction ``0 < batch < 1``): the largest training batch whose step fits that share
of each GPU's memory (-1: 60 %), as Ultralytics' AutoBatch, and on every rank the same.

How: a few batch sizes (1, 2, 4, 8, 16, and 32, 64 on a GPU of 16 GiB or more) each run one training step of the
real model (forward under the run's autocast at the largest size training takes, 1.5 x imgsz with multi_scale;
the model's own loss on synthetic boxes, four times as many per image as the dataset's most crowded one with
mosaic, as Ultralytics; backward) on a copy of the model, and the peak memory each adds
(``torch.cuda.max_memory_allocated``) is measured; a line fitted through those points says how many images fit
the fraction of the memory still available. Training-time validation runs whole batches of the *global* batch on
every rank, so validation's forward is measured too and the global batch must fit it as well. A size that runs
out of memory caps the choice below it. Each rank measures its own GPU; the smallest fit of any rank is every
rank's (one all-gather), and the global batch is that times the planned world, so it always splits evenly.

Off CUDA there is nothing to measure: the batch is 16 (the next multiple of the planned world), with one line, as
Ultralytics does. The arithmetic (:func:`fit_line`, :func:`local_batch`) is plain numbers, and the memory is read
through :class:`Memory`, so tests run it on the CPU with a fake memory.

>>> fit_line([1, 2, 4, 8], [3e8, 5e8, 9e8, 17e8])
Line(intercept=100000000.0, slope=200000000.0)
>>> Line(1e8, 2e8).images_within(4.1e9)
20
"""

from __future__ import annotations

import copy
import functools
import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from detrain.config.keys import Loss
from detrain.config.values import auto_batch_fraction
from detrain.distributed import dist
from detrain.distributed.wire import carried
from detrain.nn.model import DetectionModel

GIB = 1 << 30
FALLBACK_BATCH = 16  # off CUDA, or where the measurement fails (Ultralytics' default batch)
MAX_LOCAL_BATCH = 1024  # per rank: beyond it a fit is an extrapolation far past what was measured
MAX_PROBE_OBJECTS = 1000  # synthetic boxes per image at most (a detection label file rarely holds more)
CHANNELS_LAST = torch.channels_last  # the trainer's memory format


class Memory(Protocol):
    """A GPU's memory as AutoBatch reads it: :class:`CudaMemory`, or a fake in tests."""

    name: str

    def total(self) -> int:
        """Bytes the device has."""
        ...

    def available(self) -> int:
        """Bytes the run's steps may still take: free on the device, plus what this process holds cached unused."""
        ...

    def peak(self, step: Callable[[], object]) -> int | None:
        """Bytes ``step`` adds at its peak to what was allocated before it; None when it ran out of memory."""
        ...


class CudaMemory:
    """:class:`Memory` of one CUDA device, read through ``torch.cuda``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.name = f"{device} ({torch.cuda.get_device_name(device)})"

    def total(self) -> int:
        return int(torch.cuda.get_device_properties(self.device).total_memory)

    def available(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return int(free + cached)

    def peak(self, step: Callable[[], object]) -> int | None:
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            step()
            torch.cuda.synchronize(self.device)
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        return int(torch.cuda.max_memory_allocated(self.device) - before)


@dataclass(frozen=True)
class Line:
    """Bytes a step takes for a batch of ``b`` images: ``intercept + slope * b``."""

    intercept: float
    slope: float

    def at(self, images: float) -> float:
        return self.intercept + self.slope * images

    def images_within(self, budget: float) -> int:
        """The most images whose step stays within ``budget`` bytes (0 where not even one does)."""
        return max(int((budget - self.intercept) // self.slope), 0)


def probe_sizes(total: int) -> tuple[int, ...]:
    """The batch sizes measured: up to 16 on a GPU under 16 GiB, up to 64 above (as Ultralytics).

    >>> probe_sizes(8 * GIB), probe_sizes(80 * GIB)
    ((1, 2, 4, 8, 16), (1, 2, 4, 8, 16, 32, 64))
    """
    return (1, 2, 4, 8, 16) if total < 16 * GIB else (1, 2, 4, 8, 16, 32, 64)


def fit_line(sizes: Sequence[int], peaks: Sequence[int | None]) -> Line | None:
    """The least-squares line through the measured (size, peak) points, each kept only where the peak grew over
    the last kept one (allocator noise at small sizes); None with fewer than two points or no growth.

    >>> fit_line([1, 2, 4], [None, None, 5e8]) is None
    True
    """
    points: list[tuple[int, float]] = []
    for size, peak in zip(sizes, peaks, strict=True):
        if peak is not None and peak > 0 and (not points or peak > points[-1][1]):
            points.append((size, float(peak)))
    if len(points) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var_x = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var_x
    if not math.isfinite(slope) or slope <= 0:
        return None
    return Line(mean_y - slope * mean_x, slope)


def measure(memory: Memory, step: Callable[[int], object], sizes: Sequence[int]) -> list[int | None]:
    """Each size's peak (None where it ran out of memory); sizes after the first that ran out, or after one that
    took all the memory there is, are not run (they would only run out too)."""
    peaks: list[int | None] = []
    for size in sizes:
        peak = memory.peak(functools.partial(step, size))
        peaks.append(peak)
        if peak is None or peak >= memory.available():
            break
    return peaks + [None] * (len(sizes) - len(peaks))


@carried  # gathered from every rank: see detrain.distributed.wire
@dataclass(frozen=True)
class LocalFit:
    """What one rank's GPU fits: ``images`` per step (at least 1), the bytes a step of that many is predicted to
    take (``predicted``) of the ``available`` ones, on the device called ``name``."""

    images: int
    predicted: float
    available: int
    name: str


def local_batch(
    sizes: Sequence[int],
    train_peaks: Sequence[int | None],
    val_peaks: Sequence[int | None] | None,
    budget: float,
    world: int,
) -> tuple[int, Line] | None:
    """The most images per rank whose training step fits ``budget`` bytes, and whose validation batch (``world``
    times as many: every rank validates the global batch) fits it too; below the first size that ran out of
    memory, at most :data:`MAX_LOCAL_BATCH`, at least 1. None when the training peaks give no line.

    >>> local_batch([1, 2, 4, 8], [3e8, 5e8, 9e8, 17e8], None, 4.1e9, world=1)[0]
    20
    >>> local_batch([1, 2, 4, 8], [3e8, 5e8, 9e8, None], None, 4.1e9, world=1)[0]  # 8 ran out of memory
    4
    >>> local_batch([1, 2, 4, 8], [3e8, 5e8, 9e8, 17e8], [2e8, 3e8, 5e8, 9e8], 4.1e9, world=4)[0]  # validates 40
    10
    """
    train = fit_line(sizes, train_peaks)
    if train is None:
        return None
    images = train.images_within(budget)
    if val_peaks is not None:
        val = fit_line(sizes, val_peaks)
        if val is not None:
            images = min(images, val.images_within(budget) // world)
    ran = [s for s, p in zip(sizes, train_peaks, strict=True) if p is not None]
    out = [s for s, p in zip(sizes, train_peaks, strict=True) if p is None and ran and s > ran[0]]
    if out:
        images = min(images, max(s for s in ran if s < out[0]))
    return min(max(images, 1), MAX_LOCAL_BATCH), train


@dataclass
class ProbeSteps:
    """The steps AutoBatch measures: ``train(b)`` (forward, loss and backward of ``b`` images) and ``val(b)``
    (validation's forward), on a copy of the model (its BatchNorm statistics and gradients stay untouched)."""

    train: Callable[[int], object]
    val: Callable[[int], object] | None


def model_steps(
    model: DetectionModel,
    imgsz: tuple[int, int],
    objects: int,
    dtypes: tuple[torch.dtype | None, torch.dtype | None],
    device: torch.device,
) -> ProbeSteps:
    """:class:`ProbeSteps` of a copy of ``model`` (a DetectionModel) at ``imgsz`` (training's largest size,
    validation's) with ``objects`` boxes per image (at least 1, at most :data:`MAX_PROBE_OBJECTS`), under autocast
    in ``dtypes`` (training's, validation's; None: float32). Images and boxes are made the same way every time,
    with no random draw (the run's generators stay where they are).

    >>> from detrain.nn.model import DetectionModel
    >>> steps = model_steps(DetectionModel(nc=2), (96, 64), 3, (None, None), torch.device("cpu"))
    >>> steps.train(2); steps.val(2)
    """
    net = copy.deepcopy(model).to(device)
    criterion = net.criterion(asdict(Loss()), epochs=1)  # the default gains (memory is the same)
    k = min(max(objects, 1), MAX_PROBE_OBJECTS)
    nc = int(net.nc)
    train_dtype, val_dtype = dtypes
    train_size, val_size = imgsz

    side = math.ceil(math.sqrt(k))  # the boxes on a grid over the image, each 80 % of its cell
    i = torch.arange(k, device=device)
    size = torch.full((k,), 0.8 / side, device=device)
    boxes = torch.stack(((i % side + 0.5) / side, (i // side + 0.5) / side, size, size), 1)
    classes = (i % nc).float().unsqueeze(1)

    def labels(b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch_idx = torch.arange(b, device=device).repeat_interleave(k).float()
        return batch_idx, classes.repeat(b, 1), boxes.repeat(b, 1)

    def train(b: int) -> None:
        net.train()
        imgs = torch.full((b, 3, train_size, train_size), 0.5, device=device).contiguous(memory_format=CHANNELS_LAST)
        with torch.autocast(device.type, dtype=train_dtype, enabled=train_dtype is not None):
            maps = net(imgs)
        loss, _ = criterion.score(criterion.assign(maps, *labels(b)), None, None)
        loss.backward()
        net.zero_grad(set_to_none=True)

    def val(b: int) -> None:
        net.eval()
        imgs = torch.full((b, 3, val_size, val_size), 0.5, device=device).contiguous(memory_format=CHANNELS_LAST)
        with torch.no_grad(), torch.autocast(device.type, dtype=val_dtype, enabled=val_dtype is not None):
            net(imgs)

    return ProbeSteps(train, val)


def fit_on(memory: Memory, steps: ProbeSteps, fraction: float, world: int) -> LocalFit | None:
    """What ``memory``'s GPU fits of ``fraction`` of its available memory (None where the measurements give no
    line: every size ran out of memory, or the peaks did not grow)."""
    sizes = probe_sizes(memory.total())
    available = memory.available()
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False  # timing kernels would allocate workspaces the steps do not keep
    try:
        train_peaks = measure(memory, steps.train, sizes)
        val_peaks = measure(memory, steps.val, sizes) if steps.val is not None else None
    finally:
        torch.backends.cudnn.benchmark = benchmark
    found = local_batch(sizes, train_peaks, val_peaks, available * fraction, world)
    if found is None:
        return None
    images, line = found
    return LocalFit(images, line.at(images), available, memory.name)


def fallback_batch(planned_world: int) -> int:
    """The batch off CUDA: :data:`FALLBACK_BATCH`, rounded up to split over ``planned_world`` ranks.

    >>> fallback_batch(1), fallback_batch(3), fallback_batch(32)
    (16, 18, 32)
    """
    return -(-FALLBACK_BATCH // planned_world) * planned_world


def agree_batch(fits: Sequence[LocalFit | None], planned_world: int, n_images: int) -> int | None:
    """The global batch every rank takes from all ranks' fits: the smallest fit times ``planned_world``, at most
    the training images (rounded down to a multiple of the world; at least one image per rank); None when any
    rank measured nothing.

    >>> fits = [LocalFit(12, 0, 0, "a"), LocalFit(9, 0, 0, "b")]
    >>> agree_batch(fits, 2, 10_000), agree_batch(fits, 2, 10), agree_batch([fits[0], None], 2, 10)
    (18, 10, None)
    """
    if not fits or any(f is None for f in fits):
        return None
    local = min(f.images for f in fits if f is not None)
    local = min(local, max(n_images // planned_world, 1))
    return local * planned_world


def pick_batch(
    batch: float,
    device: torch.device,
    make_steps: Callable[[], ProbeSteps],
    planned_world: int,
    n_images: int,
    say: Callable[[str], None],
    memory: Memory | None = None,
) -> int:
    """The global batch for an AutoBatch ``batch`` (-1 or a fraction), the same on every rank; ``say`` (rank 0's
    console) gets one line on what was chosen and why. ``memory``: this rank's GPU (default: ``device``'s, read
    through torch.cuda); ``make_steps`` is called only where there is memory to measure."""
    fraction = auto_batch_fraction(batch)
    mine = None
    if device.type == "cuda" or memory is not None:
        memory = memory if memory is not None else CudaMemory(device)
        mine = fit_on(memory, make_steps(), fraction, planned_world)
    # collective: every rank's fit, so that all take the smallest
    fits = dist.all_gather_object(mine)
    chosen = agree_batch(fits, planned_world, n_images)
    if chosen is None:
        chosen = fallback_batch(planned_world)
        why = (
            f"needs a CUDA device; this {device.type} run uses"
            if mine is None and memory is None
            else "measured no usable batch (every size ran out of memory, or memory did not grow with it); using"
        )
        say(f"AutoBatch: batch={batch:g} {why} batch={chosen}")
        return chosen
    tight = min((f for f in fits if f is not None), key=lambda f: f.images)
    say(
        f"AutoBatch: batch={chosen} ({chosen // planned_world} per worker x {planned_world}) for {fraction:.0%} of "
        f"GPU memory: a step predicted at {tight.predicted / GIB:.2f} of {tight.available / GIB:.2f} GiB available "
        f"on {tight.name}"
    )
    return chosen
