"""Kiln: compile once with Inductor, serve without compiling."""

__version__ = "0.1.0"
