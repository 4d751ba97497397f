"""nightloom: one declarative run spec → one orchestrated training run. Pure logic; never imports Prefect."""

__version__ = "0.1.0"
