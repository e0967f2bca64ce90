"""kernel_timeline's layer stretches on a made-up timeline: two steps of three layers of three
kernels, with an embedding before and an LM head after each step."""

from __future__ import annotations

import pytest

from benchmarks.kernel_timeline import Kernel, layer_marker, one_layer, step_level

LAYER = [("norm", 2.0), ("gemv", 10.0), ("act", 1.0)]


def timeline(steps: int = 2, layers: int = 3) -> list[Kernel]:
    out: list[Kernel] = []
    t = 0.0
    for _ in range(steps):
        for name, us in [("embed", 3.0)] + LAYER * layers + [("head", 20.0)]:
            out.append((t, t + us, name))
            t += us + 0.5  # an idle gap before every kernel
    return out


def test_the_marker_is_the_first_kernel_run_once_a_layer() -> None:
    assert layer_marker(timeline(), 6) == "norm"
    assert layer_marker(timeline(), 7) is None


def test_one_layer_averages_its_kernels_and_the_period() -> None:
    layer = one_layer(timeline(), lambda name: name == "norm")
    assert [k["name"] for k in layer["kernels"]] == ["norm", "gemv", "act"]
    assert [k["us"] for k in layer["kernels"]] == pytest.approx([2.0, 10.0, 1.0])
    # gaps: 0.5 before each kernel (the first layer's norm follows the embedding)
    assert all(k["gap_us"] == pytest.approx(0.5) for k in layer["kernels"])
    assert layer["us"] == pytest.approx(13.0 + 3 * 0.5)
    # the stretch across a step boundary (act, head, embed, norm) is longer: not averaged
    assert layer["spans"] == 4


def test_step_level_kernels_are_those_outside_the_layers() -> None:
    rows = step_level(timeline(), 6, 2)
    assert [(r["name"], r["us"]) for r in rows] == [("head", pytest.approx(20.0)), ("embed", pytest.approx(3.0))]


def test_a_timeline_without_markers_says_so() -> None:
    assert one_layer(timeline(), lambda name: name == "missing")["spans"] == 0
