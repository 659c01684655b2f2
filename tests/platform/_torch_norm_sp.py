"""A test-only patch: megatron's local-spec torch norm under sequence parallelism.

The tests' tiny GPT uses megatron's local spec, whose ``WrappedTorchNorm`` asserts
``not config.sequence_parallel`` because it does not tag its parameters: under SP each TP rank sees
only its sequence shard, so the norm grads must be summed over TP, which ``finalize_model_grads``
does for parameters marked ``sequence_parallel = True`` (as FusedLayerNorm and TE norms mark them).
dfm's own models use their own norms, so only the TP=2 + SP test needs this.
"""

import copy
import functools

from dfm.platform.compat import Patch


def _marking_sequence_parallel(original_new):
    @functools.wraps(original_new)
    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        config_without_sp = copy.copy(config)
        config_without_sp.sequence_parallel = False
        norm = original_new(cls, config_without_sp, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return staticmethod(__new__)


TORCH_NORM_SEQUENCE_PARALLEL = Patch(
    name="test:torch-norm-sequence-parallel",
    module="megatron.core.transformer.torch_norm",
    attribute="WrappedTorchNorm.__new__",
    why="asserts not sequence_parallel, since it does not mark its parameters for the SP grad all-reduce",
    relies_on=("not config.sequence_parallel",),
    replace=lambda original: _marking_sequence_parallel(original.__func__),
)
