"""TRL's SFTTrainer on Dual-Flow models: `DualFlowSFTTrainer` trains with the model's own loss, full and with PEFT."""

import torch
from datasets import Dataset
from helpers import byte_model, stdlib_text
from peft import PeftModel
from transformers import AutoModelForCausalLM, ByT5Tokenizer
from trl import SFTConfig, SFTTrainer

from dualflow.lora import dualflow_lora_config
from dualflow.sft import DualFlowSFTTrainer


def sft_config(out, **overrides) -> SFTConfig:
    options = dict(
        output_dir=str(out),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        max_length=64,
        bf16=False,  # TRL's default asks for bf16 on a GPU
        dataloader_pin_memory=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
    )
    return SFTConfig(**(options | overrides))


def text_dataset() -> Dataset:
    text = stdlib_text("textwrap.py", chars=6_000)
    return Dataset.from_dict({"text": [text[start : start + 300] for start in range(0, len(text), 300)]})


def trainer_on(model, out, trainer_class=DualFlowSFTTrainer, **options):
    return trainer_class(
        model=model, args=sft_config(out), train_dataset=text_dataset(), processing_class=ByT5Tokenizer(), **options
    )


def test_the_loss_is_the_models_own_and_plain_sft_would_miss_the_aux_flow(tmp_path):
    model = byte_model(router_aux_loss_coef=0.01, output_router_logits=True)
    trainer = trainer_on(model, tmp_path)
    batch = next(iter(trainer.get_train_dataloader()))
    assert torch.equal(trainer.compute_loss(model, dict(batch)), model(**batch).loss)

    # Why the subclass exists: SFTTrainer's fused head scores the backbone, which runs the primary flow alone, so the
    # aux flow (the one that predicts) gets no gradient from it.
    plain_loss = SFTTrainer.compute_loss(trainer, model, dict(batch))
    plain_loss.backward()
    assert model.model.aux_embed_tokens.weight.grad is None
    model.zero_grad()
    trainer.compute_loss(model, dict(batch)).backward()
    assert model.model.aux_embed_tokens.weight.grad.abs().sum() > 0


def test_full_fine_tuning_trains_the_aux_flow_and_reloads(tmp_path):
    model = byte_model()
    aux_embedding = model.model.aux_embed_tokens.weight.detach().clone()
    trainer = trainer_on(model, tmp_path / "run")
    trainer.train()
    assert not torch.equal(model.model.aux_embed_tokens.weight, aux_embedding)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(torch.isfinite(torch.tensor(losses)))

    trainer.save_model(tmp_path / "model")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    ids = ByT5Tokenizer()("def wrap(text):", return_tensors="pt").input_ids
    model.eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, model(ids).logits, atol=1e-6)
    trained = model.state_dict()
    assert all(torch.equal(tensor, trained[name]) for name, tensor in reloaded.state_dict().items())


def test_peft_config_trains_adapters_and_the_aux_flow_and_reloads(tmp_path):
    base = byte_model()
    trainer = trainer_on(base, tmp_path / "run", peft_config=dualflow_lora_config(base.config, r=4, lora_alpha=8))
    peft_model = trainer.model
    assert isinstance(peft_model, PeftModel)
    trainable = {name: p.detach().clone() for name, p in peft_model.named_parameters() if p.requires_grad}
    assert any("aux_embed_tokens.modules_to_save" in name for name in trainable)
    trainer.train()
    moved = {
        name for name, p in peft_model.named_parameters() if p.requires_grad and not torch.equal(p, trainable[name])
    }
    assert any("lora_B" in name for name in moved) and any("aux_embed_tokens" in name for name in moved)

    trainer.save_model(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(byte_model(), tmp_path / "adapter")
    ids = ByT5Tokenizer()("def wrap(text):", return_tensors="pt").input_ids
    peft_model.eval()
    reloaded.eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, peft_model(ids).logits, atol=1e-6)
