"""The `mixtral` model type: parity with transformers' MixtralForCausalLM (logits, load-balancing loss),
auxiliary-loss gradients, the expert-runtime protocol, KV cache, init, FLOPs and config checks."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
import yaml
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from nanocore.config.converter import collect_problems, make_converter
from nanocore.config.schema import Config, ModelArgs, ParallelismArgs
from nanocore.model_api import KVCache, check_model
from nanocore.moe_api import LocalExperts, MoELayer, moe_layers
from nanocore.registry import Registries
from nanocore_plugins.llama.config import MixtralConfig
from nanocore_plugins.llama.mixtral import MixtralForCausalLM
from nanocore_plugins.llama.plugin import register_models
from tests.helpers.compare import rel_diff
from tests.helpers.mixtral import make, tiny


def hf_model(config: MixtralConfig, **extra) -> transformers.MixtralForCausalLM:
    hf_config = transformers.MixtralConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings,
        num_local_experts=config.num_local_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        router_aux_loss_coef=config.router_aux_loss_coef,
        attn_implementation="eager",
        **extra,
    )
    torch.manual_seed(1)
    model = transformers.MixtralForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif "experts" in name or "gate" in name:
                p.normal_(0.0, 0.3)  # larger than the default so that routing differs across tokens
    return model


def ids(batch: int = 2, length: int = 24, vocab: int = 61, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="gqa-untied-top2"),
        pytest.param({"tie_word_embeddings": True, "num_key_value_heads": None}, id="mha-tied-top2"),
        pytest.param({"num_experts_per_tok": 1}, id="top1"),
        pytest.param({"num_local_experts": 3, "num_experts_per_tok": 3, "num_hidden_layers": 1}, id="all-experts"),
    ],
)
def test_logits_match_transformers_with_the_same_weights(overrides):
    config = tiny(**overrides)
    reference = hf_model(config)
    ours = make(config)
    ours.load_state_dict(reference.state_dict(), strict=True)
    if config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    tokens = ids()
    with torch.no_grad():
        expected = reference(tokens).logits
        got = ours(tokens)
    # The same float32 math in other kernels, as for LLaMA (measured ~3e-7 of the logits' scale).
    assert rel_diff(got, expected) <= 1e-5, rel_diff(got, expected)
    ours.train()  # training mode adds the auxiliary losses to the backward pass only, never to the logits
    got_train = ours(tokens)
    assert torch.equal(got_train, got)


@pytest.mark.parametrize("layers", [1, 3])
def test_recorded_aux_loss_is_transformers_load_balancing_loss(layers):
    config = tiny(num_hidden_layers=layers, router_z_loss_coef=1e-3)
    reference = hf_model(config)
    ours = make(config)
    ours.load_state_dict(reference.state_dict())
    tokens = ids(length=32)
    with torch.no_grad():
        router_logits = reference(tokens, output_router_logits=True).router_logits
    ours.train()
    ours(tokens)
    stats = [ours.get_submodule(name).pop_statistics() for name in ours.moe_layers]
    assert all(s.micro_batches == 1 for s in stats)
    aux = sum(s.aux_loss for s in stats)
    E, k = config.num_local_experts, config.num_experts_per_tok
    # Per layer, transformers' loss of that layer alone; summed over layers, their mean.
    per_layer = [float(load_balancing_loss_func((logits,), E, k)) for logits in router_logits]
    assert rel_diff(aux, sum(per_layer) / layers) <= 1e-6
    if layers == 1:
        assert rel_diff(aux, float(load_balancing_loss_func(router_logits, E, k))) <= 1e-6
    z = sum(torch.logsumexp(logits.double(), -1).pow(2).mean().item() for logits in router_logits) / layers
    assert rel_diff(sum(s.z_loss for s in stats), z) <= 1e-6
    for s, logits in zip(stats, router_logits, strict=True):
        expected = torch.bincount(logits.topk(k, dim=-1).indices.reshape(-1), minlength=E)
        assert torch.equal(s.tokens_per_expert, expected.double())
    assert all(ours.get_submodule(name).pop_statistics() is None for name in ours.moe_layers)  # popped


def test_no_statistics_in_eval_or_without_grad():
    model = make(tiny())
    model(ids())  # eval
    model.train()
    with torch.no_grad():
        model(ids())
    assert all(model.get_submodule(n).pop_statistics() is None for n in model.moe_layers)


def reference_aux_losses(model: MixtralForCausalLM, tokens: torch.Tensor) -> torch.Tensor:
    """The per-layer auxiliary losses written out directly, from the routers' inputs."""
    c = model.config
    E, k, L = c.num_local_experts, c.num_experts_per_tok, c.num_hidden_layers
    inputs = []
    hooks = [
        model.get_submodule(name).gate.register_forward_hook(lambda m, args, out: inputs.append(out))
        for name in model.moe_layers
    ]
    logits_out = model(tokens)
    for h in hooks:
        h.remove()
    total = 0.0
    for logits in inputs:
        probs = torch.softmax(logits.float(), -1)
        counts = torch.bincount(probs.topk(k, -1).indices.reshape(-1), minlength=E).float()
        n = logits.shape[0]
        aux = E * ((counts / n) * probs.mean(0)).sum() / L
        z = torch.logsumexp(logits.float(), -1).pow(2).mean() / L
        total = total + c.router_aux_loss_coef * aux + c.router_z_loss_coef * z
    return logits_out, total


def test_aux_loss_gradient_flows_through_the_output():
    config = tiny(router_aux_loss_coef=0.5, router_z_loss_coef=0.1)
    tokens = ids()
    ours = make(config).train()
    logits = ours(tokens)
    logits.float().pow(2).mean().backward()
    got = {n: p.grad.clone() for n, p in ours.named_parameters() if "mlp.gate" in n}

    plain = make(config).train()
    for name in plain.moe_layers:  # no auxiliary losses attached: add them to the loss by hand
        block = plain.get_submodule(name)
        block.aux_coef = block.z_coef = 0.0
    logits, aux = reference_aux_losses(plain, tokens)
    (logits.float().pow(2).mean() + aux).backward()
    for name, grad in got.items():
        expected = dict(plain.named_parameters())[name].grad
        assert rel_diff(grad, expected) <= 1e-5, name
    # and the auxiliary term matters: without it the router gradients differ
    plain.zero_grad()
    plain(tokens).float().pow(2).mean().backward()
    assert rel_diff(got["model.layers.0.mlp.gate.weight"], plain.model.layers[0].mlp.gate.weight.grad) > 1e-3


def test_grad_scale_weights_the_aux_gradient():
    config = tiny(router_aux_loss_coef=1.0)
    tokens = ids()
    grads = []
    for scale in (1.0, 0.25):
        model = make(config).train()
        for name in model.moe_layers:
            model.get_submodule(name).set_runtime(LocalExperts(grad_scale=scale))
        model(tokens).sum().mul(0).backward()  # only the auxiliary gradient is left
        grads.append(model.model.layers[0].mlp.gate.weight.grad)
    assert grads[0].abs().max() > 0
    assert rel_diff(grads[1], 0.25 * grads[0]) <= 1e-6


class ReversingRuntime(LocalExperts):
    """Simulates expert parallelism over `ep` ranks in one process: this rank holds the experts of
    `ep_rank`; dispatch hands back the rows of its experts in an order of its own (each expert's
    rows reversed), combine puts zeros for the rows other ranks own (another run adds theirs)."""

    def __init__(self, ep_size: int = 1, ep_rank: int = 0):
        super().__init__()
        self.ep_size, self.ep_rank = ep_size, ep_rank

    def dispatch(self, x, tokens_per_expert):
        counts = [int(n) for n in tokens_per_expert.tolist()]
        local = len(counts) // self.ep_size
        mine = counts[self.ep_rank * local : (self.ep_rank + 1) * local]
        start = sum(counts[: self.ep_rank * local])
        pieces = torch.split(x[start : start + sum(mine)], mine)
        rows = torch.cat([p.flip(0) for p in pieces]) if pieces else x[:0]
        return rows, mine, (x.shape[0], start, mine)

    def combine(self, y, handle):
        total, start, mine = handle
        back = torch.cat([p.flip(0) for p in torch.split(y, mine)]) if mine else y
        out = y.new_zeros((total, y.shape[1]))
        return out.index_copy(0, torch.arange(start, start + back.shape[0]), back)


def test_a_runtime_that_reorders_rows_gives_the_same_outputs():
    config = tiny()
    model = make(config)
    tokens = ids()
    expected = model(tokens)
    for name in model.moe_layers:
        model.get_submodule(name).set_runtime(ReversingRuntime())
    assert torch.equal(model(tokens), expected)


def test_sliced_experts_on_simulated_ranks_add_up_to_the_whole_layer():
    config = tiny(num_shared_experts=0)
    model = make(config)
    block = model.model.layers[0].mlp
    x = torch.randn(2, 10, config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = block(x)
        total = torch.zeros_like(expected)
        for rank in range(2):
            part = make(config)
            sliced = part.model.layers[0].mlp
            for name in sliced.expert_parameters:
                module, _, attr = name.rpartition(".")
                full = sliced.get_submodule(module).get_parameter(attr)
                rows = full.shape[0] // 2
                setattr(sliced.get_submodule(module), attr, torch.nn.Parameter(full[rank * rows : (rank + 1) * rows]))
            sliced.set_runtime(ReversingRuntime(ep_size=2, ep_rank=rank))
            total += sliced(x)
    assert rel_diff(total, expected) <= 1e-6


def test_sequence_shards_sum_their_statistics_through_token_sum():
    """Two token shards of one micro-batch (as under sequence parallelism): with token_sum adding the
    other shard's statistics, each records the whole micro-batch's, and their aux gradients add up."""
    config = tiny(router_aux_loss_coef=1.0, router_z_loss_coef=0.5)
    model = make(config).train()
    block = model.model.layers[0].mlp
    x = torch.randn(2, 12, config.hidden_size, generator=torch.Generator().manual_seed(2))

    block(x).sum().mul(0).backward()
    whole_grad, whole = block.gate.weight.grad.clone(), block.pop_statistics()

    shards = x.split(6, dim=1)
    with torch.no_grad():  # what each shard contributes to token_sum
        partial = []
        for shard in shards:
            captured = []
            capture = {"token_sum": lambda s, t, out=captured: out.append(t) or t}
            block.set_runtime(type("Capture", (LocalExperts,), capture)())
            block.train()
            with torch.enable_grad():
                block(shard)
            partial.append(captured[0])
            block.pop_statistics()
    block.gate.weight.grad = None
    for i, shard in enumerate(shards):
        other = partial[1 - i]
        block.set_runtime(type("Shard", (LocalExperts,), {"token_sum": lambda s, t, o=other: t + o})())
        block(shard).sum().mul(0).backward()
        stats = block.pop_statistics()
        assert torch.equal(stats.tokens_per_expert, whole.tokens_per_expert)
        assert rel_diff(stats.aux_loss, whole.aux_loss) <= 1e-6 and rel_diff(stats.z_loss, whole.z_loss) <= 1e-6
    assert rel_diff(block.gate.weight.grad, whole_grad) <= 1e-5


def test_recomputation_calls_token_sum_but_records_nothing():
    config = tiny()
    model = make(config).train()
    block = model.model.layers[0].mlp
    calls = []
    block.set_runtime(type("Count", (LocalExperts,), {"token_sum": lambda s, t: calls.append(1) or t})())
    x = torch.randn(1, 8, config.hidden_size, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    out.sum().backward()
    assert len(calls) == 2  # the forward and its recomputation in backward
    assert block.pop_statistics().micro_batches == 1


@pytest.mark.parametrize(
    "chunks", [[12, 1, 1, 1], [1] * 6, [5, 3, 4]], ids=["prefill-decode", "token-by-token", "multi-token-chunks"]
)
def test_kv_cache_gives_the_full_forward_logits(chunks):
    model = make(tiny())
    tokens = ids(length=sum(chunks), seed=3)
    cache = KVCache()
    pieces, start = [], 0
    with torch.no_grad():
        full = model(tokens)
        for n in chunks:
            pieces.append(model(tokens[:, start : start + n], kv_cache=cache))
            start += n
    assert cache.length == tokens.shape[1]
    assert rel_diff(torch.cat(pieces, dim=1), full) <= 1e-5


def test_greedy_generation_with_cache_equals_without():
    from nanocore.generation import generate

    model = make(tiny(num_shared_experts=1, scoring_func="sigmoid"), seed=4)
    prompt = [5, 17, 42, 3]
    cached = generate(model, prompt, 12, temperature=0)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert cached == seq[len(prompt) :]


def test_forward_equals_the_chain_of_pipeline_blocks():
    model = make(tiny(num_hidden_layers=3))
    blocks = model.pipeline_blocks()
    assert blocks == [
        ["model.embed_tokens"],
        ["model.layers.0"],
        ["model.layers.1"],
        ["model.layers.2"],
        ["model.norm", "lm_head"],
    ]
    x = tokens = ids()
    with torch.no_grad():
        for block in blocks:
            for name in block:
                x = model.get_submodule(name)(x)
        assert torch.equal(x, model(tokens))


def test_moe_declarations_init_and_flops():
    config = tiny(num_shared_experts=2, scoring_func="sigmoid", tie_word_embeddings=True)
    a, b = make(config, vocab_multiple=8), make(config, vocab_multiple=8)
    check_model(a, "mixtral")  # every member nanocore.model_api.CausalLM requires
    assert moe_layers(a) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    block = a.model.layers[0].mlp
    assert isinstance(block, MoELayer)
    assert block.num_experts == 4 and block.expert_parameters == ("experts.gate_up_proj", "experts.down_proj")
    assert a.lm_head.weight is a.model.embed_tokens.weight and (a.vocab_size, a.true_vocab_size) == (64, 61)
    shapes = {n: tuple(p.shape) for n, p in a.named_parameters() if n.startswith("model.layers.0.mlp.")}
    assert shapes == {
        "model.layers.0.mlp.gate.weight": (4, 32),
        "model.layers.0.mlp.gate.e_score_correction_bias": (4,),
        "model.layers.0.mlp.experts.gate_up_proj": (4, 96, 32),
        "model.layers.0.mlp.experts.down_proj": (4, 32, 48),
        "model.layers.0.mlp.shared_experts.gate_proj.weight": (96, 32),
        "model.layers.0.mlp.shared_experts.up_proj.weight": (96, 32),
        "model.layers.0.mlp.shared_experts.down_proj.weight": (32, 96),
    }
    assert not block.gate.e_score_correction_bias.requires_grad
    assert torch.equal(block.gate.e_score_correction_bias, torch.zeros(4))
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    up = sa["model.layers.0.mlp.experts.gate_up_proj"]
    down = torch.cat([sa[f"model.layers.{i}.mlp.experts.down_proj"].flatten() for i in range(2)])
    assert abs(up.std().item() - 0.02) < 0.002 and abs(down.std().item() - 0.02 / math.sqrt(4)) < 0.002
    # the router and the experts stay whole on every TP rank; the shared experts split like LLaMA's MLP
    assert not any("gate" == k.rsplit(".", 1)[-1] or "experts." in k for k in a.tp_plan if "shared" not in k)
    assert a.tp_plan["model.layers.*.mlp.shared_experts.down_proj"] == "rowwise"
    # active parameters: every matmul but the routed experts, of which k of E count
    params = dict(a.named_parameters(remove_duplicate=False))
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    dense = sum(p.numel() for n, p in params.items() if ".experts." not in n and "correction" not in n)
    dense -= params["model.embed_tokens.weight"].numel()
    assert a.flops_per_token(16) == 6 * (dense + experts * 2 / 4) + 12 * 2 * 32 * 16


def test_sigmoid_router_bias_moves_toward_balance():
    config = tiny(scoring_func="sigmoid", num_shared_experts=1, router_bias_update_rate=0.01)
    model = make(config).train()
    out = model(ids())
    out.float().pow(2).mean().backward()
    block = model.model.layers[0].mlp
    assert block.gate.e_score_correction_bias.grad is None
    stats = block.pop_statistics()
    assert stats.tokens_per_expert.sum() == 2 * 24 * 2
    load = torch.tensor([40.0, 10.0, 30.0, 16.0], dtype=torch.float64)  # mean 24
    block.update_router_bias(load)
    assert torch.allclose(block.gate.e_score_correction_bias, torch.tensor([-0.01, 0.01, -0.01, 0.01]))
    # a large bias on one expert routes every token to it
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 0.0]))
    block(torch.randn(1, 8, 32))
    assert block.pop_statistics().tokens_per_expert[2] == 8
    softmax_block = make(tiny()).model.layers[0].mlp
    softmax_block.update_router_bias(load)  # a no-op for softmax routing


def check(tp: int = 1, ep: int = 1, **overrides) -> list[str]:
    config = Config(
        model=ModelArgs(model_config=tiny(**overrides), model_type="mixtral"),
        parallelism=ParallelismArgs(tp=tp, expert_parallel_size=ep),
    )
    return config.model.model_config.check(config)


@pytest.mark.parametrize(
    ("ep", "overrides", "key", "words"),
    [
        (1, {"router_jitter_noise": 0.01}, "router_jitter_noise", "jitter is not supported"),
        (1, {"num_experts_per_tok": 5}, "num_experts_per_tok", "5 is above num_local_experts=4"),
        (1, {"num_local_experts": 0, "num_experts_per_tok": 1}, "num_local_experts", "at least 1"),
        (1, {"sliding_window": 16}, "sliding_window", "sliding-window attention is not supported"),
        (1, {"scoring_func": "sparsemax"}, "scoring_func", "softmax, sigmoid"),
        (3, {}, "num_local_experts", "expert_parallel_size = 3"),
        (1, {"hidden_size": 30}, "hidden_size", "not divisible"),
    ],
)
def test_check_names_each_config_problem(ep, overrides, key, words):
    problems = check(ep=ep, **overrides)
    assert len(problems) == 1 and problems[0].startswith(f"{key}: ") and words in problems[0], problems


def test_check_accepts_valid_settings():
    assert check() == []
    assert check(ep=2, tp=2, sliding_window=32, output_router_logits=True) == []
    assert check(ep=4, num_experts_per_tok=4, num_shared_experts=1, scoring_func="sigmoid") == []


def test_yaml_section_selects_mixtral_and_rejects_unknown_keys():
    registries = Registries()
    register_models(registry=registries.model)
    converter = make_converter(registries)
    section = yaml.safe_load(
        """
        model_config:
          model_type: mixtral
          hidden_size: 32
          intermediate_size: 48
          num_attention_heads: 4
          num_key_value_heads: 2
          num_hidden_layers: 2
          vocab_size: 61
          max_position_embeddings: 32
          num_local_experts: 4
          num_experts_per_tok: 2
          router_aux_loss_coef: 0.001
        """
    )
    args = converter.structure(section, ModelArgs)
    assert args.model_type == "mixtral" and args.model_config == tiny()
    assert converter.structure(converter.unstructure(args), ModelArgs) == args
    section["model_config"]["num_experts"] = 4
    with pytest.raises(Exception) as info:
        converter.structure(section, ModelArgs)
    assert any("unknown key 'num_experts'" in p for p in collect_problems(info.value))
