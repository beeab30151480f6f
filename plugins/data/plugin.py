"""Built-in dataset formats (`dummy`, `nanoset`, `hf`) and the `nanocore preprocess` command."""

from __future__ import annotations

from nanocore import hookimpl
from nanocore_plugins.data import preprocess
from nanocore_plugins.data.dummy import DummyArgs, build_dummy
from nanocore_plugins.data.hf import HFArgs, build_hf
from nanocore_plugins.data.nanoset import NanosetArgs, build_nanoset


@hookimpl
def register_dataset_formats(registry):
    registry.register(
        "dummy", build_dummy, config_class=DummyArgs, description="random tokens, nothing stored (`dataset: null`)"
    )
    registry.register(
        "nanoset",
        build_nanoset,
        config_class=NanosetArgs,
        description="pre-tokenized *.ds folders (datatrove DocumentTokenizer / nanotron Nanoset layout)",
    )
    registry.register(
        "hf",
        build_hf,
        config_class=HFArgs,
        description="local files or save_to_disk folders via Hugging Face datasets, tokenized once and cached",
    )


@hookimpl
def register_commands(registry):
    registry.register(
        "preprocess",
        preprocess.run,
        add_arguments=preprocess.add_arguments,
        description=preprocess.DESCRIPTION,
    )
