"""The trainer: runs ON the nodes under torchrun (`python -m nightloom.train --job job.json`).

Imports torch and nightloom only, never Prefect. Submodules import torch lazily so the orchestrator can
use `nightloom.train.job` without it.
"""
