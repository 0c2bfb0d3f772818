"""scripts/bench_quickstart.py names the host in its table's header: the quick start's figures moved from 0.836 to
0.642 mAP50 with no commit between (the same 08abb6f on a re-provisioned machine gives the new row), and the old
header ('2-CPU x86_64') could not tell the two machines apart."""

from __future__ import annotations

import torch

from tests._scripts import load_script

CPUINFO = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Example CPU 9000 @ 2.1GHz\nflags\t\t: fpu avx2\n"


def test_cpu_model_is_read_from_cpuinfo() -> None:
    bench = load_script("bench_quickstart")
    assert bench.cpu_model(CPUINFO) == "Example CPU 9000 @ 2.1GHz"
    assert bench.cpu_model("") != ""  # no cpuinfo: platform's words, never empty


def test_host_names_cpu_kernels_and_torch() -> None:
    line = load_script("bench_quickstart").host()
    assert torch.__version__ in line
    assert torch.backends.cpu.get_cpu_capability() in line
    assert "CPUs" in line and "load " in line
