"""Data-dependent initialization methods: LSUV, GradInit, MetaInit, output and input scaling,
preconditioning. Each ``method_(model, data, ...)`` returns a :class:`~initlab.MethodReport`."""
