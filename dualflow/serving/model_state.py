"""
What vLLM's model runner V2 hands a Dual-Flow model besides the token ids and positions. V2 asks a model for its
`ModelState` class (`get_model_state_cls`); this one is vLLM's default, and at graph capture, the only caller of
`prepare_dummy_inputs`, it adds `capturing=True`, so that the model captures every piece it replays while serving
(`DualFlowForCausalLM.warm_other_pieces`). Imported by V2 only: the V1 runner has no model states.
"""

from typing import Any

from vllm.v1.worker.gpu.model_states.default import DefaultModelState


class DualFlowModelState(DefaultModelState):
    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, Any]:
        return {**super().prepare_dummy_inputs(num_reqs, num_tokens), "capturing": True}
