"""What a registry accepts from a plugin: declared extras only, of the declared type; old hook and kind
names keep working, with a warning, for one release."""

from __future__ import annotations

import warnings

import pytest

from nanocore import hookimpl
from nanocore.errors import PluginError
from nanocore.plugins import PluginSet, load_plugins
from nanocore.registry import REGISTRY_KINDS, Registries


class _MisspeltExtra:
    @hookimpl
    def register_zero_stages(self, registry):
        registry.register("9", object, shard_gradients=True)  # the extra is `shards_gradients`


class _WrongType:
    @hookimpl
    def register_optimizers(self, registry):
        registry.register("odd", object, states_per_element=2)  # must be fn(args) -> int


class _OldHooks:
    @hookimpl
    def register_pipeline_engines(self, registry):
        registry.register("old_schedule", object)

    @hookimpl
    def register_lr_schedulers(self, registry):
        registry.register("old_decay", lambda progress: 1.0 - progress)


def _plugins(obj, name: str) -> PluginSet:
    plugins = PluginSet()
    plugins.register_object(obj, name)
    return plugins


def test_a_misspelt_extra_is_an_error_naming_the_plugin_and_the_right_name():
    with pytest.raises(PluginError) as err:
        _ = _plugins(_MisspeltExtra(), "typo_zero").registries
    message = str(err.value)
    assert "'typo_zero'" in message and "'shard_gradients'" in message
    assert "did you mean 'shards_gradients'?" in message


def test_an_extra_of_the_wrong_type_is_an_error():
    with pytest.raises(PluginError, match=r"plugin 'odd_optim' registers optimizer 'odd' with states_per_element=2"):
        _ = _plugins(_WrongType(), "odd_optim").registries


def test_every_kind_declares_its_extras_and_every_builtin_registration_uses_only_those():
    registries = load_plugins().registries  # the built-ins register without error: their extras are declared
    for kind, spec in REGISTRY_KINDS.items():
        assert spec.hook.startswith("register_")
        for entry in registries[kind]:
            assert set(entry.extras) <= set(spec.extras), (kind, entry.name)


def test_old_hook_names_still_fill_the_renamed_registries_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:  # DeprecationWarning: shown by pytest and -W default
        warnings.simplefilter("always")
        plugins = _plugins(_OldHooks(), "old_plugin")
        registries = plugins.registries
    assert "old_schedule" in registries.pipeline_schedule
    assert "old_decay" in registries.lr_decay
    messages = [str(w.message) for w in caught]
    assert any("register_pipeline_engines is now register_pipeline_schedules" in m for m in messages)
    assert any("register_lr_schedulers is now register_lr_decays" in m for m in messages)


def test_the_old_kind_name_reaches_the_renamed_registry():
    registries = Registries()
    with pytest.warns(DeprecationWarning, match="registries.pp_engine is now registries.pipeline_schedule"):
        assert registries.pp_engine is registries.pipeline_schedule
    assert registries["pp_engine"] is registries.pipeline_schedule


def test_the_engine_answers_to_nd_and_to_its_old_name_3d():
    engines = load_plugins().registries.parallel_engine
    assert engines.get("3d") is engines.get("nd")


def test_an_engine_plan_that_is_not_a_memory_plan_is_refused_by_plugin(tmp_path):
    """The plan crosses from the engine plugin to `nanocore plan` and the summary as a typed record."""
    from nanocore.config.converter import structure_config
    from nanocore.engine_api import MemoryPlan
    from nanocore.plan import plan_for
    from tests.helpers.training import tiny_config

    plugins = load_plugins()
    registries = plugins.registries
    config = structure_config(tiny_config(tmp_path), registries)
    assert isinstance(plan_for(config, registries, "cpu"), MemoryPlan)  # the built-in engine's
    engines = registries.parallel_engine
    engines.current_plugin = "dict_planner"
    engines.register("dict_plan", engines.get("nd").factory, plan=lambda config, registries, device: {"ranks": []})
    config.parallelism.engine = "dict_plan"
    with pytest.raises(PluginError, match=r"plugin 'dict_planner': engine 'dict_plan'.s plan returned dict, not a"):
        plan_for(config, registries, "cpu")
