"""The scaffold every model family shares, over THD packs (dfm/data/packed_batch.py, b == 1):

    first stage:  embed(x_in, batch)            -> hidden [s, 1, h]   (family hook)
    every stage:  this stage's blocks           (built from the family's ModuleSpec)
    last stage:   head_output(hidden, inputs)   -> [s, D] -> gathered over CP to [S, D]

Per pack, once: ``condition`` (noise level and the family's extra conditioning -> per-sample
rows) and ``pack_inputs`` (what every block reads besides the hidden states). Conditioning
embedders live on every pipeline stage, marked replicated so megatron all-reduces their grads
across stages; a family builds them in ``build_conditioning``, its patch / text embedders in
``build_embedding`` (first stage) and its head in ``build_head`` (last stage). The attribute
names those hooks return are the parameter names checkpoints store.
"""

from __future__ import annotations

from megatron.core import tensor_parallel
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from torch import Tensor, nn

from dfm.data.packed_batch import PackedBatch
from dfm.models.common.param_names import global_param_name
from dfm.models.common.recompute import forward_layers, layer_runs
from dfm.models.common.sample_classifier import CLASSIFIER
from dfm.parallel.layout import layout_of
from dfm.parallel.sequence_split import SequenceSplit


def replicate_across_stages(module: nn.Module) -> nn.Module:
    """Mark ``module``'s parameters as held by every pipeline stage: megatron's
    ``finalize_model_grads`` all-reduces the grads of parameters with ``pipeline_parallel`` set
    across stages when the config's ``has_cond_embedder`` is (``DfmTransformerConfig``)."""
    for param in module.parameters():
        param.pipeline_parallel = True
    return module


class PackedDiffusionModel(MegatronModule):
    """(x_in [S, D], noise level [N], batch, extra conditioning) -> prediction [S, D] (last stage).

    ``layer_spec``: what the family's registry entry built for this backend (one ModuleSpec, or
    what ``block_spec`` picks from); ``model_cfg``: dfm's ModelConfig."""

    def __init__(
        self,
        config,
        layer_spec,
        model_cfg,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
    ):
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False  # read by megatron finalize_model_grads
        self.model_cfg = model_cfg
        self.layout = layout_of(config)
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.patch_dim = model_cfg.in_channels * model_cfg.patch_temporal * model_cfg.patch_spatial**2
        self.input_tensor: Tensor | None = None
        for name, module in self.build_conditioning().items():
            setattr(self, name, None if module is None else replicate_across_stages(module))
        if pre_process:
            for name, module in self.build_embedding().items():
                setattr(self, name, module)
        self.layer_offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        self.layers = nn.ModuleList(
            build_module(self.block_spec(layer_spec, index), config=config, layer_number=index + 1)
            for index in range(
                self.layer_offset, self.layer_offset + get_num_layers_to_build(config, vp_stage=vp_stage)
            )
        )
        if post_process:
            self.final_layer = self.build_head(layer_spec)

    # -- family hooks -------------------------------------------------------------------------
    def build_conditioning(self) -> dict[str, nn.Module | None]:
        """Embedders held by every stage (timestep, class, text ...), by attribute name, in order."""
        raise NotImplementedError

    def build_embedding(self) -> dict[str, nn.Module]:
        """The first stage's embedders (patches, positions, ...), by attribute name, in order."""
        raise NotImplementedError

    def block_spec(self, layer_spec, global_index: int) -> ModuleSpec:
        """The spec of block ``global_index`` (0-based over the whole model); one spec for all by default."""
        return layer_spec

    def build_head(self, layer_spec) -> nn.Module:
        """The last stage's final layer (tokens -> patch features)."""
        raise NotImplementedError

    def condition(self, noise_level: Tensor, batch: PackedBatch, extra: Tensor | None) -> Tensor:
        """Per-sample conditioning rows for the blocks and the head, [N, ...]."""
        raise NotImplementedError

    def pack_inputs(self, batch: PackedBatch, split: SequenceSplit, cond: Tensor, token_ids: Tensor | None = None):
        """What every block of this pack reads besides the hidden states (this CP rank's share);
        token_ids [s]: the CP-local token sample ids when the caller has them already."""
        raise NotImplementedError

    def embed(self, x_local: Tensor, batch: PackedBatch, split: SequenceSplit) -> Tensor:
        """This CP rank's tokens [s, D] -> the first block's hidden [s, 1, h] (this SP rank's share)."""
        raise NotImplementedError

    def head_output(self, hidden: Tensor, inputs, token_ids: Tensor) -> Tensor:
        """The last block's hidden (this SP rank's share) -> this CP rank's prediction [s, D]."""
        raise NotImplementedError

    # -- shared scaffold ----------------------------------------------------------------------
    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline schedules hand the previous stage's output in here."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def conditioning_rows(self, batch: PackedBatch) -> Tensor:
        """[S] long: the row of ``condition``'s output each token reads (its sample's; Wan 2.2's
        clean first frames read a timestep-0 row)."""
        return batch.token_sample_ids()

    def global_param_name(self, name: str) -> str:
        """Local parameter name -> its name in the whole (unpipelined, one expert rank) model."""
        return global_param_name(name, self.layer_offset, self.config.num_moe_experts)

    def forward(
        self,
        x_in: Tensor,
        noise_level: Tensor,
        batch: PackedBatch,
        extra: Tensor | None = None,
        classify: bool = False,
    ) -> Tensor:
        """Under context parallelism each rank runs its share of the tokens (``split``) and the
        output is gathered: every CP rank returns the whole [S, D]. ``classify``: the GAN classifier's
        logits [N] instead (a distillation's critic, sample_classifier.py)."""
        split = self.layout.pack_split(batch)
        token_ids = split.local(self.conditioning_rows(batch))
        inputs = self.pack_inputs(batch, split, self.condition(noise_level, batch, extra), token_ids)
        hidden = self.embed(split.local(x_in), batch, split) if self.pre_process else self.input_tensor
        hidden = self.run_layers(hidden, inputs)
        if not self.post_process:
            return hidden
        if classify:
            return self.classify(hidden, inputs, batch, split)
        out = self.head_output(hidden, inputs, token_ids)
        # The loss is computed on the gathered output by every CP rank alike: keep own rows' grads.
        return split.gather(out, grad_is_partial=False)

    def classify(self, hidden: Tensor, inputs, batch: PackedBatch, split: SequenceSplit) -> Tensor:
        """The last block's hidden -> the GAN classifier's logits [N], from every latent token of the pack
        (gathered over CP like the output: each rank keeps its own tokens' gradient, and 1 / CP of the
        classifier's own)."""
        features = split.gather(self.latent_hidden(hidden, inputs), grad_is_partial=False)[:, 0]
        classifier = getattr(self, CLASSIFIER)
        ids, mask = batch.token_sample_ids(), batch.loss_mask
        return classifier(features, ids, mask, batch.num_samples, grad_share=1.0 / split.size)

    def latent_hidden(self, hidden: Tensor, inputs) -> Tensor:
        """The last block's hidden (this SP rank's share) -> this CP rank's latent tokens [s, 1, h]
        (a family whose sequence also holds text tokens drops them)."""
        return self.gather_sequence(hidden)

    def run_layers(self, hidden: Tensor, inputs) -> Tensor:
        """hidden [s, b, h] through this stage's blocks (recomputed as the config says)."""
        return forward_layers(self.layers, layer_runs(len(self.layers), self.config, self.training), hidden, inputs)

    def scatter_sequence(self, hidden: Tensor) -> Tensor:
        """[s, 1, h] -> this TP rank's share under sequence parallelism."""
        if not self.config.sequence_parallel:
            return hidden
        return tensor_parallel.scatter_to_sequence_parallel_region(hidden)

    def gather_sequence(self, hidden: Tensor) -> Tensor:
        """This TP rank's share -> [s, 1, h] under sequence parallelism (for the head)."""
        if not self.config.sequence_parallel:
            return hidden
        return tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
