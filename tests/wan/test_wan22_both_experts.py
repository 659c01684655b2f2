"""Both Wan 2.2 A14B experts in one run (``model.wan_expert=both``, dfm/models/wan/experts.py), one process:

* a pack's samples routed to their experts (each expert on its own sub-pack) give the outputs,
  per-sample losses and every parameter's gradient of each expert run on a pack of its own samples;
* the training step routes by the drawn t and reports each expert's loss and sample count, and the
  log line and metrics carry them;
* checkpoints: the parameters are ``high_noise.*`` / ``low_noise.*``; ``checkpoint.pretrained``
  loads a two-transformer import's two checkpoints; the export of a both-run checkpoint is a
  pipeline folder (transformer/, transformer_2/, boundary_ratio) that WanPipeline loads;
* the layouts that cannot work are refused at start-up, naming the key.
"""

import contextlib
import dataclasses
import functools
import io
import json
from types import SimpleNamespace

import diffusers
import pytest
import torch

from dfm.checkpoint.errors import CheckpointError
from dfm.checkpoint.state import TrainingState, model_sharded_state_dict
from dfm.checkpoint.weights_only import load_pretrained, save_weights_only
from dfm.config.errors import ConfigError
from dfm.config.loader import apply_overrides, build_config
from dfm.config.recipes import get_recipe
from dfm.config.validate import validate_config
from dfm.convert.pretrained import read_full_weights
from dfm.convert.rules import to_dfm
from dfm.convert.wan import parity_samples, rules
from dfm.convert.wan_experts import main
from dfm.data.packing import pack_samples, sub_pack
from dfm.diffusion.pipeline import SamplingOptions
from dfm.diffusion.registry import build_pipeline, pipeline_from_config
from dfm.diffusion.timestep_experts import TimestepExperts, c_noise_boundary
from dfm.inference.generate import expert_guidance, generate, parse_args
from dfm.inference.generation_batch import draw_noise, generation_batch
from dfm.inference.sampling import sample_latent
from dfm.models.build import build_model_chunk
from dfm.parallel import ParallelLayout
from dfm.training.data import build_mock_loader
from dfm.training.forward_step import DiffusionForwardStep
from dfm.training.metrics_log import MetricsLog
from dfm.training.pretrain import RecordingIterator, finalize_defaults, reduce_expert_losses, train_step
from dfm.training.setup import build_model, build_optimizer, num_microbatches
from tests.wan._tiny import tiny_diffusers_wan, tiny_model_config
from tests.wan.test_wan22_experts import TINY_TEXT, WAN_TINY

BOUNDARY = 0.875
SHAPES = [((2, 2, 3), 5), ((1, 3, 2), 3), ((2, 2, 2), 6), ((1, 2, 2), 4)]
LEVELS = torch.tensor([0.95, 0.3, 0.9, 0.5], dtype=torch.float64)  # experts: high, low, high, low
ROUTES = {"high_noise": [0, 2], "low_noise": [1, 3]}


def both_model(seed: int = 0):
    """Both experts, float64, every parameter N(0, 0.1^2) (the zero-initialised ones would hide grads)."""
    cfg = tiny_model_config(wan_expert="both", wan_boundary_ratio=BOUNDARY)
    model, _ = build_model_chunk(cfg, "fp32", seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return cfg, model.double()


def packed(samples, noise_samples, levels, flow, total_multiple=1):
    """(pack, noise [S, D], x_in, c_noise) of ``samples`` with their noise and levels (float64)."""
    pack = pack_samples(samples, 1, total_multiple)
    pack = dataclasses.replace(pack, latents=pack.latents.double(), context=pack.context.double())
    noise = pack_samples(noise_samples, 1, total_multiple).latents.double()
    x_in, c_noise = flow.model_input(pack.latents, noise, levels, pack.token_sample_ids())
    return pack, noise, x_in, c_noise


def pack_loss(net, samples, noise_samples, levels, how) -> torch.Tensor:
    """Per-sample losses of ``net`` on a pack of ``samples``; how = (flow, total_multiple, expert_ids)."""
    flow, total_multiple, expert_ids = how
    pack, noise, x_in, c_noise = packed(samples, noise_samples, levels, flow, total_multiple)
    if expert_ids is not None:
        pack = dataclasses.replace(pack, expert_ids=torch.tensor(expert_ids))
    out = net(x_in, c_noise, pack)
    return flow.training_loss(out, pack.latents, noise, levels, pack.token_sample_ids(), pack.loss_mask)


def losses_and_grads(model, run) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    per_sample = run()
    per_sample.sum().backward()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    return per_sample.detach(), grads


@pytest.mark.filterwarnings("ignore")
def test_routing_equals_each_expert_on_its_own_samples(dist):
    cfg, model = both_model()
    init, _ = build_model_chunk(cfg, "fp32", 0)  # the layout-independent init draws by global name: they differ
    assert not torch.equal(
        init.high_noise.layers[0].mlp.linear_fc1.weight, init.low_noise.layers[0].mlp.linear_fc1.weight
    )
    samples = parity_samples(cfg, SHAPES)
    gen = torch.Generator().manual_seed(3)
    noise_samples = [dataclasses.replace(s, tokens=torch.randn(s.tokens.shape, generator=gen)) for s in samples]
    flow = build_pipeline("flow", c_noise_scale=1000.0)
    # The pack is padded to a multiple of 8 (as sequence parallelism pads it): its last sample's
    # segment carries the padding; the sub-packs are padded again.
    routed = functools.partial(pack_loss, model, samples, noise_samples, LEVELS, (flow, 8, [0, 1, 0, 1]))
    ours, our_grads = losses_and_grads(model, routed)
    theirs, their_grads = torch.zeros(4, dtype=torch.float64), {}
    for expert, keep in ROUTES.items():
        own = [[samples[i] for i in keep], [noise_samples[i] for i in keep], LEVELS[keep], (flow, 1, None)]
        losses, grads = losses_and_grads(model, functools.partial(pack_loss, model.submodels()[expert], *own))
        theirs[keep] = losses
        their_grads |= {n: g for n, g in grads.items() if n.startswith(expert)}
    assert (ours - theirs).abs().max().item() <= 1e-12, (ours, theirs)
    assert our_grads.keys() == their_grads.keys()
    for name, grad in our_grads.items():
        scale = their_grads[name].abs().max().item()
        assert scale > 0, name  # every parameter of both experts trains
        assert (grad - their_grads[name]).abs().max().item() <= 1e-10 * scale, name


@pytest.mark.filterwarnings("ignore")
def test_a_pack_of_one_expert_still_gives_the_other_zero_gradients(dist):
    cfg, model = both_model()
    flow = build_pipeline("flow", c_noise_scale=1000.0)
    samples = parity_samples(cfg, SHAPES[:2])
    pack, noise, x_in, c_noise = packed(samples, samples, LEVELS[[0, 2]], flow)
    pack = dataclasses.replace(pack, expert_ids=torch.tensor([0, 0]))
    model(x_in, c_noise, pack).square().mean().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.low_noise.parameters())
    assert any(p.grad.any() for p in model.high_noise.parameters())


def test_a_sub_pack_keeps_its_samples_segments_and_repads_the_total():
    cfg = tiny_model_config()
    pack = pack_samples(parity_samples(cfg, SHAPES), 1, 8)
    # I2V-A14B's per-token condition goes with its tokens
    pack = dataclasses.replace(pack, image_condition=torch.randn(pack.seq_len, 5))
    sub, rows = sub_pack(pack, [1, 3], 8)
    assert torch.equal(sub.image_condition[: rows.numel()], pack.image_condition[rows])
    lengths = pack.sample_lengths
    assert sub.sample_lengths.tolist() == lengths[[1, 3]].tolist() and sub.seq_len % 8 == 0
    assert sub.text_lengths.tolist() == pack.text_lengths[[1, 3]].tolist() and sub.context.shape[0] % 8 == 0
    assert torch.equal(sub.latents[: rows.numel()], pack.latents[rows]) and not sub.latents[rows.numel() :].any()
    assert sub.loss_mask.sum() == pack.sample_lengths[[1, 3]].sum()
    assert sub.sample_index.tolist() == [1, 3] and sub.latent_shape.tolist() == pack.latent_shape[[1, 3]].tolist()
    start = int(sub.cu_seqlens_kv_padded[1])
    second = int(pack.cu_seqlens_kv_padded[3])
    assert torch.equal(sub.context[start : start + 4], pack.context[second : second + 4])


@pytest.mark.filterwarnings("ignore")
def test_the_training_step_routes_by_t_and_reports_each_experts_loss(dist, tmp_path):
    cfg, model = both_model()
    model.float()
    flow = build_pipeline("flow", c_noise_scale=1000.0, shift=1.0)
    step = DiffusionForwardStep(flow, 7, 0.0, torch.device("cpu"), expert_boundary=BOUNDARY)
    pack = pack_samples(parity_samples(cfg, SHAPES * 3))
    for step.iteration in range(1, 30):  # an iteration whose pack holds samples of both experts
        batch, noise, level = step.prepare(pack)
        if 0 < int((level >= BOUNDARY).sum()) < len(level):
            break
    assert torch.equal(batch.expert_ids, (level < BOUNDARY).long())
    output, loss_func = step.run(model, batch, noise, level)
    loss, stats = loss_func(output)
    per_sample = flow.training_loss(output, batch.latents, noise, level, batch.token_sample_ids(), batch.loss_mask)
    high = level >= BOUNDARY
    expected = [per_sample[high].sum(), high.sum(), per_sample[~high].sum(), (~high).sum()]
    assert torch.allclose(stats["expert_losses"], torch.stack(expected).float(), atol=1e-6, rtol=1e-6)
    assert torch.allclose(loss, per_sample.mean())  # the whole pack's loss
    record = reduce_expert_losses([stats], torch.device("cpu"))
    assert record["samples_high_noise"] == int(high.sum()) and record["samples_low_noise"] == int((~high).sum())
    assert abs(record["loss_low_noise"] - per_sample[~high].mean().item()) < 1e-5
    line = {"iteration": 1, "train_iters": 1, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "skipped_iterations": 0}
    line |= {"step_time_s": 1.0, "tokens_per_sec_per_gpu": 1.0, "tflops_per_gpu": 1.0, "mfu": None} | record
    assert f"loss low_noise {record['loss_low_noise']:.4g}"[:20] in MetricsLog.console_line(line)


def run_cli(argv) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([str(a) for a in argv]) == 0


@pytest.mark.filterwarnings("ignore")
def test_both_experts_load_the_two_transformer_import_and_export_to_a_wan_pipeline(dist, tmp_path):
    folder = tmp_path / "pipeline"
    transformers = tiny_diffusers_wan(seed=0), tiny_diffusers_wan(seed=1)
    for transformer, name in zip(transformers, ("transformer", "transformer_2")):
        transformer.save_pretrained(folder / name)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "boundary_ratio": BOUNDARY}))
    run_cli(
        [
            "import",
            "--diffusers",
            folder,
            "--output",
            tmp_path / "ckpt",
            "model.max_text_len=8",
            "dataset.mock_text_len_range=[4,8]",
        ]
    )
    cfg, model = both_model(seed=5)
    model.float()
    names = model_sharded_state_dict(model)
    assert all(
        k.startswith(("high_noise.", "low_noise.")) and v.key.startswith(k.split(".")[0]) for k, v in names.items()
    )
    with pytest.raises(CheckpointError, match="model.wan_expert: checkpoint 'one model"):
        load_pretrained(tmp_path / "ckpt" / "high_noise", [SimpleNamespace(module=model)], cfg)
    load_pretrained(tmp_path / "ckpt", [SimpleNamespace(module=model)], cfg)
    for expert, transformer in zip(("high_noise", "low_noise"), transformers):
        expected = {f"{expert}.{k}": v for k, v in to_dfm(transformer.state_dict(), rules(cfg)).items()}
        ours = {model.global_param_name(n): p for n, p in model.named_parameters() if n.startswith(expert)}
        assert ours.keys() == expected.keys() and all(torch.equal(ours[k], v) for k, v in expected.items())
    # A both-run checkpoint (here weights-only, as a run's) exports as one pipeline folder.
    config = {"model": dataclasses.asdict(cfg)}
    save_weights_only(tmp_path / "run", [model], config)
    saved_cfg, weights = read_full_weights(tmp_path / "run")
    assert saved_cfg.model.wan_expert == "both" and sorted(weights) == sorted(
        model.global_param_name(n) for n, _ in model.named_parameters()
    )
    run_cli(["export", "--checkpoint", tmp_path / "run", "--output", tmp_path / "out"])
    absent = dict.fromkeys(("tokenizer", "text_encoder", "vae", "scheduler"))
    pipe = diffusers.WanPipeline.from_pretrained(tmp_path / "out", torch_dtype=torch.float32, **absent)
    assert pipe.config.boundary_ratio == BOUNDARY
    for loaded, transformer in ((pipe.transformer, transformers[0]), (pipe.transformer_2, transformers[1])):
        assert all(torch.equal(p, q) for p, q in zip(loaded.parameters(), transformer.parameters()))


@pytest.mark.parametrize(
    "override",
    [
        "model.pipeline_model_parallel_size=2",
        "model.context_parallel_size=2",
        "ddp.use_megatron_fsdp=true",
    ],
)
def test_layouts_that_cannot_split_a_pack_are_refused(override):
    cfg = get_recipe("Wan2.2-T2V-A14B")
    apply_overrides(cfg, ["model.wan_expert=both", override])
    with pytest.raises(ConfigError, match=f"model.wan_expert=both .* {override.split('=')[0]}"):
        validate_config(cfg)


def test_both_experts_draw_t_over_the_whole_range():
    cfg = get_recipe("Wan2.2-T2V-A14B")
    apply_overrides(cfg, ["model.wan_expert=both", "flow.training_mode=finetune"])
    validate_config(cfg)
    t = pipeline_from_config(cfg).draw_level(4000, torch.Generator().manual_seed(0))
    assert t.min() < 0.05 and t.max() > 0.99


@pytest.mark.filterwarnings("ignore")
def test_steps_with_an_expert_left_out_under_overlapped_reduction_and_the_distributed_optimizer(dist):
    """megatron's DDP with ``overlap_grad_reduce`` reduces a bucket once all its parameters have
    their gradient (as many as in the first step): the expert without samples still gives its zeros."""
    overrides = ["model.attention_backend=sdpa", "model.wan_expert=both", f"model.wan_boundary_ratio={BOUNDARY}"]
    overrides += ["ddp.overlap_grad_reduce=true", "ddp.use_distributed_optimizer=true", "optimizer.weight_decay=0"]
    cfg = build_config(None, str(WAN_TINY), overrides + TINY_TEXT)
    layout, device = ParallelLayout(world_size=1), torch.device("cpu")
    finalize_defaults(cfg, layout)
    model, tconfig = build_model(cfg, layout, device)
    optimizer, scheduler = build_optimizer(cfg, model, tconfig)
    state = TrainingState(model, optimizer, scheduler, RecordingIterator(build_mock_loader(cfg, layout)), None)
    experts = model[0].module
    # boundary 0: every sample is the high-noise expert's; 1.01: the low-noise one's.
    for iteration, (boundary, unused) in enumerate([(0.0, experts.low_noise), (1.01, experts.high_noise)], 1):
        before = [p.detach().clone() for p in unused.parameters()]
        step = DiffusionForwardStep(pipeline_from_config(cfg), cfg.rng.seed, 0.0, device, expert_boundary=boundary)
        step.iteration = iteration
        losses, updated, _, _ = train_step(step, state, num_microbatches(cfg, layout), device)
        assert updated and all(min(item["expert_losses"][1::2]) == 0 for item in losses)
        if iteration == 1:  # untouched by the step (Adam's moments are zero)
            assert all(torch.equal(p, q) for p, q in zip(unused.parameters(), before))
    # The validation sample (sample_latent on the DDP-wrapped model) runs each step on its t's expert.
    batch = generation_batch(draw_noise((4, 2, 4, 4), 0), torch.randn(5, cfg.model.text_embed_dim), cfg.model)
    options, pipeline = SamplingOptions(2, 1.0, "euler"), pipeline_from_config(cfg)
    routed = TimestepExperts(experts.high_noise, experts.low_noise, c_noise_boundary(pipeline, BOUNDARY))
    assert torch.equal(
        sample_latent(model[0], pipeline, batch, cfg.model, options),
        sample_latent(routed, pipeline, batch, cfg.model, options),
    )


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("c_noise_scale", [1000.0, 1.0])
def test_sampling_a_both_model_routes_each_step_like_timestep_experts(dist, c_noise_scale):
    """Generation from a both-run's model (what inference_dit_model.py loads from its checkpoint)
    gives the latents of TimestepExperts over the same two experts, which equal WanPipeline's
    (test_wan22_experts.py): each step is routed by its t at the boundary, whatever the run's
    flow.c_noise_scale (1: c_noise is t itself). The model alone, without routes, refuses to guess."""
    cfg, model = both_model()
    model.float().eval()
    samples = parity_samples(cfg, [((3, 4, 6), 5)])
    pack = pack_samples(samples)
    uncond = pack_samples([dataclasses.replace(samples[0], text=torch.zeros_like(samples[0].text))])
    flow = build_pipeline("flow", c_noise_scale=c_noise_scale, shift=5.0)
    options = SamplingOptions(4, 4.0, "euler")  # t = 1, 0.94 (high noise), 0.83, 0.62 (low noise)
    ours = sample_latent(model, flow, pack, cfg, options, uncond=uncond)
    routed = TimestepExperts(model.high_noise, model.low_noise, boundary=c_noise_scale * BOUNDARY)
    assert torch.equal(ours, sample_latent(routed, flow, pack, cfg, options, uncond=uncond))
    for expert in (model.high_noise, model.low_noise):
        alone = sample_latent(expert, flow, pack, cfg, options, uncond=uncond)
        assert (alone - ours).abs().max() > 1e-3  # both experts ran
    with pytest.raises(ValueError, match="expert_ids"):
        model(pack.latents, torch.ones(1), pack)


@pytest.mark.filterwarnings("ignore")
def test_inference_script_generates_from_a_both_run_checkpoint(dist, tmp_path):
    """inference_dit_model.py's generate() on a both-run checkpoint (its steps routed as above) with
    --guidance_scale_2 for the low-noise steps; a one-model checkpoint refuses --guidance_scale_2."""
    cfg, model = both_model()
    flow = {"c_noise_scale": 1000.0, "shift": 5.0}
    save_weights_only(tmp_path / "run", [model.float()], {"model": dataclasses.asdict(cfg), "flow": flow})
    one = dataclasses.replace(cfg, wan_expert=None, wan_boundary_ratio=None)
    save_weights_only(tmp_path / "one", [model.high_noise], {"model": dataclasses.asdict(one), "flow": flow})
    args = ["--tiny_random_encoders", "--num_video_frames", "5", "--height", "32", "--width", "48"]
    args += ["--num_steps", "4", "--guidance_scale", "4", "--guidance_scale_2", "2"]
    video = tmp_path / "both.mp4"
    cpu = torch.device("cpu")  # generate() is main() without its process group (the `dist` fixture's)
    assert generate(
        parse_args([str(a) for a in [*args, "--checkpoint_path", tmp_path / "run", "--video_save_path", video]]), cpu
    )
    assert video.stat().st_size > 0
    guidance = expert_guidance(model, SimpleNamespace(model=cfg), SimpleNamespace(guidance_scale_2=2.0))
    assert guidance == {"guidance_scale_2": 2.0, "guidance_boundary": BOUNDARY}
    with pytest.raises(ValueError, match="--guidance_scale_2 is the low-noise expert's guidance"):
        generate(parse_args([str(a) for a in [*args, "--checkpoint_path", tmp_path / "one"]]), cpu)
