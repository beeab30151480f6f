"""Hardware descriptions (nanocore.hardware): the shipped entries, the file format and its errors,
and the alpha-beta cost of collectives the time model is built on."""

from __future__ import annotations

import math

import attrs
import pytest
import yaml

from nanocore.config.checks import check_config
from nanocore.config.converter import structure_config
from nanocore.errors import ConfigError
from nanocore.hardware import AttentionEfficiency, Hardware, Link, hardware_to_yaml, load_hardware, shipped_names
from nanocore.plugins import load_plugins
from tests.helpers.training import tiny_config


@pytest.mark.parametrize(
    ("name", "bf16", "memory_gib", "nvlink"),
    [("a100-80gb", 312e12, 80, 300e9), ("h100-sxm", 989.4e12, 80, 450e9), ("h200", 989.4e12, 141, 450e9)],
)
def test_shipped_entries_carry_their_datasheet_figures_and_cite_them(name, bf16, memory_gib, nvlink):
    assert name in shipped_names()
    hw = load_hardware(name)
    assert hw.name == name
    assert hw.peak("bfloat16") == pytest.approx(bf16)
    assert hw.memory_bytes == memory_gib * 2**30
    assert hw.intra_node.bandwidth == pytest.approx(nvlink)
    assert hw.devices_per_node == 8
    assert "datasheet" in hw.source
    assert hw.inter_node.bandwidth < hw.intra_node.bandwidth
    # the efficiency curve rises with a matmul's size and never claims more than the peak
    effs = [hw.efficiency(10.0**k) for k in range(7, 14)]
    assert effs == sorted(effs) and 0 < effs[0] and effs[-1] <= 1


def test_efficiency_is_interpolated_on_log_flops_and_flat_beyond_the_ends():
    hw = Hardware("x", "", {"float32": 1e12}, 2**30, 8, Link(1e9, 0.0), Link(1e8, 0.0),
                  matmul_efficiency=((1e6, 0.2), (1e8, 0.6)))  # fmt: skip
    assert hw.efficiency(1e3) == pytest.approx(0.2)
    assert hw.efficiency(1e7) == pytest.approx(0.4)  # half-way in log FLOPs
    assert hw.efficiency(1e12) == pytest.approx(0.6)
    assert hw.matmul_seconds(1e7, "float32") == pytest.approx(1e7 / (1e12 * 0.4))
    bare = Hardware("x", "", {"float32": 1e12}, 2**30, 8, Link(1e9, 0.0), Link(1e8, 0.0))
    assert bare.efficiency(123.0) == 1.0


def test_the_attention_core_runs_at_its_own_curves_or_else_as_a_matmul_with_a_backward_of_twice_it():
    flops = 1e7
    curve = Hardware("x", "", {"float32": 1e12}, 2**30, 8, Link(1e9, 0.0), Link(1e8, 0.0),
                     matmul_efficiency=((1e6, 0.2), (1e8, 0.6)))  # fmt: skip
    # no attention curves: one matmul of its FLOPs forward, twice that backward (the old model)
    assert curve.attention_seconds(flops, "float32") == pytest.approx(flops / (1e12 * 0.4))
    assert curve.attention_seconds(flops, "float32", backward=True) == pytest.approx(2 * flops / (1e12 * 0.4))
    fused = attrs.evolve(curve, attention_efficiency=AttentionEfficiency(((1e6, 0.1), (1e8, 0.3)), ((1e7, 0.25),)))
    assert fused.attention_seconds(flops, "float32") == pytest.approx(flops / (1e12 * 0.2))  # log half-way
    assert fused.attention_seconds(flops, "float32", backward=True) == pytest.approx(2 * flops / (1e12 * 0.25))
    assert fused.attention_seconds(0.0, "float32") == 0.0
    assert fused.matmul_seconds(flops, "float32") == curve.matmul_seconds(flops, "float32")  # matmuls unchanged
    # the shipped H100 and H200 cite FlashAttention-3's figure for FlashAttention-2 on an H100: 35 %
    for name in ("h100-sxm", "h200"):
        hw = load_hardware(name)
        assert hw.attention_efficiency is not None and "2407.08608" in (shipped_yaml := _shipped_text(name))
        assert "35% utilization" in shipped_yaml
        assert hw.attention_seconds(1e12, "bfloat16") == pytest.approx(1e12 / (989.4e12 * 0.35))
        assert hw.attention_seconds(1e12, "bfloat16", backward=True) == pytest.approx(2e12 / (989.4e12 * 0.28))
    # Megatron's 2021 runs on A100s had no fused kernel: their attention is matmuls at the curve
    assert load_hardware("a100-80gb").attention_efficiency is None


def _shipped_text(name: str) -> str:
    from importlib import resources

    return (resources.files("nanocore") / "hardware_specs" / f"{name}.yaml").read_text()


def test_collectives_follow_the_ring_alpha_beta_model_and_cross_nodes_at_the_slow_link():
    hw = Hardware("x", "", {"float32": 1e12}, 2**30, 4, Link(100e9, 1e-5), Link(10e9, 2e-5))
    size = 8e6
    # all-reduce over 4 devices of one node: 2 (n-1) steps of latency + size / n bytes each
    assert hw.collective_seconds("all_reduce", size, 4) == pytest.approx(6 * (1e-5 + 2e6 / 100e9))
    assert hw.collective_seconds("all_gather", size, 4) == pytest.approx(3 * (1e-5 + 2e6 / 100e9))
    assert hw.collective_seconds("reduce_scatter", size, 4) == hw.collective_seconds("all_gather", size, 4)
    # 4 devices 2 ranks apart span 7 ranks: two nodes of 4, so the inter-node link
    assert hw.collective_seconds("all_reduce", size, 4, stride=2) == pytest.approx(6 * (2e-5 + 2e6 / 10e9))
    assert hw.collective_seconds("send", size, 1) == pytest.approx(1e-5 + size / 100e9)
    assert hw.collective_seconds("all_reduce", size, 1) == 0.0
    # a kind measured on its own (what calibrate writes) runs at its own figures, in the same formula
    gloo = attrs.evolve(hw, intra_node=attrs.evolve(hw.intra_node, collectives={"all_gather": Link(25e9, 1e-3)}))
    assert gloo.collective_seconds("all_gather", size, 4) == pytest.approx(3 * (1e-3 + 2e6 / 25e9))
    assert gloo.collective_seconds("all_reduce", size, 4) == hw.collective_seconds("all_reduce", size, 4)
    assert gloo.collective_seconds("all_gather", size, 4, stride=2) == hw.collective_seconds("all_gather", size, 4, 2)


def test_a_file_round_trips_and_relative_figures_read_as_numbers(tmp_path):
    hw = load_hardware("h100-sxm")
    path = tmp_path / "hw.yaml"
    path.write_text(hardware_to_yaml(hw, measured={"note": "kept"}))
    again = load_hardware(str(path))
    assert again == hw
    slow = attrs.evolve(hw, op_overhead=3e-6, compute_overlap=0.25)  # what calibrate measures travels too
    path.write_text(hardware_to_yaml(slow))
    assert load_hardware(str(path)) == slow
    kinds = {"send": Link(1e9, 1.5e-3), "all_to_all": Link(2e9, 1e-3)}
    measured = attrs.evolve(hw, intra_node=attrs.evolve(hw.intra_node, collectives=kinds))
    path.write_text(hardware_to_yaml(measured))
    assert load_hardware(str(path)) == measured
    assert hw.attention_efficiency is not None  # the H100's attention curves travel too
    bare = attrs.evolve(hw, attention_efficiency=None)
    path.write_text(hardware_to_yaml(bare))
    assert load_hardware(str(path)) == bare and "attention_efficiency" not in path.read_text()
    assert slow.memory_bound_seconds(10, 3.35e9) == pytest.approx(10 * 3e-6 + 1e-3)
    # YAML 1.1 reads 1e9 (no dot, no exponent sign) as a string: the loader takes it as a number
    data = yaml.safe_load(path.read_text())
    data["peak_flops"] = {"float32": "1e9"}
    path.write_text(yaml.safe_dump(data))
    assert load_hardware(str(path)).peak("float32") == 1e9


def test_every_problem_of_a_bad_file_is_named_by_its_field_in_one_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "bad",
                "peak_flops": {"float32": "fast", "int4": 1.0},
                "memory": "lots",
                "devices_per_node": 0,
                "intra_node": {"bandwidth": -1},
                "inter_node": {
                    "bandwidth": 1e9,
                    "latency": 1e-5,
                    "collectives": {"broadcast": {"bandwidth": 1e9}, "send": {"bandwidth": 0}},
                    "hops": 2,
                },
                "matmul_efficiency": [[1e9, 1.5], [3]],
                "colour": "green",
                "op_overhead": -1e-6,
                "compute_overlap": 1.5,
                "attention_efficiency": {"forward": [[1e9, 2.0]], "backward": "fast"},
            }
        )
    )
    with pytest.raises(ConfigError) as info:
        load_hardware(str(path))
    text = str(info.value)
    for field in (
        "peak_flops.float32: expected a number",
        "peak_flops.int4: unknown dtype",
        "memory: cannot read 'lots'",
        "devices_per_node: expected a positive integer",
        "intra_node.bandwidth: expected a positive number",
        "matmul_efficiency[0]: a fraction of the peak above 1",
        "matmul_efficiency[1]: expected [FLOPs of one matmul, fraction of peak]",
        "colour: unknown field",
        "op_overhead: expected seconds >= 0",
        "compute_overlap: expected a share from 0 to 1",
        "inter_node.collectives.broadcast: unknown collective",
        "inter_node.collectives.send.bandwidth: expected a positive number",
        "inter_node.hops: unknown field",
        "attention_efficiency.forward[0]: a fraction of the peak above 1",
        "attention_efficiency.backward: expected a list of [FLOPs, fraction of peak] pairs",
    ):
        assert field in text, field
    assert len(info.value.problems) == 16  # the two above and: a pass without a point
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "attention_efficiency": {"forward": []}}))
    with pytest.raises(ConfigError, match=r"attention_efficiency: expected \{forward"):
        load_hardware(str(path))


def test_the_config_names_a_hardware_it_cannot_find_before_anything_starts(tmp_path):
    registries = load_plugins().registries
    raw = tiny_config(tmp_path, general={"hardware": "h300-imaginary"})
    with pytest.raises(ConfigError) as info:
        check_config(structure_config(raw, registries), registries, 1)
    (problem,) = info.value.problems
    assert problem.startswith("general.hardware: hardware 'h300-imaginary': neither a shipped name (a100-80gb")
    assert "nanocore calibrate" in problem
    raw = tiny_config(tmp_path, general={"hardware": "h200"})
    check_config(structure_config(raw, registries), registries, 1)  # a shipped name passes


def test_unknown_dtype_peak_says_what_the_description_has():
    with pytest.raises(ConfigError, match="declares no peak_flops.float8 .it has: bfloat16, float16, float32, tf32"):
        load_hardware("a100-80gb").peak("float8")
    assert math.isclose(load_hardware("h200").peak("float8"), 1978.9e12)
