"""train.grpo.engine vllm refused at validate (load_spec: FILE:LINE: train.grpo.engine) where it cannot run: a CPU
cluster, vllm not on the node profile (not importable here for the local provider; not pinned to the release built
for nightloom's torch in cluster.env_requirements for ssh and slurm), tp > 1, LoRA parts it cannot take; the
engine's defaults keep a spec's hash, its vllm section needs engine vllm, and parallel: auto plans tp 1 for it."""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import yaml

from nightloom.spec import RunSpec, SpecError
from nightloom.spec.grpo import VLLM_PIN, GRPOSpec
from nightloom.spec.load import load_spec

HAVE_VLLM = find_spec("vllm") is not None


def _write(tmp_path, grpo: dict, cluster: dict, parallel="auto", **train):
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    data = {
        "name": "g",
        "dataset": {"path": str(corpus)},
        "train": {"task": "grpo", "grpo": grpo, **train},
        "cluster": {"nodes": 1, "gpus_per_node": 1, **cluster},
        "parallel": parallel,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _errors(path) -> str:
    with pytest.raises(SpecError) as err:
        load_spec(path)
    return "\n".join(err.value.errors)


SLURM = {"provider": {"kind": "slurm"}, "gpu_type": "h100-80gb"}


@pytest.mark.parametrize(
    ("cluster", "parallel", "train", "words"),
    [
        ({}, "auto", {}, "vllm runs on CUDA GPUs; cluster.gpu_type is cpu"),
        (SLURM, "auto", {}, f"needs '{VLLM_PIN}' in cluster.env_requirements: it is not there"),
        ({**SLURM, "env_requirements": ["vllm>=0.33"]}, "auto", {}, "'vllm>=0.33' is not vllm==0.32.0"),
        ({**SLURM, "env_requirements": [VLLM_PIN], "gpus_per_node": 2}, {"tp": 2}, {}, "parallel.tp is 2"),
        ({**SLURM, "env_requirements": [VLLM_PIN]}, "auto", {"lora": {"quantize": "nf4"}}, "train.lora.quantize"),
        ({**SLURM, "env_requirements": [VLLM_PIN]}, "auto", {"grpo": {"temperature": 2.5}}, "temperature is 2.5"),
        ({**SLURM, "env_requirements": [VLLM_PIN]}, "auto", {"grpo": {"stop": ["\n"]}}, "model.tokenizer is bytes"),
    ],
)
def test_vllm_engine_refused_by_name(tmp_path, cluster, parallel, train, words):
    grpo = {"engine": "vllm", **train.pop("grpo", {})}
    path = _write(tmp_path, grpo, cluster, parallel, **train)
    text = _errors(path)
    assert words in text and f"{path}:" in text and ": train.grpo.engine:" in text, text


@pytest.mark.skipif(HAVE_VLLM, reason="vllm is importable here: the local provider's check passes")
def test_local_nodes_need_vllm_importable_here(tmp_path):
    text = _errors(_write(tmp_path, {"engine": "vllm"}, {"gpu_type": "h100-80gb"}))
    assert "vllm is not importable in this environment" in text, text


def test_a_gpu_cluster_with_the_pin_validates_and_auto_plans_tp_1(tmp_path):
    from nightloom.planner import trainer_pins
    from nightloom.shape import ModelShape

    cluster = {**SLURM, "env_requirements": [VLLM_PIN], "gpus_per_node": 2}
    spec = load_spec(_write(tmp_path, {"engine": "vllm", "vllm": {"gpu_memory_utilization": 0.4}}, cluster))
    assert spec.train.grpo.vllm_settings.gpu_memory_utilization == 0.4 and not spec.train.grpo.vllm_settings.sleep
    shape = ModelShape(name="t", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=128, max_seq=64)
    assert trainer_pins(shape, spec.train).tp == 1
    native = load_spec(_write(tmp_path, {}, cluster))
    assert trainer_pins(shape, native.train).tp is None  # native rollouts run under TP


def test_engine_defaults_keep_the_hash_and_the_vllm_section_needs_engine_vllm():
    base = {"name": "p", "dataset": {"path": "/d.jsonl"}, "train": {"task": "grpo", "grpo": {}}}
    plain = RunSpec.model_validate(base).spec_hash()
    spelled = {**base, "train": {"task": "grpo", "grpo": {"engine": "native", "vllm": None}}}
    assert RunSpec.model_validate(spelled).spec_hash() == plain
    other = {**base, "train": {"task": "grpo", "grpo": {"engine": "vllm"}}}
    assert RunSpec.model_validate(other).spec_hash() != plain
    with pytest.raises(ValueError, match="vllm: applies to engine: vllm only"):
        GRPOSpec(vllm={"sleep": True})
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        GRPOSpec(engine="vllm", vllm={"gpu_memory_utilization": 1.0})


def test_the_planner_prices_vllms_share_of_the_gpu():
    """vLLM's gpu_memory_utilization of each GPU holds the rollout: beside the training step (overhead) when
    awake, or in the training step's place (the larger of the two) when it sleeps while the trainer runs."""
    from nightloom.catalog import get_gpu
    from nightloom.planner import plan_for_spec

    def memory(**grpo):
        grpo = {"prompts_per_step": 64, "num_generations": 8, "max_completion_tokens": 512, **grpo}
        train = {"task": "grpo", "seq_len": 1024, "steps": 100, "grpo": grpo}
        cluster = {"nodes": 1, "gpus_per_node": 8, "gpu_type": "h100-80gb"}
        data = {"name": "g", "dataset": {"path": "d"}, "model": {"name": "llama3-8b"}, "cluster": cluster}
        spec = RunSpec.model_validate({**data, "train": train, "parallel": {"dp_shard": 8}})
        return plan_for_spec(spec, require_fit=False).chosen.memory

    share = 0.3 * get_gpu("h100-80gb").memory_gib
    native, awake = memory(), memory(engine="vllm", vllm={"gpu_memory_utilization": 0.3})
    asleep = memory(engine="vllm", vllm={"gpu_memory_utilization": 0.3, "sleep": True})
    assert awake.overhead_gib == pytest.approx(native.overhead_gib + share)
    assert awake.activations_gib < native.activations_gib  # the native rollout's KV cache is not the trainer's
    assert asleep.overhead_gib == pytest.approx(native.overhead_gib)
    assert asleep.activations_gib == pytest.approx(max(awake.activations_gib, share))
    assert awake.weights_gib == native.weights_gib and awake.grads_gib == native.grads_gib
