"""Which parameters a Dual-Flow fine-tune trains: the aux flow's own, or every shared weight."""


def freeze_for_aux_training(model):
    """
    Cheap upcycling recipe: train only the aux flow's own parameters (`model.aux_parameter_names()`). Every shared
    weight stays frozen, so the primary flow, its logits and its cache stay bit-identical to the model before training.
    Returns the model.
    """
    return _train_only(model, aux_flow=True)


def freeze_aux_flow(model):
    """
    The inverse of `freeze_for_aux_training`: train every shared weight, freeze the aux flow's own parameters (a model
    trained as a single flow, `use_aux_flow=False`, where they take no part). Returns the model.
    """
    return _train_only(model, aux_flow=False)


def _train_only(model, aux_flow: bool):
    aux_names = set(model.aux_parameter_names())
    for name, parameter in model.named_parameters():
        parameter.requires_grad_((name in aux_names) == aux_flow)
    return model
