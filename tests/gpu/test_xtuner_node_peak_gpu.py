"""On a GPU node: the GPU nvidia-smi reports maps to a catalog entry, and XTuner's MFU peak on a remote node is
that entry's datasheet bf16 peak (nightloom.finetune.remote.node_peak). Skipped without CUDA."""

from __future__ import annotations

import pytest

from nightloom.catalog import GPUS
from nightloom.finetune.node_env import gpu_names
from nightloom.finetune.remote import NodeEnv, catalog_gpu, node_peak

pytestmark = pytest.mark.gpu


def test_reported_gpu_has_a_catalog_peak():
    names = gpu_names()
    assert names, "nvidia-smi reports no GPU on a CUDA machine"
    key = catalog_gpu(names[0])
    env = NodeEnv("this-node", "python", "k", "gpu", False, 0.0, {}, tuple(names))
    peak = node_peak(env)
    assert peak.flops == GPUS[key].peak_flops_bf16 and peak.source.startswith("datasheet")
