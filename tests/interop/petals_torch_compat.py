"""torch 2.13 moved two private names that hivemind 1.1.10 imports from torch.cuda.amp.grad_scaler."""

try:
    import torch.amp.grad_scaler as _new
    import torch.cuda.amp.grad_scaler as _old

    for _name in ("OptState", "_refresh_per_optimizer_state"):
        if not hasattr(_old, _name):
            setattr(_old, _name, getattr(_new, _name))
except Exception:  # never break interpreter start-up
    pass
