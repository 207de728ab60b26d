"""Parameter shapes shared by the benchmarks."""

from __future__ import annotations

import math


def _resnet18() -> list[tuple[int, ...]]:
    # torchvision's resnet18 parameters, in order: 62 tensors, 11,689,512 floats.
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for out_ch, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            c_in = in_ch if block == 0 else out_ch
            shapes += [(out_ch, c_in, 3, 3), (out_ch,), (out_ch,)]
            shapes += [(out_ch, out_ch, 3, 3), (out_ch,), (out_ch,)]
            if block == 0 and (stride != 1 or c_in != out_ch):
                shapes += [(out_ch, c_in, 1, 1), (out_ch,), (out_ch,)]
        in_ch = out_ch
    shapes += [(1000, 512), (1000,)]
    return shapes


RESNET18 = _resnet18()
SMALL = [(1000,)] * 500
SUITES = {"resnet18": RESNET18, "500x1k": SMALL}

assert len(RESNET18) == 62
assert sum(math.prod(s) for s in RESNET18) == 11_689_512
