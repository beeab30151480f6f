"""The `olmo3` model type (OLMo 3: windowed and full attention layers, post-norm blocks)."""
