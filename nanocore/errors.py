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


class TrainingInterrupted(NanocoreError):
    """SIGTERM or SIGINT stopped the run after a step; a checkpoint of that step was saved."""

    def __init__(self, signal_number: int, step: int, checkpoint: object):
        import signal

        self.exit_code = 128 + int(signal_number)  # what a shell reports for a process the signal ended
        name = signal.Signals(signal_number).name
        super().__init__(
            f"stopped by {name} after step {step}; checkpoint saved to {checkpoint}. To continue, run again with "
            f"checkpoints.resume_checkpoint_path: latest (or {checkpoint})"
        )


_COLLECTIVE_TIMEOUT = ("timed out", "timeout", "deadline exceeded")
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed")


def explain_collective_failure(exc: BaseException, timeout_seconds: float) -> NanocoreError | None:
    """A user-facing error for a collective that timed out or lost its peer; None for anything else."""
    if isinstance(exc, NanocoreError) or not isinstance(exc, RuntimeError):
        return None
    lowered = str(exc).lower()
    from_backend = type(exc).__module__.startswith("torch.distributed") or any(
        k in lowered for k in ("gloo", "nccl", "c10d")
    )
    if not from_backend:
        return None
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if any(k in lowered for k in _COLLECTIVE_TIMEOUT):
        return TrainingError(
            f"a collective operation did not complete within parallelism.collective_timeout_seconds "
            f"({timeout_seconds:g} s): another rank stalled, hung or died. Its log says why; raise the timeout if "
            "some step legitimately takes longer (a long checkpoint save or evaluation). "
            f"({type(exc).__name__}: {text})"
        )
    if any(k in lowered for k in _PEER_GONE):
        return TrainingError(
            f"another rank left a collective operation (it crashed or was killed); its log says why. "
            f"({type(exc).__name__}: {text})"
        )
    return None
