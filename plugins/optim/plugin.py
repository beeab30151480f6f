"""nanocore built-in plugin: optimizers (adam_w, sgd, lion, muon) and LR decay shapes (cosine, linear, 1-sqrt,
constant)."""

from __future__ import annotations

from nanocore import hookimpl
from nanocore_plugins.optim.lr_decay import DECAY_SHAPES
from nanocore_plugins.optim.muon import MuonArgs, build_muon
from nanocore_plugins.optim.optimizers import AdamWArgs, LionArgs, SGDArgs, build_adamw, build_lion, build_sgd


@hookimpl
def register_optimizers(registry):
    registry.register(
        "adam_w",
        build_adamw,
        config_class=AdamWArgs,
        aliases=("adamW", "adamw"),
        description="torch AdamW (decoupled weight decay), fused where supported",
        states_per_element=lambda args: 2,  # exp_avg, exp_avg_sq
        # float32 temporaries per element during step(): the multi-tensor (foreach) kernel builds
        # sqrt(exp_avg_sq) + eps for every parameter at once; the fused kernel builds none
        step_temporaries_per_element=lambda args: 0 if args is None or args.torch_adam_is_fused else 1,
    )
    registry.register(
        "sgd",
        build_sgd,
        config_class=SGDArgs,
        description="torch SGD with optional momentum",
        states_per_element=lambda args: 1 if args is not None and args.momentum else 0,  # momentum buffer
        step_temporaries_per_element=lambda args: 0,  # in place
    )
    registry.register(
        "lion",
        build_lion,
        config_class=LionArgs,
        description="Lion: sign of an interpolated momentum, decoupled weight decay (arXiv:2302.06675)",
        states_per_element=lambda args: 1,  # exp_avg
        step_temporaries_per_element=lambda args: 0,  # one parameter's update at a time
    )
    registry.register(
        "muon",
        build_muon,
        config_class=MuonArgs,
        description="Muon (Newton-Schulz orthogonalised momentum) for hidden matrices, AdamW for the rest",
        states_per_element=lambda args: 2,  # AdamW's moments for what is not a hidden matrix
        matrix_states_per_element=lambda args: 1,  # the momentum buffer
        # AdamW's part runs torch's multi-tensor kernel (one temporary per element; counted over every
        # element, an upper bound: a matrix's own temporaries are the buffers below)
        step_temporaries_per_element=lambda args: 1,
        # one matrix at a time, on its owner: the gathered rows, the TP pieces, the whole matrix, the
        # iteration's X and its products, the result (plugins/optim/muon.py; docs/optimizers.md)
        matrix_step_buffers=lambda args: 6,
        takes_pieces=True,  # gathers each matrix whole from its ZeRO rows and TP pieces (ParamPiece)
    )


@hookimpl
def register_lr_decays(registry):
    for name, shape in DECAY_SHAPES.items():
        registry.register(name, shape, description=(shape.__doc__ or "").strip())
