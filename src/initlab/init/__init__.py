"""Data-free initialization: fans, gains, schemes as pure formulas, samplers, the layer registry,
name-based rules, and :func:`init_model` that applies them to any ``nn.Module``."""
