"""
TRL's `SFTTrainer` for Dual-Flow models: `DualFlowSFTTrainer` is `SFTTrainer` with the loss the model defines.

`SFTTrainer` patches the model with a fused LM head: it runs the backbone alone and scores the backbone's last hidden
state. A Dual-Flow backbone called alone runs the primary flow only, so plain `SFTTrainer` would train the primary
flow on its own next-token loss and leave the aux flow (the flow that predicts) untouched. `DualFlowSFTTrainer` keeps
everything else of `SFTTrainer` (datasets, chat templates, packing, completion-only masks, PEFT configs) and takes
its loss from the model's forward: the aux flow's cross-entropy, plus `primary_loss_weight` times the primary flow's,
plus the router balance loss of both flows when the config asks for router logits.
"""

from transformers import Trainer
from trl import SFTTrainer


class DualFlowSFTTrainer(SFTTrainer):
    """`trl.SFTTrainer` whose loss is the Dual-Flow model's own (`outputs.loss`); same arguments as `SFTTrainer`."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # No cache in training; the model computes the router balance loss itself when its config asks for it.
        inputs["use_cache"] = False
        # Trainer's loss is the model's `outputs.loss` (it passes `num_items_in_batch` for gradient accumulation);
        # SFTTrainer's is the fused head's, which a Dual-Flow backbone cannot give (see the module docstring).
        return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
