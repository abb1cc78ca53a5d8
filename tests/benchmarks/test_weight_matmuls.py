"""The weight-format survey computes what each format's own weights say: torch's int8 and int4
kernels read the codes, scales and offsets as the survey packs them, and kvpool's own kernel
computes its format's weights up to its activations' int8 rounding."""

from __future__ import annotations

import pytest

from benchmarks.weight_matmuls import run, step_shapes, weight_bytes
from kvpool.model.presets import preset


@pytest.fixture(scope="module")
def report():
    return run(preset("tiny"), batches=[1, 3], groups=[32, 64], repeats=1)


def test_every_format_is_timed_at_every_batch(report):
    assert set(report["formats"]) == {"fp32", "bf16", "int8", "int4-g32", "int4-g64",
                                      "q4-g32", "q4-g64", "q8-g32", "q8-g64"}
    assert all(set(row["ms_per_step"]) == {1, 3} for row in report["formats"].values())
    assert report["shapes"] == len(step_shapes(preset("tiny"))) == 2 * 4 + 1


def test_each_kernel_matches_float32_on_its_own_weights(report):
    errors = {name: row["max_rel_error"] for name, row in report["formats"].items()}
    assert errors["fp32"] < 1e-5
    torch_kernels = {name: error for name, error in errors.items() if not name.startswith("q")}
    assert all(error < 1e-2 for error in torch_kernels.values()), errors  # bf16: ~4e-3
    # kvpool's kernel rounds the activations to int8 per group (its tests bound that exactly)
    assert all(errors[name] < 3e-2 for name in errors if name.startswith("q")), errors


def test_bytes_per_weight_count_the_scales():
    assert weight_bytes("bf16", 64, 128) == 2 * 64 * 128
    assert weight_bytes("q8-g32", 64, 128) == 64 * 128 + 4 * 64 * 128 / 32
    assert weight_bytes("int8", 64, 128) == 64 * 128 + 2 * 64
    assert weight_bytes("int4-g32", 64, 128) == 64 * 128 / 2 + 4 * 64 * 128 / 32


def test_each_format_holds_the_weight_to_its_resolution(report):
    errors = {name: row["weight_error"] for name, row in report["formats"].items()}
    assert errors["fp32"] == 0
    assert errors["bf16"] <= 2**-8
    # Half a step of 1/127 of the row's largest (a little more where the bf16 scale rounded
    # down and the largest code clamps at 127).
    assert errors["int8"] <= 1 / 254 + 2**-9
    # Half a step of a group's range (at most twice the largest weight) over 15 steps, plus
    # the bf16 rounding of the scale and offset.
    assert errors["int4-g32"] <= 1 / 15 + 0.01 and errors["int4-g64"] <= 1 / 15 + 0.01
    # kvpool's: half a step of the group's range over 15 (4-bit) or 255 (8-bit) steps, plus the
    # float16 rounding of the scale and min
    assert errors["q4-g32"] <= 1 / 15 + 0.01 and errors["q8-g64"] <= 1 / 255 + 0.01
