"""DoRA (train.lora.use_dora, train/lora.py) against PEFT's own DoRA layer on the same tiny Llama: the step-1 loss
and the gradients of A, B and the magnitude within 1e-4, over a 16-bit base and over bitsandbytes' nf4 base
(QLoRA); the adapters off give the base exactly."""

from __future__ import annotations

import pytest
import torch

from nightloom.hf.names import to_hf
from nightloom.train.lora import LoraSettings
from nightloom.train.parallelize import loss_fn
from nightloom.train.preference.reference import adapters_disabled
from nightloom.train.qlora import QuantSettings
from tests.support.tiny_llama import CONFIG, MODULES, native_lora_model, save_tiny_llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama"))


def _native(folder, lora: LoraSettings):
    return native_lora_model(folder, lora)


def _peft(folder, lora: LoraSettings):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kw = {}
    if lora.quant is not None:
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=lora.quant.kind,
            bnb_4bit_use_double_quant=lora.quant.double_quant,
            bnb_4bit_compute_dtype=torch.float32,
        )
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=list(lora.modules))
    cfg.use_dora = True
    return get_peft_model(base, cfg).train()


def _peft_name(name: str, shape) -> str:
    """PEFT's parameter of one of ours: A and B under the adapter's name, the magnitude delta as the magnitude."""
    if name.endswith(".lora_magnitude_delta"):
        stem = to_hf(name[: -len(".lora_magnitude_delta")] + ".weight", shape)[: -len(".weight")]
        return f"base_model.model.{stem}.lora_magnitude_vector.default.weight"
    return "base_model.model." + to_hf(name, shape).replace(".weight", ".default.weight")


@pytest.mark.parametrize("quant", [None, "nf4"])
def test_step_one_loss_and_adapter_grads_equal_peft_dora(llama_dir, quant):
    q = QuantSettings(quant, True, torch.float32) if quant else None
    lora = LoraSettings(8, 16.0, 0.0, MODULES, q, dora=True)
    model, shape = _native(llama_dir, lora)
    ref = _peft(llama_dir, lora)
    peft_params = dict(ref.named_parameters())
    g = torch.Generator().manual_seed(1)
    pairs = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" not in name:
                continue
            other = peft_params[_peft_name(name, shape)]
            if name.endswith("lora_magnitude_delta"):  # PEFT's m starts at ||W||_c, ours at ||W||_c + 0
                torch.testing.assert_close(other, torch.linalg.norm(_weight(model, name), dim=1), atol=1e-5, rtol=0)
                step = torch.randn(p.shape, generator=g) * 0.05  # moved the same way on both sides
                p.add_(step)
                other.add_(step)
            else:
                if name.endswith("lora_B.weight"):  # B = 0 would give A no gradient: both start from the same
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
                other.copy_(p)
            pairs.append((name, p, other))
    assert len(pairs) == 3 * len(MODULES) * shape.layers
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 33), generator=g)
    loss = loss_fn(model(ids[:, :-1]), ids[:, 1:])
    loss.backward()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-4, (loss.item(), ref_loss.item())
    for name, p, other in pairs:
        assert p.grad is not None and p.grad.abs().max() > 0, name
        torch.testing.assert_close(p.grad, other.grad, atol=1e-4, rtol=0, msg=name)
    with torch.no_grad(), adapters_disabled(model), ref.disable_adapter():
        x = ids[:, :-1]
        torch.testing.assert_close(model(x), ref(input_ids=x).logits, atol=1e-4, rtol=0)


def _weight(model, name: str) -> torch.Tensor:
    from nightloom.train.lora import base_weight

    return base_weight(model.get_submodule(name.rsplit(".", 1)[0]), torch.float32)


def test_use_dora_is_refused_under_tp():
    from nightloom.spec import RunSpec

    data = {"name": "d", "dataset": {"path": "/d.jsonl"}, "train": {"lora": {"rank": 4, "use_dora": True}}}
    with pytest.raises(ValueError, match="train.lora.use_dora"):
        RunSpec.model_validate({**data, "parallel": {"tp": 2}})
    assert RunSpec.model_validate({**data, "parallel": {"dp_shard": 2}}).train.lora.use_dora


@pytest.mark.parametrize(
    "lora",
    [{"use_dora": True}, {"trainable_token_indices": [5]}, {"modules_to_save": ["lm_head"]}],
    ids=["dora", "token_rows", "modules_to_save"],
)
def test_parallel_auto_plans_dora_and_token_rows_with_tp_1(lora):
    """Where 16-bit LoRA on llama3-70b over 8 H100 plans TP2 among its best, DoRA (its row norm needs whole rows) and trained token
    rows plan tp 1 (trainer_pins), and an explicit tp 2 is refused naming the field."""
    from nightloom.planner import plan_for_spec
    from nightloom.spec import RunSpec

    def spec(extra, parallel="auto"):
        cluster = {"nodes": 1, "gpus_per_node": 8, "gpu_type": "h100"}
        train = {"seq_len": 4096, "global_batch": 8, "lora": {"rank": 16, **extra}}
        data = {"name": "d", "model": {"name": "llama3-70b"}, "dataset": {"path": "/d.jsonl"}, "cluster": cluster}
        return RunSpec.model_validate({**data, "train": train, "parallel": parallel})

    plain = plan_for_spec(spec({}))  # TP2 is among its best (with activation offload TP1 may be first)
    assert any(p.tp > 1 for p in [plain.chosen, *plain.alternatives])
    pinned = plan_for_spec(spec(lora))
    chosen = pinned.chosen
    assert chosen.tp == 1 and chosen.dp_shard == 8, chosen.layout()
    assert all(p.tp == 1 for p in pinned.alternatives)
    with pytest.raises(ValueError, match=f"train.lora.{next(iter(lora))}: .*parallel.tp 2 (and .*)?must be 1"):
        spec(lora, {"tp": 2, "dp_shard": 4})
