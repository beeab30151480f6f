"""The model contract has one source of truth: `nanocore.model_api.CausalLM`.

`check_model` derives the members it requires from the protocol, and every member the core or a
built-in plugin reads off a model is declared there, so a new member cannot be used unannounced."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from nanocore.errors import PluginError
from nanocore.model_api import OPTIONAL_MEMBERS, causal_lm_members, check_model, required_members

ROOT = Path(__file__).resolve().parents[2]
# what code reads off a model object without calling through the protocol: getattr/hasattr by name
READ = re.compile(r"""(?:getattr|hasattr)\((?:self\.)?(?:model|module|_model\(\)|local\.module), ["'](\w+)["']""")


class Complete(nn.Module):
    vocab_size = 8
    tp_plan: dict = {}

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 8)

    def forward(self, input_ids, kv_cache=None):
        return self.head(torch.zeros(*input_ids.shape, 4))

    def pipeline_blocks(self):
        return [["head"]]

    def init_parameter(self, name, tensor, generator):
        tensor.normal_(generator=generator)

    def flops_per_token(self, sequence_length):
        return 0.0


def test_required_members_are_the_protocol_less_the_optional_ones():
    members = causal_lm_members()
    assert set(OPTIONAL_MEMBERS) <= set(members), "an optional member the protocol does not declare"
    assert required_members() == [m for m in members if m not in OPTIONAL_MEMBERS]
    assert {"forward", "pipeline_blocks", "tp_plan", "init_parameter", "flops_per_token", "vocab_size"} == set(
        required_members()
    )


def test_a_complete_model_passes():
    check_model(Complete(), "complete")


@pytest.mark.parametrize("member", required_members())
def test_each_missing_required_member_is_refused_by_name(member):
    if member == "forward":  # every nn.Module has forward; a module without its own raises when called
        pytest.skip("nn.Module always has forward")
    cls = type("Incomplete", (Complete,), {member: property(lambda self: (_ for _ in ()).throw(AttributeError))})
    with pytest.raises(PluginError, match=rf"'incomplete' built a module without {member} \(the contract"):
        check_model(cls(), "incomplete")


def test_every_member_read_off_a_model_is_declared_by_the_protocol():
    declared = set(causal_lm_members())
    read: dict[str, str] = {}
    for folder in ("nanocore", "plugins"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in READ.findall(path.read_text()):
                read.setdefault(name, str(path.relative_to(ROOT)))
    assert read, "the pattern finds nothing: it no longer matches how the code reads a model"
    unknown = {name: where for name, where in read.items() if name not in declared}
    assert not unknown, f"read off a model but not declared in nanocore.model_api.CausalLM: {unknown}"
