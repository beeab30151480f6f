"""Gated DeltaNet: the linear-attention layer of Qwen3-Next, in plain PyTorch, with transformers' names.

A head keeps a fixed-size memory S ([head_k_dim, head_v_dim]) instead of a growing key/value cache. For
each token t it first forgets (S <- exp(g_t) S, g_t <= 0 the "gate"), then corrects what S recalls for
the key k_t towards the value v_t by a step of size beta_t (the delta rule):

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,    u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),    o_t = S_t^T q_t

with q and k L2-normalised per head and q scaled by 1/sqrt(head_k_dim). `recurrent_gated_delta_rule`
runs that token by token (generation, and the reference in the tests); `chunk_gated_delta_rule` gives
the same numbers with matrix products over chunks of 64 tokens (training, prefill).

The layer (`GatedDeltaNet`, transformers' `Qwen3NextGatedDeltaNet`): `in_proj_qkvz` makes queries,
keys, values and the output gate z; `in_proj_ba` the step sizes (beta = sigmoid(b)) and the forget
gates (g = -exp(A_log) * softplus(a + dt_bias), one per value head); q, k and v pass a causal depthwise
convolution of a few taps (`conv1d`, then the activation) before the delta rule; the result is
RMS-normed per head and gated by silu(z) (`norm`), then `out_proj` maps it back to the hidden size.
Value heads may outnumber key heads (grouped like grouped-query attention: each query/key head serves
num_v_heads // num_k_heads consecutive value heads).

Layouts worth knowing (for conversion and tensor parallelism):
- `in_proj_qkvz`'s output is grouped by key head: for each of the num_k_heads groups,
  [q (head_k_dim) | k (head_k_dim) | v (r x head_v_dim) | z (r x head_v_dim)] with r = num_v_heads //
  num_k_heads; `in_proj_ba`'s likewise [b (r) | a (r)] per key head. Splitting their rows into
  contiguous blocks of key heads (column parallelism) therefore gives each rank whole groups.
- `conv1d`'s channels are not grouped: [all q | all k | all v] (2 x key_dim + value_dim). A rank's
  share is three strided blocks, not one contiguous block.
- `dt_bias`, `A_log` are per value head (contiguous blocks follow the key-head groups); `norm.weight`
  ([head_v_dim]) is shared by all heads (replicated); `out_proj` splits by input rows.
The layer derives the head counts from the projections' output shapes at forward time, so a rank that
holds a block of key-head groups runs unchanged.

Initialisation as transformers does it (`init_gated_deltanet_parameter`): the projections and the
convolution normal(0, initializer_range); `dt_bias` ones; `A_log` = log(uniform(0.01, 16)) (the decay
rates A span slow to fast forgetting; the lower bound keeps log(A) finite); the gated norm's weight
ones: unlike Qwen3-Next's other RMSNorms, which compute x * (1 + weight) and start at zero, this norm
multiplies by `weight` itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanocore.model_api import KVCache, init_normal
from nanocore.model_parts.layers import ACT_FNS

L2NORM_EPS = 1e-6  # flash-linear-attention's (and transformers') epsilon for the q/k L2 norm
A_LOG_RANGE = (0.01, 16.0)  # A ~ uniform over this range at initialisation, A_log = log(A)


# -- the delta rule -------------------------------------------------------------------------------------


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (eps inside the root, as flash-linear-attention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first_float(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs of both forms, ready to use: float32 (the state accumulates over the whole sequence),
    heads before positions ([b, heads, s, ...]), q and k repeated to the value heads, q/k L2-normed if
    asked, and q scaled by 1/sqrt(head_k_dim)."""
    k_heads, v_heads = k.shape[2], v.shape[2]
    if q.shape != k.shape or v_heads % k_heads != 0:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must match; v's heads ({v_heads}) a multiple")
    if k_heads != v_heads:  # each query/key head serves a group of consecutive value heads
        q = q.repeat_interleave(v_heads // k_heads, dim=2)
        k = k.repeat_interleave(v_heads // k_heads, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).float().contiguous() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _zero_state(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An empty memory for [b, heads, s, d] keys and values: [b, heads, head_k_dim, head_v_dim] float32."""
    return torch.zeros(k.shape[0], k.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float32, device=k.device)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over whole chunks of tokens at once (the WY / UT-transform form).

    Shapes (transformers' and flash-linear-attention's): q, k [b, s, k_heads, head_k_dim]; v [b, s,
    v_heads, head_v_dim] with v_heads a multiple of k_heads; g (log of the forget factor, <= 0) and beta
    (step size) [b, s, v_heads]; `initial_state` [b, v_heads, head_k_dim, head_v_dim]. Returns the
    output [b, s, v_heads, head_v_dim] in q's dtype and, if `output_final_state`, the state after the
    last token (float32), else None. Computed in float32 throughout.

    Why it equals the recurrence: within a chunk write gamma_i = g_1 + ... + g_i (the log decay from the
    chunk's start through token i) and S_0 for the state the chunk starts from. Unrolling gives
    S_i = e^{gamma_i} S_0 + sum_{j<=i} e^{gamma_i - gamma_j} k_j u_j^T, so the corrections u depend on the
    earlier ones through a strictly lower-triangular system,
        (I + A) U = beta V - diag(beta e^gamma) K S_0,    A_ij = beta_i e^{gamma_i - gamma_j} k_i.k_j (j < i),
    solved once per chunk for both right-hand sides (U = U_v - W S_0). With U known, every output and
    the next chunk's state are matrix products; only the short loop over chunks remains sequential.

    `initial_state`/`output_final_state` let a caller split a sequence anywhere (prefill then decode, or
    the ranks of context parallelism, each handing its final state to the next) with the same result
    as one call over the whole sequence. Padding to a multiple of `chunk_size` uses g = 0, beta = 0 and
    zero keys, which leave the state untouched, so the final state is that of the real last token.
    """
    dtype, s = q.dtype, q.shape[1]
    q, k, v, g, beta = _heads_first_float(q, k, v, g, beta, use_qk_l2norm)
    b, h, _, dk = k.shape
    dv = v.shape[-1]
    pad = -s % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (s + pad) // chunk_size
    q, k, v = (x.view(b, h, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.view(b, h, n, chunk_size) for x in (g, beta))

    gamma = g.cumsum(dim=-1)
    # decay[i, j] = e^{gamma_i - gamma_j} for j <= i (what survives of token j's write by token i), else 0;
    # the exponent is masked before exp so that no entry above the diagonal can overflow.
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~causal, -math.inf).exp()
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is ignored: the solve takes it as 1
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * gamma.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_v, w = solved.split([dv, dk], dim=-1)  # corrections from a zero state, and their change per unit of S_0

    within = (q @ k.transpose(-1, -2)) * decay  # q_i . k_j e^{gamma_i - gamma_j}, j <= i
    q_reads = q * gamma.exp().unsqueeze(-1)  # how each query sees the chunk's initial state
    k_writes = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)  # each key's write, decayed to the chunk's end
    chunk_decay = gamma[..., -1].exp()[..., None, None]

    state = _zero_state(k, v) if initial_state is None else initial_state.float()
    outs = []
    for c in range(n):
        u = u_v[:, :, c] - w[:, :, c] @ state
        outs.append(q_reads[:, :, c] @ state + within[:, :, c] @ u)
        state = state * chunk_decay[:, :, c] + k_writes[:, :, c].transpose(-1, -2) @ u
    out = torch.cat(outs, dim=2)[:, :, :s]
    return out.transpose(1, 2).contiguous().to(dtype), state if output_final_state else None


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule token by token, exactly as the module docstring writes it: for one-token
    generation steps (no chunk to pad) and as the reference `chunk_gated_delta_rule` is tested against.

    Same shapes, dtypes and return value as `chunk_gated_delta_rule`; `chunk_size` is accepted and
    ignored, so that either form can be passed where the other is expected.
    """
    del chunk_size
    dtype, s = q.dtype, q.shape[1]
    q, k, v, g, beta = _heads_first_float(q, k, v, g, beta, use_qk_l2norm)
    state = _zero_state(k, v) if initial_state is None else initial_state.float()
    outs = []
    for t in range(s):
        k_t = k[:, :, t].unsqueeze(-2)  # [b, h, 1, dk]
        state = state * g[:, :, t].exp()[..., None, None]
        recalled = k_t @ state  # what the memory gives for this key, [b, h, 1, dv]
        correction = beta[:, :, t, None, None] * (v[:, :, t].unsqueeze(-2) - recalled)
        state = state + k_t.transpose(-1, -2) @ correction
        outs.append(q[:, :, t].unsqueeze(-2) @ state)
    out = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape)
    return out.transpose(1, 2).contiguous().to(dtype), state if output_final_state else None


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution along the sequence: out[t, c] = sum_i weight[c, i] x[t - K + 1 + i, c].

    x [b, s, channels]; weight [channels, K] (or nn.Conv1d's [channels, 1, K]); `conv_state` [b, K - 1,
    channels], the K - 1 inputs before x (zeros, the start of a sequence, when None). Returns the
    output [b, s, channels] (in weight's dtype, as transformers computes it) and the new state, the
    last K - 1 inputs, for the next call: feeding a sequence in pieces with the state carried gives
    what one call over the whole sequence gives. No bias and no activation: the layer applies those.
    """
    weight = weight.reshape(weight.shape[0], -1)
    taps = weight.shape[-1] - 1
    if conv_state is None:
        conv_state = x.new_zeros(x.shape[0], taps, x.shape[-1])
    padded = torch.cat([conv_state.to(x.dtype), x], dim=1)
    out = F.conv1d(padded.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])
    # a copy, so a cache holding the state does not keep the whole padded input alive
    return out.transpose(1, 2), padded[:, padded.shape[1] - taps :].clone()


# -- the layer ------------------------------------------------------------------------------------------


@dataclass
class LinearAttentionState:
    """What a `GatedDeltaNet` carries from one piece of a sequence to the next.

    conv: [b, conv_kernel_size - 1, conv channels], the short convolution's last inputs (the projected
    q/k/v before the convolution, in the layer's dtype); recurrent: [b, v_heads, head_k_dim, head_v_dim],
    the delta rule's memory (float32).
    """

    conv: torch.Tensor
    recurrent: torch.Tensor


class LinearAttentionCache(KVCache):
    """Generation cache for linear-attention layers: one `LinearAttentionState` per layer_idx.

    A `KVCache` too (same `length`/`advance`, and `update` for full-attention layers), so one cache
    object serves a hybrid model such as Qwen3-Next, whose layers alternate between the two kinds. A
    linear layer's state has a fixed size whatever the length: it is replaced, not appended to.
    """

    def __init__(self) -> None:
        super().__init__()
        self.linear_states: dict[int, LinearAttentionState] = {}

    def linear_state(self, layer: int) -> LinearAttentionState | None:
        """The layer's state after the tokens seen so far; None before its first call."""
        return self.linear_states.get(layer)

    def update_linear_state(self, layer: int, state: LinearAttentionState) -> None:
        self.linear_states[layer] = state


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output times silu(gate) (transformers' `Qwen3NextRMSNormGated`).

    The weight multiplies directly (initialised to ones); it is not the zero-centred (1 + weight) form of
    Qwen3-Next's other norms. Normed in float32 and cast back before the weight, the gate in float32.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * normed.to(dtype) * F.silu(gate.float())
        return out.to(dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's Gated DeltaNet layer (see the module docstring), with transformers' parameter names:
    `load_state_dict` of a `Qwen3NextGatedDeltaNet`'s state dict works with strict=True.

    `forward(x, cache=None, starts=None)`: x [b, s, hidden_size] -> [b, s, hidden_size]. `starts`
    ([b, s] bool) marks tokens that begin a packed document; `cache` carries state for generation.
    `forward_with_state` exposes the state handover itself (for context parallelism).
    """

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        *,
        conv_kernel_size: int,
        rms_norm_eps: float,
        hidden_act: str = "silu",
        layer_idx: int = 0,
        chunk_size: int = 64,
    ):
        super().__init__()
        if num_v_heads % num_k_heads != 0:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
        self.layer_idx, self.chunk_size = layer_idx, chunk_size
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.v_per_k = num_v_heads // num_k_heads  # fixed under a split by key-head groups, unlike the counts
        self.act = ACT_FNS[hidden_act]
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        # padding is unused (`causal_conv1d` pads on the left itself); kept so the module prints as transformers'
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, conv_kernel_size, groups=conv_dim, padding=conv_kernel_size - 1, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads).uniform_(*A_LOG_RANGE).log())
        self.norm = GatedRMSNorm(head_v_dim, rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, hidden_size, bias=False)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x -> (the convolution's input [b, s, conv channels] as [all q | all k | all v], z [b, s, v_heads,
        head_v_dim], beta and g [b, s, v_heads]). Head counts come from the projections' shapes."""
        qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
        b, s = qkvz.shape[0], qkvz.shape[1]
        dk, dv, r = self.head_k_dim, self.head_v_dim, self.v_per_k
        k_heads = qkvz.shape[-1] // (2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.view(b, s, k_heads, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        beta_in, a = ba.view(b, s, k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(b, s, -1), k.reshape(b, s, -1), v.reshape(b, s, -1)], dim=-1)
        beta = beta_in.reshape(b, s, -1).sigmoid()
        # float32 before exp: in half precision exp(A_log) may overflow and softplus lose the small gates
        g = -self.A_log.float().exp() * F.softplus(a.reshape(b, s, -1).float() + self.dt_bias)
        return mixed, z.reshape(b, s, -1, dv), beta, g

    def _mix(
        self,
        mixed: torch.Tensor,
        beta: torch.Tensor,
        g: torch.Tensor,
        state: LinearAttentionState | None,
        output_final_state: bool,
    ) -> tuple[torch.Tensor, LinearAttentionState | None]:
        """The token mixing of one stretch of a sequence: short convolution then delta rule, starting from
        `state` (None: the stretch starts a sequence). Returns [b, s, v_heads, head_v_dim] and the state."""
        conv_out, conv_state = causal_conv1d(mixed, self.conv1d.weight, None if state is None else state.conv)
        conv_out = self.act(conv_out).to(mixed.dtype)
        b, s = mixed.shape[0], mixed.shape[1]
        k_heads = beta.shape[-1] // self.v_per_k
        key_dim = k_heads * self.head_k_dim
        q, k, v = conv_out.split([key_dim, key_dim, conv_out.shape[-1] - 2 * key_dim], dim=-1)
        rule = recurrent_gated_delta_rule if s == 1 else chunk_gated_delta_rule  # a single token: no chunk to pad
        core, recurrent = rule(
            q.reshape(b, s, k_heads, self.head_k_dim),
            k.reshape(b, s, k_heads, self.head_k_dim),
            v.reshape(b, s, -1, self.head_v_dim),
            g,
            beta,
            chunk_size=self.chunk_size,
            initial_state=None if state is None else state.recurrent,
            output_final_state=output_final_state,
        )
        new_state = LinearAttentionState(conv_state, recurrent) if recurrent is not None else None
        return core, new_state

    def _output(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        b, s = core.shape[0], core.shape[1]
        out: torch.Tensor = self.out_proj(self.norm(core, z).reshape(b, s, -1))
        return out

    def forward_with_state(
        self, x: torch.Tensor, state: LinearAttentionState | None = None
    ) -> tuple[torch.Tensor, LinearAttentionState]:
        """The layer over x [b, s, hidden] continuing from `state` (None: x starts the sequence); returns
        the output and the state after x's last token.

        Running a sequence in consecutive pieces, each from the previous piece's state, equals one
        forward over the whole: generation does that (prefill, then one token at a time), and so can a
        context-parallel engine, with rank i starting from the state rank i - 1 hands on (the
        recurrent state and the convolution's last inputs). The delta rule itself with
        `initial_state`/`output_final_state` is `chunk_gated_delta_rule`. Both pieces of the state are
        differentiable inputs and outputs, so gradients flow back across the handover.
        """
        mixed, z, beta, g = self._project(x)
        core, new_state = self._mix(mixed, beta, g, state, output_final_state=True)
        assert new_state is not None
        return self._output(core, z), new_state

    def forward(
        self, x: torch.Tensor, cache: LinearAttentionCache | None = None, starts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [b, s, hidden_size] -> [b, s, hidden_size].

        `cache`: continue from the layer's state in the cache and store the new one (generation; the
        one-token steps use the recurrent form, longer inputs the chunked one).
        `starts` [b, s] bool: tokens that begin a new packed document (position 0 always does); the
        convolution and the recurrent state restart there, so each document gives what it gives alone.
        That is a plain loop over the documents of each row (the projections, norm and output
        projection still run once over the whole batch): simple and exact, at the cost of one
        delta-rule call, each padded to whole chunks, per document.
        """
        if cache is not None:
            if starts is not None:
                raise ValueError("GatedDeltaNet: `starts` (packed documents) is for training, not with a cache")
            out, state = self.forward_with_state(x, cache.linear_state(self.layer_idx))
            cache.update_linear_state(self.layer_idx, state)
            return out
        mixed, z, beta, g = self._project(x)
        s = mixed.shape[1]
        restarts = starts is not None and bool(starts[:, 1:].any())
        if starts is None or not restarts:
            core = self._mix(mixed, beta, g, None, output_final_state=False)[0]
            return self._output(core, z)
        if tuple(starts.shape) != tuple(mixed.shape[:2]):
            raise ValueError(f"starts {tuple(starts.shape)} must be [batch, sequence] {tuple(mixed.shape[:2])}")
        rows = []
        for row in range(mixed.shape[0]):
            begins = [0, *(i for i in starts[row].nonzero().flatten().tolist() if i > 0), s]
            docs = [
                self._mix(mixed[row : row + 1, i:j], beta[row : row + 1, i:j], g[row : row + 1, i:j], None, False)[0]
                for i, j in zip(begins[:-1], begins[1:], strict=True)
            ]
            rows.append(torch.cat(docs, dim=1))
        return self._output(torch.cat(rows, dim=0), z)


GATED_DELTANET_PARAMETERS = (
    "in_proj_qkvz.weight",
    "in_proj_ba.weight",
    "conv1d.weight",
    "dt_bias",
    "A_log",
    "norm.weight",
    "out_proj.weight",
)


def init_gated_deltanet_parameter(
    name: str, tensor: torch.Tensor, generator: torch.Generator, std: float, *, module: str = "linear_attn"
) -> bool:
    """Fill a `GatedDeltaNet` parameter as transformers initialises it, drawing only from `generator`
    (for a model's `init_parameter`, after building on meta); False, untouched, for any other name.

    `name` is the parameter's name within the layer (`A_log`) or a full name in which the layer is the
    attribute `module` (`model.layers.3.linear_attn.A_log`; transformers' Qwen3-Next calls it
    `linear_attn`): names are matched after the last `module.`, so a model's own `norm.weight` or
    `out_proj.weight` elsewhere is not taken for this layer's. The rules: the projections and the
    convolution normal(0, std) (transformers: std = initializer_range, the output projection not
    scaled down); `dt_bias` ones; `A_log` = log(uniform(0.01, 16)); the gated norm's weight ones (it
    multiplies directly, unlike Qwen3-Next's zero-centred RMSNorms whose weights start at zero).
    Random values are drawn in float32 on the generator's device, so every device and dtype gets the
    same numbers.
    """
    head, found, own = name.rpartition(f"{module}.") if module else ("", "", name)
    if own not in GATED_DELTANET_PARAMETERS or (found and head and not head.endswith(".")):
        return False
    if own in ("dt_bias", "norm.weight"):
        tensor.data.fill_(1.0)
    elif own == "A_log":
        values = torch.empty(tensor.shape, dtype=torch.float32, device=generator.device)
        values.uniform_(*A_LOG_RANGE, generator=generator)
        tensor.data.copy_(values.log_())
    else:
        init_normal(tensor, std, generator)
    return True
