"""Qwen3 and Qwen3-MoE model types, composed from `nanocore.model_parts`."""
