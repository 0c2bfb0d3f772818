"""YOLO11's own blocks: C3k and C3k2 (CSP blocks around 3x3 bottlenecks), and C2PSA, a CSP block around
position-sensitive self-attention (Attention, PSABlock) that YOLO11 runs once on the stride-32 map. YOLO26 uses
the same blocks, and one more form of C3k2 whose inner blocks carry a PSABlock each.

As in :mod:`detrain.nn.modules`, attribute names and nesting are Ultralytics' (``cv1``/``cv2``/``cv3``/``m``,
``attn``/``ffn``, ``qkv``/``proj``/``pe``), so the state-dict keys of YOLO11 and YOLO26 checkpoints load by name.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from detrain.nn.modules import Bottleneck, C2f, Conv

__all__ = ["C2PSA", "Attention", "C3k", "C3k2", "PSABlock"]


class C3k(nn.Module):
    """CSP block with three 1x1 Convs: ``cv1`` feeds ``n`` full-width 3x3 Bottlenecks, ``cv2`` is the bypass,
    ``cv3`` mixes the two. C3k2 uses it (n=2) as its inner block at the larger scales.

    >>> C3k(16, 16)(torch.zeros(1, 16, 8, 8)).shape
    torch.Size([1, 16, 8, 8])
    """

    def __init__(self, c1: int, c2: int, n: int = 2, shortcut: bool = True, e: float = 0.5) -> None:
        super().__init__()
        hidden = int(c2 * e)
        self.cv1 = Conv(c1, hidden, 1)
        self.cv2 = Conv(c1, hidden, 1)
        self.cv3 = Conv(2 * hidden, c2, 1)
        self.m = nn.Sequential(*(Bottleneck(hidden, hidden, shortcut) for _ in range(n)))

    def forward(self, x: Tensor) -> Tensor:
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class C3k2(C2f):
    """C2f's wiring around other inner blocks: half-width Bottlenecks (3x3 convs over half the channels,
    residual), or with ``c3k`` a C3k each, or with ``attn`` (YOLO26) a half-width Bottleneck followed by a
    PSABlock (one attention head per 64 channels); ``attn`` wins over ``c3k``, as in Ultralytics' builder.

    >>> C3k2(16, 32, n=1, c3k=True)(torch.zeros(1, 16, 8, 8)).shape
    torch.Size([1, 32, 8, 8])
    >>> inner = C3k2(16, 32, n=1).m[0]  # works on 16 of the 32 channels, its 3x3 convs 8 wide
    >>> type(inner).__name__, inner.cv1.conv.out_channels
    ('Bottleneck', 8)
    >>> [type(m).__name__ for m in C3k2(128, 128, n=1, attn=True).m[0]]
    ['Bottleneck', 'PSABlock']
    """

    def __init__(
        self, c1: int, c2: int, n: int = 1, c3k: bool = False, e: float = 0.5, attn: bool = False, shortcut: bool = True
    ) -> None:
        def block(c: int) -> nn.Module:
            if attn:
                return nn.Sequential(
                    Bottleneck(c, c, shortcut, e=0.5), PSABlock(c, attn_ratio=0.5, num_heads=max(c // 64, 1))
                )
            return C3k(c, c, 2, shortcut) if c3k else Bottleneck(c, c, shortcut, e=0.5)

        super().__init__(c1, c2, n, shortcut, e, block=block)
        self.c3k = c3k and not attn  # what the inner blocks are: C3k only without attention
        self.attn = attn


class Attention(nn.Module):
    """Multi-head self-attention over the pixels of a map, with a depthwise 3x3 positional term on the values.

    One 1x1 ``qkv`` Conv gives, per head, ``key_dim`` query and key channels and ``head_dim`` value channels
    (laid out head by head, as Ultralytics' weights are); ``pe`` (depthwise 3x3) adds where-information to the
    attended values, ``proj`` mixes the heads. Costs grow with the square of the pixel count, which is why
    YOLO11 uses it only at stride 32.

    >>> Attention(128, num_heads=2)(torch.zeros(1, 128, 4, 4)).shape
    torch.Size([1, 128, 4, 4])
    """

    def __init__(self, dim: int, num_heads: int = 8, attn_ratio: float = 0.5) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.key_dim = int(self.head_dim * attn_ratio)
        self.scale = self.key_dim**-0.5
        qkv_channels = dim + 2 * self.key_dim * num_heads
        self.qkv = Conv(dim, qkv_channels, 1, act=False)
        self.proj = Conv(dim, dim, 1, act=False)
        self.pe = Conv(dim, dim, 3, g=dim, act=False)

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        pixels = h * w
        # reshape, not view: under channels_last the qkv map is not contiguous in (B, C, H*W) order
        per_head = self.qkv(x).reshape(b, self.num_heads, 2 * self.key_dim + self.head_dim, pixels)
        q, k, v = per_head.split((self.key_dim, self.key_dim, self.head_dim), dim=2)  # (B, heads, channels, HW)
        weights = (q.transpose(-2, -1) @ (k * self.scale)).softmax(dim=-1)  # (B, heads, HW query, HW key)
        attended = (v @ weights.transpose(-2, -1)).reshape(b, c, h, w)
        return self.proj(attended + self.pe(v.reshape(b, c, h, w)))


class PSABlock(nn.Module):
    """Attention then a two-layer 1x1 feed-forward (2x wider inside), each added to its input when ``shortcut``.

    >>> PSABlock(128, num_heads=2)(torch.zeros(1, 128, 4, 4)).shape
    torch.Size([1, 128, 4, 4])
    """

    def __init__(self, c: int, attn_ratio: float = 0.5, num_heads: int = 4, shortcut: bool = True) -> None:
        super().__init__()
        self.attn = Attention(c, num_heads=num_heads, attn_ratio=attn_ratio)
        self.ffn = nn.Sequential(Conv(c, 2 * c, 1), Conv(2 * c, c, 1, act=False))
        self.add = shortcut

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(x) if self.add else self.attn(x)
        return x + self.ffn(x) if self.add else self.ffn(x)


class C2PSA(nn.Module):
    """CSP block around ``n`` PSABlocks: ``cv1`` splits the channels in two halves, one half goes through the
    attention blocks (one head per 64 channels), ``cv2`` joins them. Input and output widths are equal.

    >>> C2PSA(256, 256)(torch.zeros(1, 256, 4, 4)).shape
    torch.Size([1, 256, 4, 4])
    """

    def __init__(self, c1: int, c2: int, n: int = 1, e: float = 0.5) -> None:
        super().__init__()
        if c1 != c2:
            raise ValueError(f"C2PSA keeps its width: {c1} channels in, {c2} out")
        self.c = int(c1 * e)
        self.cv1 = Conv(c1, 2 * self.c, 1)
        self.cv2 = Conv(2 * self.c, c1, 1)
        heads = max(self.c // 64, 1)
        self.m = nn.Sequential(*(PSABlock(self.c, attn_ratio=0.5, num_heads=heads) for _ in range(n)))

    def forward(self, x: Tensor) -> Tensor:
        kept, attended = self.cv1(x).split((self.c, self.c), dim=1)
        return self.cv2(torch.cat((kept, self.m(attended)), 1))
