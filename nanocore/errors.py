"""Exceptions that carry a message meant for the user, not a traceback."""


class NanocoreError(Exception):
    """A mistake the user can fix (config, data, plugins). The CLI prints the message and exits 2."""


class ConfigError(NanocoreError):
    """The YAML config is invalid; the message names the YAML path and what was expected."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class PluginError(NanocoreError):
    """A plugin failed to load, registered a duplicate name, or implements an unknown hook."""


class DataError(NanocoreError):
    """A dataset or tokenizer file is missing, truncated or inconsistent with the model."""


class TrainingError(NanocoreError):
    """Training cannot continue (a NaN loss, for example); the last good checkpoint is intact."""
