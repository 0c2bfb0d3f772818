"""Every argument of every command, in sections, each with its type, default, valid values and one-line help.

This file is the one source: ``make_cfg`` (``detrain.config.cfg``) checks values against it, ``detrain <command>
--help`` prints the help lines of the keys the command takes (each key says which, :data:`COMMAND_KEYS`), and
``cfg/default.yaml`` is generated from it (``python -m detrain.config``;
a unit test fails when the shipped file differs). Keys stay flat where users give them (``epochs=10``,
``Model.train(epochs=10)``, args.yaml, a checkpoint's train_args); code reads them by section:
``cfg.train.epochs``. No key is named like a section but ``augment``: Ultralytics' key for test-time augmentation
(``cfg.predict.augment``), while the section of training's augmentation is ``cfg.augment``.

>>> SECTION_OF["epochs"], SPECS["lrf"].low, SPECS["lrf"].high, SPECS["optimizer"].choices
('train', 0.0, 1.0, ('auto', 'SGD', 'AdamW', 'Adam', 'Adamax', 'NAdam', 'RAdam', 'RMSProp', 'MuSGD'))
>>> SPECS["epochs"].commands, SPECS["imgsz"].commands, COMMAND_KEYS["info"]
(('train',), ('val', 'predict', 'export', 'info', 'train'), ('model', 'weights_sha256', 'imgsz', 'verbose'))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from detrain.config.values import (
    ImageSize,
    amp_mode,
    auto_or_count,
    batch_size,
    cache_mode,
    class_ids,
    compile_mode,
    flag_or_half,
    flag_or_weights,
    folder,
    freeze,
    idle_device,
    image_size,
    node_count,
    node_range,
    same_failures,
    sha256_or_empty,
    stride_multiple,
    zero_only,
)
from detrain.errors import ConfigError

Device = str | int | list
# Every command that takes keys, in the order an error names those that take a key ("it is for val and train").
COMMANDS = ("val", "predict", "export", "info", "train")
WEEK_S = 7 * 24 * 3600  # the longest timeout: a typo beyond it would overflow the timers instead of waiting
# prepare_timeout's default: how long ranks wait for their node's first process to prepare the data (an hour);
# what prepares data without a config waits as long (data/prepare.py, data/memory/ram_cache.py)
PREPARE_TIMEOUT_S = 3600.0
YEAR_H = 365 * 24  # the longest time= budget in hours: beyond it a value is a typo (time is hours, not seconds)
# The most pixels an image's header may declare before it is decoded: 200 megapixels (600 MB decoded, a
# 14000 x 14000 aerial tile) passes; a 110 KB PNG declaring 30000 x 30000 (2.7 GB on every loader thread) does not.
MAX_PIXELS = 200_000_000


@dataclass(frozen=True)
class Spec:
    """What a key's value may be, and its one-line help (``--help`` and the comment in cfg/default.yaml).

    ``low``/``high``: inclusive bounds of a number (None: unbounded on that side; integers stop at INT_LIMIT).
    ``pattern``: (regular expression, what it allows) for a non-empty string. ``non_empty``: what to give when
    '' would only fail later. ``parse`` reads the value instead of the field's type (id lists, nbs, cache);
    ``check`` runs after the bounds and returns the value normalised. ``commands``: the commands that take the key
    (their ``--help`` lists it; naming it for another command is an error). ``launch``: the key says where and how
    the workers run: this launch's value is kept over a resumed checkpoint's arguments. ``per_node``: the nodes of
    one job may give the key different values (a node's own devices, loader processes, interface and run id, and
    what only rank 0 acts on: the run folder, plots, trackers, printing); every other key every node gives alike,
    so a derived run id hashes them (:mod:`detrain.distributed.launch.run_identity`) and training's start check compares
    them, or what they name (:mod:`detrain.engine.train.shared_settings`). ``guard``: a value other
    than the default lifts a safety guard (a download anywhere, code in an export run unchecked), so it is taken
    from the command line or the API only: a ``cfg=`` file that sets it is refused (:mod:`detrain.config.cfg`)."""

    help: str
    choices: tuple[Any, ...] = ()
    low: float | None = None
    high: float | None = None
    pattern: tuple[str, str] | None = None
    non_empty: str = ""
    parse: Callable[[str, Any], Any] | None = None
    check: Callable[[str, Any], Any] | None = None
    commands: tuple[str, ...] = ("train",)
    launch: bool = False
    per_node: bool = False
    guard: bool = False


def key(
    default: Any,
    help_text: str,
    *,
    choices: tuple[Any, ...] = (),
    low: float | None = None,
    high: float | None = None,
    pattern: tuple[str, str] | None = None,
    non_empty: str = "",
    parse: Callable[[str, Any], Any] | None = None,
    check: Callable[[str, Any], Any] | None = None,
    commands: tuple[str, ...] | None = None,
    launch: bool = False,
    per_node: bool = False,
    guard: bool = False,
) -> Any:
    """A field of a section: its default, and its :class:`Spec` (help, choices, bounds, checks, the commands that
    take it) beside it. ``commands`` defaults to train's alone, or to the commands that launch workers (train and
    val) for a ``launch`` key."""
    if commands is None:
        commands = ("train", "val") if launch else ("train",)
    spec = Spec(help_text, choices, low, high, pattern, non_empty, parse, check, commands, launch, per_node, guard)
    return field(default=default, metadata={"spec": spec})


@dataclass(frozen=True)
class Inputs:
    """What a command works on: the model, its weights, the dataset and how its images are read."""

    model: str = key(
        "n.yaml",
        "architecture yaml (YOLOv8: n/s/m/l/x.yaml or yolov8s.yaml; yolo11n.yaml ... yolo11x.yaml; yolo26n.yaml "
        "... yolo26x.yaml; or a path to a yaml that says scale:), or weights (.pt: detrain's, or Ultralytics' "
        "YOLOv8, YOLO11 and YOLO26); val and predict also take an export (.onnx, .torchscript)",
        non_empty="an architecture yaml (n.yaml ... x.yaml, yolo11n.yaml, yolo26n.yaml, a path) or weights (.pt)",
        commands=COMMANDS,
    )
    weights_sha256: str = key(
        "",
        "sha256 the model= weights must have ('' = unchecked); lets a name with no recorded hash download",
        check=sha256_or_empty,
        commands=COMMANDS,
    )
    pretrained: bool | str = key(
        True,
        "true (a model= .pt starts from its weights; false: its architecture "
        "from scratch) or weights (.pt) whose layers of the same name and shape start "
        "a model= yaml",
        check=flag_or_weights,
    )
    data: str = key(
        "shapes.yaml",
        "dataset yaml; shapes.yaml is the built-in synthetic set (generated locally, no network)",
        non_empty="a dataset yaml (a path, or a bundled name such as coco8.yaml)",
        commands=("train", "val"),
    )
    download_max_gb: float = key(
        50.0,
        "largest archive a dataset yaml's download: may fetch, in GB (bigger ones are refused)",
        low=0.0,
        commands=("train", "val"),
    )
    download_max_unpacked_gb: float = key(
        200.0,
        "largest total size one dataset archive may unpack to, in GB (refuses zip bombs)",
        low=0.0,
        commands=("train", "val"),
    )
    download_max_files: int = key(
        2000000, "most files and folders one dataset archive may hold", low=1, commands=("train", "val")
    )
    download_anywhere: bool = key(
        False,
        "let a dataset yaml's download: fill a path: outside the yaml's own folder and the datasets folder "
        "(command line or API only)",
        commands=("train", "val"),
        guard=True,
    )
    trust_export: bool = key(
        False,
        "run a .torchscript model= file's code unchecked (command line or API only); by default an archive whose "
        "code defines __setstate__ or calls anything but the tensor operators a detrain export uses is refused",
        commands=("val", "predict"),
        guard=True,
    )
    imgsz: int = key(
        640,
        "input size in pixels, a multiple of 32 (the largest stride; another is rounded up to one, with a warning); "
        "val, predict, export and info also take a rectangle [h, w] (imgsz=480,640, each a multiple of 32): val "
        "letterboxes every image into it, predict fits each picture in it, export traces it; train takes its long "
        "side, as Ultralytics does",
        low=1,
        high=8192,
        parse=image_size,
        check=stride_multiple,
        commands=COMMANDS,
    )
    fraction: float = key(1.0, "fraction of the training images to use (for quick experiments)", low=0.0, high=1.0)
    single_cls: bool = key(
        False,
        "train and val: every object is one class, 'item' (the model gets 1 class; val collapses predictions to it)",
        commands=("train", "val"),
    )
    classes: list | None = key(
        None,
        "only these class ids, e.g. classes=0,2 (null = every class): train/val "
        "keep only their labels and score only them; predict keeps only their "
        "detections",
        parse=class_ids,
        commands=("train", "val", "predict"),
    )
    max_pixels: int = key(
        MAX_PIXELS,
        "largest image, in pixels its header declares, that is decoded; bigger ones are skipped as corrupt "
        "(refuses decompression bombs)",
        low=1,
        commands=("train", "val", "predict"),
    )
    cache: bool | str = key(
        False,
        "cache decoded images: false, ram (shared per node) or disk",
        choices=(False, "ram", "disk"),
        parse=cache_mode,
    )
    augment_device: str = key(
        "cpu",
        "where training images are decoded and augmented: cpu (the loader's workers) or gpu (JPEG decode, mosaic, "
        "affine, mixup, cutmix and HSV on the training device from the same draws; on a CPU device, in torch there)",
        choices=("cpu", "gpu"),
    )
    fingerprint: str = key(
        "paths",
        "manifest.json's dataset fingerprint: paths (relative paths and sizes, reads no file) or content (also "
        "every byte of every image, label and json)",
        choices=("paths", "content"),
        per_node=True,
    )


@dataclass(frozen=True)
class Train:
    """How long and how a model trains: the schedule, the optimiser and the training batches."""

    epochs: int = key(100, "number of epochs to train", low=1)
    time: float | None = key(
        None,
        "hours to train, overriding epochs: re-estimated after every epoch, the lr "
        "schedule and close_mosaic refitted (null or 0 = off; at most 8760)",
        low=0.0,
        high=YEAR_H,
    )
    batch: int | float = key(
        16,
        "global batch per step over all workers (must divide by them; with nnodes=MIN:MAX, by all "
        "MAX nodes' workers); train on CUDA: -1 or a fraction (0.7) picks the largest that fits 60% or that "
        "fraction of each GPU's memory (AutoBatch; 16 on CPU); predict: pictures per forward pass",
        parse=batch_size,
        commands=("train", "val", "predict"),
    )
    patience: int = key(100, "stop after this many epochs without a better fitness (0 = never stop early)", low=0)
    resume: bool | str = key(False, "true (resume the last run of project/name) or a path to weights/last.pt")
    optimizer: str = key(
        "auto",
        "SGD, AdamW, Adam, Adamax, NAdam, RAdam, RMSProp, MuSGD (SGD plus Muon: each weight matrix's update "
        "orthogonalised) or auto (AdamW up to 10,000 planned updates, MuSGD at lr0 0.01, momentum 0.9 above; as "
        "Ultralytics 8.4)",
        choices=("auto", "SGD", "AdamW", "Adam", "Adamax", "NAdam", "RAdam", "RMSProp", "MuSGD"),
    )
    lr0: float = key(0.01, "initial learning rate", low=0.0)
    lrf: float = key(0.01, "final learning rate as a fraction of lr0", low=0.0, high=1.0)
    momentum: float = key(
        0.937,
        "SGD/MuSGD/RMSProp momentum (nesterov for SGD; warmup ends at it) or the Adam family's beta1",
        low=0.0,
        high=1.0,
    )
    weight_decay: float = key(0.0005, "weight decay at the nominal batch size (nbs; 64 with nbs=auto)", low=0.0)
    warmup_epochs: float = key(3.0, "warmup length in epochs (at most epochs - 1; 0 = off)", low=0.0)
    warmup_momentum: float = key(0.8, "momentum at the start of warmup", low=0.0, high=1.0)
    warmup_bias_lr: float = key(0.1, "bias learning rate at the start of warmup", low=0.0)
    cos_lr: bool = key(False, "cosine instead of linear learning-rate decay")
    nbs: int | str = key(
        "auto",
        "images per optimizer update (gradients accumulate up to it): auto = 64, or "
        "the batch itself for short runs from scratch (optimizer=auto picks AdamW)",
        low=1,
        parse=auto_or_count,
    )
    lr_scale: str = key(
        "auto",
        "learning rate as the update grows past the one lr0 is used with at batch 16 (16 images for AdamW from "
        "scratch, which updates every batch; else nbs, 64 with nbs=auto): auto (square root for Adam's kind, 2 x "
        "at batch 64, 4 x at 256; linear for SGD and MuSGD), linear, sqrt, or none (lr0 whatever the batch, as "
        "Ultralytics); all but none also give BatchNorm's running statistics a momentum that follows the global "
        "batch past 16 images (0.386 at 256; none: 0.03)",
        choices=("auto", "linear", "sqrt", "none"),
    )
    bn_images: int = key(
        0,
        "images each BatchNorm layer normalises over in a training forward pass (ghost batches, each a run of "
        "the worker's batch; the running statistics take one update per run): 16 on one worker of batch 256 "
        "normalises as 16 workers of 16 do; 0 = the whole pass (as Ultralytics)",
        low=0,
    )
    clip_grad: float = key(10.0, "clip the gradient norm to this value (0 = off)", low=0.0)
    nonfinite_limit: int = key(
        10,
        "an update whose loss or gradients hold NaN/inf on any worker is skipped by every worker; this many in a "
        "row stop the run (0 = never stop)",
        low=0,
    )
    amp: bool | str = key(
        True,
        "mixed precision on CUDA: true (bf16 where supported, else fp16 with a grad scaler), bf16 or fp16 (that "
        "dtype), false or fp32 (off); validation in fp16; checked against fp32 on the model before training; "
        "off CUDA float32",
        parse=amp_mode,
    )
    compile: bool | str = key(
        False,
        "torch.compile the training forward (in place, so checkpoints keep their names; validation and the EMA stay "
        "eager): false, true (inductor, default mode), reduce-overhead, max-autotune, max-autotune-no-cudagraphs, "
        "or aot_eager (traces without generating code); off by default: the first steps compile for minutes (on a "
        "2-core CPU 3.6 min for yolov8n at 320 px, then 1.15x faster steps), and each new batch shape recompiles",
        choices=(False, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "aot_eager"),
        parse=compile_mode,
    )
    seed: int = key(0, "random seed of the run (0 to 2147483647)", low=0)
    deterministic: bool = key(
        True, "use deterministic algorithms where torch offers them; false: faster CUDA (cuDNN picks its kernels)"
    )
    close_mosaic: int = key(10, "turn mosaic off for the last N epochs", low=0)
    freeze: int | list | None = key(
        None,
        "freeze the first N layers (freeze=10), the layers listed (freeze=0,1,2) or, as Ultralytics lists them, "
        "parts of a layer by name (freeze=[0, 9.cv1]: parameters named model.9.cv1.*): their weights stay fixed, "
        "BatchNorm statistics still adapt",
        parse=freeze,
    )
    multi_scale: bool = key(
        False,
        "vary imgsz by +-50% per batch (chosen on rank 0, shared by all ranks); Ultralytics' fractions 0 and 0.5 "
        "read as false and true",
        parse=flag_or_half,
    )
    rect: bool = key(False, "rectangular training batches (no mosaic)")
    val: bool = key(True, "validate after every epoch")

    @property
    def batch_images(self) -> int:
        """``batch`` as a number of images. An AutoBatch value (-1, a fraction) has none yet: the trainer chooses
        one before anything reads it (engine/train/auto_batch.py), and val and predict refuse such values."""
        if isinstance(self.batch, float) or self.batch < 1:
            raise ConfigError(f"batch={self.batch:g} asks AutoBatch for a size, which training chooses on a GPU")
        return self.batch


@dataclass(frozen=True)
class Loss:
    """The gains of the three loss terms."""

    box: float = key(7.5, "box (CIoU) loss gain", low=0.0)
    cls: float = key(0.5, "classification (BCE) loss gain", low=0.0)
    dfl: float = key(1.5, "distribution focal loss gain", low=0.0)


@dataclass(frozen=True)
class Augment:
    """How training images are changed, each drawn per image from (seed, epoch, index)."""

    hsv_h: float = key(0.015, "hue jitter (fraction)", low=0.0, high=1.0)
    hsv_s: float = key(0.7, "saturation jitter (fraction)", low=0.0, high=1.0)
    hsv_v: float = key(0.4, "value jitter (fraction)", low=0.0, high=1.0)
    degrees: float = key(0.0, "rotation (+- degrees)", low=0.0, high=180.0)
    translate: float = key(0.1, "translation (+- fraction)", low=0.0, high=1.0)
    scale: float = key(0.5, "scale gain (+- fraction)", low=0.0, high=1.0)
    shear: float = key(0.0, "shear (+- degrees)", low=0.0, high=180.0)
    perspective: float = key(0.0, "perspective (+- fraction, 0 to 0.001)", low=0.0, high=0.001)
    flipud: float = key(0.0, "probability of a vertical flip", low=0.0, high=1.0)
    fliplr: float = key(0.5, "probability of a horizontal flip", low=0.0, high=1.0)
    mosaic: float = key(1.0, "probability of a 4-image mosaic", low=0.0, high=1.0)
    mixup: float = key(0.0, "probability of mixup", low=0.0, high=1.0)
    cutmix: float = key(
        0.0,
        "probability of CutMix: a rectangle of another training sample pasted where no box is, "
        "with its boxes inside it",
        low=0.0,
        high=1.0,
    )
    copy_paste: float = key(
        0.0,
        "must stay 0: copy-paste needs instance polygons (segment labels); detrain's labels are boxes",
        low=0.0,
        high=1.0,
        check=zero_only,
    )


@dataclass(frozen=True)
class Distributed:
    """Where the workers run: devices, nodes, the rendezvous and its timeouts."""

    device: Device = key(
        "",
        "'' (first GPU, else cpu), cpu, cpu,cpu (2 gloo workers), 0, 0,1 (one worker per GPU), -1 (the idlest "
        "GPU, at least 20% of its memory free; no GPU: cpu)",
        check=idle_device,
        commands=("train", "val", "predict"),
        launch=True,
        per_node=True,
    )
    workers: int | str = key(
        "auto",
        "dataloader worker processes per rank: auto = the cores this process may use shared by the node's ranks "
        "(at least 1, at most 16), or a number (0: load in the rank's own process)",
        low=0,
        high=64,
        parse=auto_or_count,
        launch=True,
        per_node=True,
    )
    nnodes: str = key(
        "1", "number of nodes, or MIN:MAX for elastic membership (as torchrun)", check=node_count, launch=True
    )
    node_rank: int = key(0, "rank of this node among nnodes", low=0, launch=True, per_node=True)
    master_addr: str = key(
        "127.0.0.1",
        "address of the node with node_rank 0; on one machine (nnodes=1) a cfg= file may give only loopback "
        "(127.0.0.1, ::1, localhost), another address is taken from the command line or the API only",
        non_empty="the host name or address of the node with node_rank 0",
        launch=True,
    )
    master_port: int = key(
        0, "port of the rendezvous on the master (0 = pick a free one on a single node)", low=0, high=65535, launch=True
    )
    rdzv_backend: str = key(
        "static",
        "static (fixed nodes) or c10d (elastic membership, nnodes=MIN:MAX)",
        choices=("static", "c10d"),
        launch=True,
    )
    # a name safe in store keys and messages
    run_id: str = key(
        "",
        "name of the job the nodes join ('' = derived from the arguments every node gives "
        "alike); a node with another id is turned away",
        pattern=(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", "'' or up to 64 letters, digits, '.', '_' or '-'"),
        launch=True,
        per_node=True,
    )
    # interface names (Linux allows at most 15 characters)
    socket_ifname: str = key(
        "",
        "network interface(s) for gloo/NCCL traffic, e.g. eth0 ('' = gloo: the one that "
        "reaches master_addr, loopback on one machine)",
        pattern=(
            r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,14}(,[A-Za-z0-9][A-Za-z0-9._@:-]{0,14})*",
            "'' or interface names like eth0 (comma-separated)",
        ),
        launch=True,
        per_node=True,
    )
    max_restarts: int = key(
        0,
        "restarts of the worker group after a worker dies or a node leaves (every node "
        "resumes from the furthest last.pt or mid.pt of any node)",
        low=0,
        launch=True,
    )
    restart_backoff: float = key(
        1.0,
        "seconds the workers wait before the first restart, doubled at each further restart up to "
        "restart_backoff_max (and below half of dist_timeout); 0 = restart at once",
        low=0.0,
        high=3600.0,
    )
    restart_backoff_max: float = key(60.0, "the longest wait before a restart, in seconds", low=0.0, high=3600.0)
    restart_same_failures: int = key(
        2,
        "stop the run instead of restarting once the same error ended this many attempts in a row with no new "
        "last.pt or mid.pt in between (0 = use up max_restarts; 1 is not allowed)",
        low=0,
        check=same_failures,
    )
    requeue_without_progress: int = key(
        3,
        "SLURM: requeue a preempted job at most this many times in a row from the same checkpoint, then stop with "
        "one line (0 = no limit)",
        low=0,
    )
    dist_timeout: float = key(
        120.0,
        "seconds a collective may wait for a slow or dead rank once training runs (at most 604800, a week)",
        low=1,
        high=WEEK_S,
        launch=True,
    )
    prepare_timeout: float = key(
        PREPARE_TIMEOUT_S,
        "seconds ranks wait while each node's first process downloads, verifies "
        "labels, fills cache=ram (at most a week)",
        low=1,
        high=WEEK_S,
        launch=True,
    )
    sync_bn: bool = key(False, "convert BatchNorm to SyncBatchNorm when training on several workers")
    parallel: str = key(
        "ddp",
        "several workers: ddp = every worker holds the whole model (DistributedDataParallel); fsdp = parameters, "
        "gradients and optimizer state sharded over the workers (torch's fully_shard); hsdp = sharded within a node, "
        "replicated across the nodes (a nodes x workers-per-node mesh; every node the same number of workers)",
        choices=("ddp", "fsdp", "hsdp"),
        launch=True,
    )

    @property
    def node_range(self) -> tuple[int, int]:
        """``nnodes`` as (MIN, MAX) nodes, as checked when the config was made."""
        return node_range(self.nnodes)


@dataclass(frozen=True)
class Output:
    """Where a run writes and what it keeps and prints."""

    project: str = key(
        "",
        "folder for runs ('' = runs/<task>); from a cfg= file only a folder inside the current one, or the project "
        "of the run folder the file lies in (<project>/<name>/args.yaml): elsewhere from the command line or the API",
        check=folder,
        commands=("train", "val", "predict", "export"),
        per_node=True,
    )
    name: str = key(
        "",
        "run folder name, one folder inside project ('' = exp, exp2, ...)",
        check=folder,
        commands=("train", "val", "predict", "export"),
        per_node=True,
    )
    exist_ok: bool = key(
        False,
        "reuse an existing run folder instead of incrementing the name",
        commands=("train", "val", "predict", "export"),
        per_node=True,
    )
    save: bool = key(
        True,
        "save checkpoints (weights/last.pt and best.pt); predict: annotated images and videos "
        "(Model.predict: false unless given)",
        commands=("train", "predict"),
    )
    save_period: int = key(-1, "also save weights/epochN.pt every N epochs (-1 = off)", low=-1)
    save_interval: float = key(
        0.0,
        "also save weights/mid.pt every N minutes within an epoch, so a restart loses minutes, not an epoch (0 = off)",
        low=0.0,
        high=WEEK_S / 60,
    )
    save_replicas: int = key(
        2,
        "nodes that hold the run folder (on a run of several nodes: node 0's last.pt and mid.pt at each save, and "
        "after each epoch results, events, args, manifest, best.pt and epochN.pt, sent to the next nodes' own disks, "
        "so losing node 0 loses nothing; 1 = node 0 only)",
        low=1,
    )
    grace: float = key(
        25.0,
        "seconds a preempted run has: on SIGTERM or SIGUSR1 every rank saves weights/mid.pt at the same step and "
        "the run exits 75 (resumable: resume=true continues it; requeued under SLURM); 0 = the signal just stops it",
        low=0.0,
        high=3600.0,
    )
    plots: bool = key(
        True,
        "save plots: train_batch*.jpg, results.png, labels.jpg; curves, confusion matrices, val_batch*.jpg (train: "
        "the last validation's)",
        commands=("train", "val"),
        per_node=True,
    )
    tensorboard: bool = key(
        False, 'log each epoch\'s results.csv row to tensorboard (pip install "detrain[tensorboard]")', per_node=True
    )
    mlflow: bool = key(
        False,
        "log the args, each results.csv row and best.pt to MLflow: $MLFLOW_TRACKING_URI, else a local store in "
        '<project>/mlflow (pip install "detrain[mlflow]")',
        per_node=True,
    )
    wandb: bool = key(
        False,
        "log the args, each results.csv row and best.pt to Weights & Biases, offline in <run>/wandb unless "
        '$WANDB_MODE says online (pip install "detrain[wandb]")',
        per_node=True,
    )
    verbose: bool = key(
        True,
        "print per-class metrics and progress (info: the per-layer table)",
        commands=("train", "val", "predict", "info"),
        per_node=True,
    )


@dataclass(frozen=True)
class Predict:
    """How predictions are made and scored: val's split and thresholds, predict's sources and outputs."""

    split: str = key(
        "val",
        "dataset split for `detrain val`: val, test or train",
        choices=("val", "test", "train"),
        commands=("val",),
    )
    conf: float | None = key(
        None,
        "confidence threshold (null = 0.001 for val, 0.25 for predict)",
        low=0.0,
        high=1.0,
        commands=("train", "val", "predict"),
    )
    iou: float = key(0.7, "NMS IoU threshold", low=0.0, high=1.0, commands=("train", "val", "predict"))
    max_det: int = key(300, "maximum detections per image", low=1, commands=("train", "val", "predict"))
    agnostic_nms: bool = key(
        False,
        "val (also after each training epoch) and predict: NMS across classes (a box "
        "suppresses overlapping boxes of any class)",
        commands=("train", "val", "predict"),
    )
    nms: bool = key(
        False,
        "end-to-end (YOLO26) models: detect with the one-to-many branch and NMS instead of the NMS-free "
        "one-to-one top-k (other models always use NMS); export: the graph then ends in that branch's boxes",
        commands=("train", "val", "predict", "export"),
    )
    augment: bool = key(
        False,
        "val and predict: test-time augmentation as Ultralytics does it, the model run at scales 1, 0.83 "
        "(flipped left-right) and 0.67 and the boxes merged by one NMS (about 3x the time; an end-to-end head "
        "without nms=true, or an exported file, runs at one scale with a note)",
        commands=("val", "predict"),
    )
    save_json: bool = key(
        False, "write predictions.json (COCO results format) next to metrics.json", commands=("train", "val")
    )
    predictions: str = key(
        "", "score an existing COCO-format predictions json instead of running a model", commands=("val",)
    )
    source: str = key(
        "",
        "predict: an image, a video, a folder (recursive), a glob, a .txt list of paths, a camera "
        "index (0) or a stream URL",
        commands=("predict",),
    )
    half: bool = key(
        False,
        "val and predict: float16 inference on CUDA (val: the forward under autocast, NMS and scores in float32); "
        "elsewhere, and for an exported graph, float32 with a note; export: onnx a float16 graph (onnxruntime "
        "runs it on a CPU), openvino float16 weights, torchscript float32 (traced on the CPU; a note says so)",
        commands=("val", "predict", "export"),
    )
    save_txt: bool = key(
        False,
        "predict: write YOLO-format .txt results (labels/<name>.txt; none for a picture without detections)",
        commands=("predict",),
    )
    save_conf: bool = key(False, "predict: include the confidence in the .txt results", commands=("predict",))
    line_width: int = key(
        0,
        "predict: box line width in pixels (0 = from the image size; at most 32767)",
        low=0,
        high=32767,
        commands=("predict",),
    )
    save_crop: bool = key(
        False,
        "predict: each detection cut out as crops/<class name>/<picture stem>.jpg (video frames <stem>_<frame>.jpg), "
        "as Ultralytics lays them out and cuts them (the box 2% and 10 pixels larger; a second of one class in a "
        "picture <stem>2.jpg)",
        commands=("predict",),
    )
    vid_stride: int = key(
        1,
        "predict: every n-th frame of a video, camera or stream (frames 0, n, 2n...; the annotated video plays "
        "at the source's rate / n)",
        low=1,
        commands=("predict",),
    )
    show: bool = key(
        False,
        "predict: show each drawn picture in a window where a display exists; without one, the drawings are saved "
        "in the run folder and one line says where",
        commands=("predict",),
    )
    show_labels: bool = key(True, "predict: draw each box's label (false: the boxes alone)", commands=("predict",))
    show_conf: bool = key(
        True, "predict: the confidence in each label (false: the class name alone)", commands=("predict",)
    )
    show_boxes: bool = key(
        True, "predict: draw the boxes and labels (false: the picture as it is)", commands=("predict",)
    )


@dataclass(frozen=True)
class Export:
    """The exported file's format and its options."""

    format: str = key(
        "onnx",
        "export format: onnx (.onnx), torchscript (.torchscript) or openvino (a <stem>_openvino_model folder: "
        "OpenVINO IR, pip install detrain[openvino])",
        choices=("onnx", "torchscript", "openvino"),
        commands=("export",),
    )
    opset: int = key(17, "ONNX opset (onnx only)", low=11, high=23, commands=("export",))
    dynamic: bool = key(
        True,
        "ONNX and OpenVINO: any batch and image size (multiples of 32; a YOLO26 top-k graph: any batch); false: "
        "(1, 3, imgsz, imgsz) only (a TorchScript export takes any batch and size)",
        commands=("export",),
    )


@dataclass(frozen=True)
class Cfg:
    """Every argument of every command, validated and frozen, by section: ``cfg.train.epochs``.

    Made by ``detrain.config.cfg.make_cfg`` from flat keys, changed by ``replace_cfg(cfg, {"epochs": 5})`` (each
    changed value checked); ``to_dict()`` gives them back flat (args.yaml, checkpoints, run ids). ``Cfg()`` holds
    the defaults, in the form ``make_cfg()`` gives them."""

    inputs: Inputs = field(default_factory=Inputs)
    train: Train = field(default_factory=Train)
    loss: Loss = field(default_factory=Loss)
    augment: Augment = field(default_factory=Augment)
    distributed: Distributed = field(default_factory=Distributed)
    output: Output = field(default_factory=Output)
    predict: Predict = field(default_factory=Predict)
    export: Export = field(default_factory=Export)

    def to_dict(self) -> dict[str, Any]:
        """Every key with its value, flat as users give them: ``{"model": "n.yaml", ..., "dynamic": True}``."""
        return {name: _copy(getattr(getattr(self, SECTION_OF[name]), name)) for name in SECTION_OF}

    def node_shared(self) -> dict[str, Any]:
        """Every key the nodes of one job give alike (all but the ``per_node`` ones), flat as ``to_dict()``."""
        return {name: value for name, value in self.to_dict().items() if not SPECS[name].per_node}

    def get(self, name: str) -> Any:
        """The value of a key by its flat name (``cfg.get("epochs")`` is ``cfg.train.epochs``); KeyError for a
        name that is no key."""
        return getattr(getattr(self, SECTION_OF[name]), name)


def _copy(value: Any) -> Any:
    if isinstance(value, ImageSize):  # imgsz=[h, w]: written as the list it was given as
        return list(value.hw)
    return list(value) if isinstance(value, list) else value


# Section name -> its class, in the order of cfg/default.yaml and --help.
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Cfg)}  # type: ignore[misc]
# Each section's heading in cfg/default.yaml and --help.
TITLES: dict[str, str] = {
    "inputs": "model and data",
    "train": "training",
    "loss": "loss gains",
    "augment": "augmentation",
    "distributed": "devices and processes",
    "output": "output",
    "predict": "validation and prediction",
    "export": "export",
}
# key -> the section that holds it
SECTION_OF: dict[str, str] = {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
# key -> its Spec, and its type
SPECS: dict[str, Spec] = {f.name: f.metadata["spec"] for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
TYPES: dict[str, Any] = {name: typ for cls in SECTIONS.values() for name, typ in get_type_hints(cls).items()}
# command -> the keys it takes, in section order; naming another key for it is an error
COMMAND_KEYS: dict[str, tuple[str, ...]] = {
    command: tuple(name for name, spec in SPECS.items() if command in spec.commands) for command in COMMANDS
}
# Keys of Ultralytics' default.yaml (8.4, what `yolo copy-cfg` writes) that detrain does not have: other tasks'
# (segment, pose, obb, classify, track, distillation) and features it lacks. A cfg= file that holds them is read
# with them left out and one note naming them; on the command line they stay unknown keys (one line, exit 2).
ULTRALYTICS_ONLY = frozenset(
    """
    overlap_mask mask_ratio retina_masks pose kobj rle angle cls_pw dis dlog dgrad dlam distill_model tracker
    profile channels_last dropout quantize dnn stream_buffer visualize embed save_frames optimize simplify workspace
    bgr copy_paste_mode auto_augment erasing cls_remap
    """.split()
)
# where and how the workers run: this launch's values, kept over a resumed checkpoint's
LAUNCH_KEYS: tuple[str, ...] = tuple(name for name, spec in SPECS.items() if spec.launch)
# the keys the nodes of one job may give differently; every other key they give alike
PER_NODE_KEYS: frozenset[str] = frozenset(name for name, spec in SPECS.items() if spec.per_node)


def defaults() -> dict[str, Any]:
    """key -> its default, flat, in section order."""
    return Cfg().to_dict()


def comments() -> dict[str, str]:
    """key -> its one-line help."""
    return {name: spec.help for name, spec in SPECS.items()}
