"""Global parameter names: stage-local blocks and experts renumbered over the whole model."""

from dfm.models.common.param_names import global_layer_prefix, global_param_name


def test_layers_are_offset_by_the_stage_and_other_names_kept(dist):
    assert global_layer_prefix(4, 1) == "layers.5."
    assert (
        global_param_name("layers.1.self_attention.linear_qkv.weight", 4) == "layers.5.self_attention.linear_qkv.weight"
    )
    assert global_param_name("t_embedder.mlp.0.weight", 4) == "t_embedder.mlp.0.weight"
    assert global_param_name("final_layer.linear.bias", 4) == "final_layer.linear.bias"


def test_experts_keep_their_index_on_one_expert_rank(dist):
    name = "layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    assert global_param_name(name, 2, num_experts=4) == "layers.2.mlp.experts.local_experts.3.linear_fc1.weight"
