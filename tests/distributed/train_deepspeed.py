"""
Fine-tune a saved Dual-Flow checkpoint with a plain `transformers.Trainer` and `TrainingArguments(deepspeed=CONFIG)`,
as a user's own script does; write what each process saw and did to OUT_DIR/rank-R.json.

Launched by tests/test_deepspeed.py as

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/train_deepspeed.py MODEL_DIR CONFIG.json OUT_DIR

(DeepSpeed's CPU accelerator, gloo). The TrainingArguments are made before `from_pretrained`, as DeepSpeed's guide
says, so that under ZeRO-3 the model is partitioned while it loads. After training, every process computes the
logits of a fixed batch with the trained model (ZeRO-3 gathers the weights for the forward) and Trainer saves the
final model (the weights gathered: `stage3_gather_16bit_weights_on_model_save`) into OUT_DIR/final.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


sys.path.insert(0, str(Path(__file__).parent))
from deepspeed_on_cpu import treat_cpu_as_accelerator  # noqa: E402


def main():
    model_dir, config, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    treat_cpu_as_accelerator()
    from transformers import Trainer, TrainingArguments, default_data_collator
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from dualflow.finetune import as_examples
    from modeling_dualflow import DualFlowForCausalLM

    blocks = torch.load(out / "blocks.pt")  # (rows, block): the same rows, in the same order, on every process
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        deepspeed=config,
        per_device_train_batch_size=2,
        max_steps=4,
        learning_rate=3e-3,
        logging_steps=1,
        save_steps=2,
        seed=0,
        report_to="none",
        dataloader_pin_memory=False,
        disable_tqdm=True,
    )
    model = DualFlowForCausalLM.from_pretrained(model_dir)
    # every process's own rows: the first token of each row of each of its batches
    seen = []

    def record_rows(module, args, kwargs):
        if module.training:
            seen.append(kwargs["input_ids"][:, 0].tolist())

    model.register_forward_pre_hook(record_rows, with_kwargs=True)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=as_examples(blocks),
        data_collator=default_data_collator,
    )
    trainer.train()
    probe = blocks[:2]
    model.eval()
    with torch.no_grad():
        output = trainer.model(probe)
    trainer.save_model(str(out / "final"))
    rank = dist.get_rank()
    if rank == 0:
        torch.save({"logits": output.logits, "primary_logits": output.primary_logits}, out / "logits.pt")
    result = {
        "rank": rank,
        "torch_world_size": dist.get_world_size(),
        "world_size": args.world_size,
        "process_index": args.process_index,
        "should_save": args.should_save,
        "zero3_at_load": is_deepspeed_zero3_enabled(),
        # the share of the parameters' elements this process holds (ZeRO-3: its partition, about 1 / world size)
        "local_fraction": sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())
        / sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
        "deepspeed_engine": type(trainer.model_wrapped).__name__,
        "optimizer": type(trainer.model_wrapped.basic_optimizer).__name__,
        "offloaded": [
            trainer.model_wrapped.zero_use_cpu_optimizer(),
            trainer.model_wrapped.zero_offload_param() is not None,
        ],
        "train_losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "rows": seen[:4],
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
