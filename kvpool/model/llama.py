"""The Llama-family model (Llama 2/3, Mistral, SmolLM2/3, Qwen2/3) in PyTorch, over a paged KV
cache.

Each layer is built from its `LayerSpec` (`ModelConfig.layer_specs`): its rotary embedding (one
cos/sin table per distinct `RopeSpec`, shared by the layers that use it; none for a NoPE layer),
and the model-wide options: Qwen3's per-head RMSNorm of queries and keys before RoPE
(`qk_norm`), Qwen2's q/k/v biases, Gemma 2's soft-capped attention scores (handed to the
backend as `logit_softcap`).

Inputs are flat: the new tokens of every sequence in the step, concatenated with no padding,
with their absolute positions. Attention goes through an `AttentionBackend` given at
construction; layer i hands the backend its view of the KV cache and its plan from the step's
`KVStep` (`kvpool.attention.kv_step`: a sliding-window layer's blocks may differ from a full
layer's), so nothing about the batch reaches attention through globals. Logits are computed
only for `logits_indices`. `forward` runs under `torch.inference_mode()`: this model serves,
it never trains.

Weights: parameters are allocated empty (no random init) in the requested dtype and device and
filled by `load_weights` from *checkpoint names* (HuggingFace names without the `model.` prefix,
e.g. `layers.0.self_attn.q_proj.weight`). Q/K/V and gate/up are stored fused, one matmul each;
`load_weights` copies each checkpoint tensor into its slice of the fused parameter (checkpoints
that fuse them too, Phi-3's, are split first: `kvpool.model.fused_weights`). Every matmul
is a `Linear` (`kvpool.model.linear`); `pack_weights()`, called once the weights are in, lays
them out for the CPU's oneDNN matmul (a 2-3x faster decode step on the CPU).

Tensor parallelism (`kvpool.model.parallel`, Megatron-style): given a `TensorParallel` of size
> 1, each rank allocates only its shard: its query and KV heads (the fused qkv holds the local q,
k and v rows), its columns of o_proj, its slice of gate/up and columns of down, its vocab rows
of the embedding and LM head (tied heads share those rows); norms are replicated. o_proj, down
and the embedding are followed by an all-reduce; the LM head's partial logits are gathered on
rank 0. The KV cache a rank is given holds only its local KV heads. `checkpoint_tensors` names
the local targets and `checkpoint_slices` the part of each full checkpoint tensor they take, so
loaders read only that. At size 1 the collectives do nothing and every shard is the whole.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvpool.attention.backend import AttentionBackend
from kvpool.attention.kv_step import KVStep
from kvpool.kernels import fused
from kvpool.kernels.decode_rows import leading_decode_rows
from kvpool.kernels.group_quant import GroupQuantized
from kvpool.model.config import ModelConfig
from kvpool.model.fused_weights import split_fused
from kvpool.model.linear import Linear, empty_parameter
from kvpool.model.moe import SparseMoE
from kvpool.model.norms import HeadNorm, RMSNorm
from kvpool.model.parallel import ShardSlice, TensorParallel, check_shapes, take_slice
from kvpool.model.quantization import Quantization
from kvpool.model.quantized_weights import quantize_linears
from kvpool.model.rope import NoRotary, RopeTables, StepRotary
from kvpool.model.shard_slices import shard_slice


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, backend: AttentionBackend,
        dtype: torch.dtype, device: torch.device | str, tp: TensorParallel,
    ):
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        self.tp = tp
        self.num_heads = len(tp.shard(config.num_heads))  # this rank's heads (all at tp=1)
        self.num_kv_heads = tp.num_local_kv_heads(config.num_kv_heads)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.layer_specs[layer_id].sliding_window  # None: full
        self.logit_softcap = config.attn_logit_softcapping  # None: scores not capped
        qkv_size = self.q_size + 2 * self.kv_size
        self.qkv = Linear(config.hidden_size, qkv_size, config.attention_bias, dtype, device)
        self.o_proj = Linear(self.q_size, config.hidden_size, False, dtype, device)
        self.q_norm, self.k_norm = (
            (HeadNorm(config.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm
             else nn.Identity()) for _ in "qk")

    def forward(self, x: torch.Tensor, rotary: StepRotary | NoRotary, kv: KVStep) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv(x)  # [num_tokens, qkv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))  # views of qkv's rows
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        rotary.apply_(q)
        rotary.apply_(k)
        layer = self.layer_id
        out = self.backend.forward(
            q, k, v, kv.layers[layer], kv.metadata[layer], self.scale, kv.scales[layer],
            sliding_window=self.sliding_window, logit_softcap=self.logit_softcap,
        )  # [num_tokens, num_heads, head_dim]
        return self.tp.row_parallel(self.o_proj, out.reshape(num_tokens, self.q_size))


# The gated MLP's activation-and-multiply, by `ModelConfig.hidden_act`.
_ACT_AND_MUL = {"silu": fused.silu_and_mul, "gelu_pytorch_tanh": fused.gelu_tanh_and_mul}


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), with gate and up as one matmul (SwiGLU; Gemma's
    GELU-tanh)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.intermediate_size = len(tp.shard(config.intermediate_size))  # this rank's slice
        hidden, intermediate = config.hidden_size, self.intermediate_size
        self.gate_up = Linear(hidden, 2 * intermediate, False, dtype, device)
        self.down = Linear(intermediate, hidden, False, dtype, device)
        self.act_and_mul = _ACT_AND_MUL[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.row_parallel(self.down, self.act_and_mul(self.gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, backend: AttentionBackend,
        dtype: torch.dtype, device: torch.device | str, tp: TensorParallel,
    ):
        super().__init__()

        def norm(present: bool = True) -> nn.Module:
            return (RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device) if present
                    else nn.Identity())

        self.input_layernorm = norm()
        self.self_attn = Attention(config, layer_id, backend, dtype, device, tp)
        self.attn_out_norm = norm(config.sandwich_norms)
        self.mlp_in_norm = norm()
        self.mlp: MLP | SparseMoE = (SparseMoE(config.moe, dtype, device, tp)
                                     if config.layer_specs[layer_id].sparse_mlp
                                     else MLP(config, dtype, device, tp))
        self.mlp_out_norm = norm(config.sandwich_norms)

    def checkpoint_norms(self, sandwich: bool) -> dict[str, RMSNorm]:
        """Checkpoint name (in the layer) -> norm: Llama calls the MLP's input norm
        `post_attention_layernorm`; Gemma's names put one norm on each side of each sublayer."""
        if not sandwich:
            return {"input_layernorm": self.input_layernorm,
                    "post_attention_layernorm": self.mlp_in_norm}
        return {"input_layernorm": self.input_layernorm,
                "post_attention_layernorm": self.attn_out_norm,
                "pre_feedforward_layernorm": self.mlp_in_norm,
                "post_feedforward_layernorm": self.mlp_out_norm}

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rotary: StepRotary | NoRotary,
        kv: KVStep,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual` is the stream x_l (None before the first layer, where `hidden` is it);
        `hidden` is the previous sublayer's output, not yet added. Returns the MLP's output
        and the stream with the attention output added: x_{l+1} = residual + output."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            self.input_layernorm.add_(hidden, residual)
        hidden = self.attn_out_norm(self.self_attn(hidden, rotary, kv))
        self.mlp_in_norm.add_(hidden, residual)
        return self.mlp_out_norm(self.mlp(hidden)), residual


class LlamaModel(nn.Module):
    """Embeddings, `num_layers` pre-norm decoder layers, final norm, LM head (tied or not);
    with `tp` of size > 1, this rank's shard of them (module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        attention_backend: AttentionBackend,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp: TensorParallel = TensorParallel.single(),  # noqa: B008 (frozen, immutable)
    ):
        super().__init__()
        check_shapes(config, tp.size)  # a ValueError naming the field, not a failed assert
        self.config = config
        self.dtype = dtype
        self.attention_backend = attention_backend
        self.tp = tp
        self.vocab_range = tp.shard(config.vocab_size)  # this rank's rows of embedding, head
        num_local_vocab = len(self.vocab_range)
        self.embed_tokens = empty_parameter(num_local_vocab, config.hidden_size, dtype=dtype,
                                            device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, attention_backend, dtype, device, tp)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        # The table as a `Linear` whose rows are looked up (never packed: not in `linears()`);
        # a tied head is that same layer.
        self.embedding = Linear(config.hidden_size, num_local_vocab, False, dtype, device,
                                self.embed_tokens)
        self.lm_head = (self.embedding if config.tie_word_embeddings else
                        Linear(config.hidden_size, num_local_vocab, False, dtype, device))
        self.rope_tables = RopeTables(config, device)
        # The multiplier rounded to the model's dtype, as transformers multiplies (exact: 1.0).
        self.embedding_multiplier = float(torch.tensor(config.embedding_multiplier, dtype=dtype))

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv: KVStep,  # each layer's KV view (this rank's KV heads), scales and plan
        logits_indices: torch.Tensor,  # [num_samples] int64: rows of the batch to sample from
    ) -> torch.Tensor | None:  # [num_samples, vocab_size] float32
        """The logits of the `logits_indices` rows: the full vocabulary on rank 0 (at tp=1,
        always); None on the other ranks, which send their vocab slice to rank 0. Every rank
        must call it with the same inputs (each fills its own KV heads of the cache)."""
        hidden = self._embed(token_ids).mul_(self.embedding_multiplier)  # [tokens, hidden]
        rotaries = self.rope_tables.for_step(positions)  # one per layer
        residual = None
        num_decodes = kv.plan.num_decode_seqs  # decode rows lead the step: one token each
        with leading_decode_rows(num_decodes):
            for layer, rotary in zip(self.layers, rotaries, strict=True):
                hidden, residual = layer(hidden, residual, rotary, kv)
        # The final norm is per row: select the rows that need logits first.
        hidden, residual = hidden[logits_indices], residual[logits_indices]
        self.norm.add_(hidden, residual)
        # Gathered in the model's dtype (half the bytes for bf16); concatenation is exact.
        with leading_decode_rows(lambda: logits_indices < num_decodes):
            logits = self.tp.gather_last_dim(self.lm_head(hidden))  # [num_samples, vocab]
        if logits is None:
            return None
        cap = self.config.final_logit_softcapping
        return logits.float() if cap is None else torch.tanh(logits.float() / cap) * cap

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank its own rows, zeros for the others' ids, summed
        over the ranks (exact: one term is non-zero). # [num_tokens, hidden_size]"""
        if not self.tp.is_parallel:
            return self.embedding.rows(token_ids)
        local_ids = token_ids - self.vocab_range.start
        is_other = (local_ids < 0) | (local_ids >= len(self.vocab_range))
        hidden = self.embedding.rows(local_ids.masked_fill(is_other, 0))
        return self.tp.all_reduce_(hidden.masked_fill_(is_other.unsqueeze(-1), 0))

    # ------------------------------------------------------------- weights
    def linears(self) -> list[Linear]:
        """Every matmul of the model, the language-model head last."""
        layers = [(layer.self_attn.qkv, layer.self_attn.o_proj, *_mlp_linears(layer.mlp))
                  for layer in self.layers]
        return [linear for group in layers for linear in group] + [self.lm_head]

    def pack_weights(self) -> int:
        """Lay every matmul's weight out once for the CPU's oneDNN matmul where it can serve
        (`kvpool.model.linear`); returns how many were packed. Call after `load_weights`:
        packed layers release their plain weights, so the weights can no longer be loaded."""
        return sum(linear.pack() for linear in self.linears())

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint name -> the (view of the) parameter it fills: this rank's shard, which
        `checkpoint_slices` says how to cut from the full checkpoint tensor."""
        if any(linear.is_packed or linear.quantized is not None
               for linear, _ in self.linear_sources()):
            raise ValueError("the weights were packed for inference: load them into a new model")
        views = {name: view for linear, parts in self.linear_sources() for name, view in
                 zip(parts, linear.weight.split(list(parts.values()), dim=0), strict=True)}
        # The order loaders draw dummy weights in: the embedding, the final norm and head, then
        # each layer's tensors.
        targets = {"embed_tokens.weight": views.pop("embed_tokens.weight"),
                   "norm.weight": self.norm.weight}
        if not self.config.tie_word_embeddings:
            targets["lm_head.weight"] = views.pop("lm_head.weight")
        for i, layer in enumerate(self.layers):
            prefix = f"layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for norm_name, norm in layer.checkpoint_norms(self.config.sandwich_norms).items():
                targets[prefix + norm_name + ".weight"] = norm.weight
            for part in ("q_proj", "k_proj", "v_proj"):
                targets[f"{prefix}self_attn.{part}.weight"] = views.pop(
                    f"{prefix}self_attn.{part}.weight")
            if attn.qkv.bias is not None:
                q_part, k_part, v_part = attn.qkv.bias.split(
                    [attn.q_size, attn.kv_size, attn.kv_size], dim=0)
                targets[prefix + "self_attn.q_proj.bias"] = q_part
                targets[prefix + "self_attn.k_proj.bias"] = k_part
                targets[prefix + "self_attn.v_proj.bias"] = v_part
            targets[prefix + "self_attn.o_proj.weight"] = views.pop(
                prefix + "self_attn.o_proj.weight")
            if isinstance(attn.q_norm, HeadNorm):
                targets[prefix + "self_attn.q_norm.weight"] = attn.q_norm.weight
                targets[prefix + "self_attn.k_norm.weight"] = attn.k_norm.weight
            if isinstance(mlp, SparseMoE):  # the Hub's per-expert names
                for name, tensor in mlp.checkpoint_tensors("per_expert").items():
                    targets[prefix + name] = tensor
                continue
            for part in ("gate_proj", "up_proj", "down_proj"):
                targets[f"{prefix}mlp.{part}.weight"] = views.pop(f"{prefix}mlp.{part}.weight")
        return targets

    def linear_sources(self) -> list[tuple[Linear, dict[str, int]]]:
        """Each `Linear` whose weight comes from checkpoint tensors, with their names and row
        counts in the order they fill it (q, k, v; gate, up). The embedding table is one: a
        tied head's own, else a `Linear` used only for its rows."""
        sources = []
        for i, layer in enumerate(self.layers):
            prefix = f"layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            sources.append((attn.qkv, {prefix + "self_attn.q_proj.weight": attn.q_size,
                                       prefix + "self_attn.k_proj.weight": attn.kv_size,
                                       prefix + "self_attn.v_proj.weight": attn.kv_size}))
            sources.append((attn.o_proj, {prefix + "self_attn.o_proj.weight":
                                          attn.o_proj.out_features}))
            if not isinstance(mlp, SparseMoE):
                sources.append((mlp.gate_up, {prefix + "mlp.gate_proj.weight":
                                              mlp.intermediate_size,
                                              prefix + "mlp.up_proj.weight":
                                              mlp.intermediate_size}))
                sources.append((mlp.down, {prefix + "mlp.down_proj.weight":
                                           mlp.down.out_features}))
        vocab = len(self.vocab_range)
        sources.append((self.embedding, {"embed_tokens.weight": vocab}))
        if not self.config.tie_word_embeddings:
            sources.append((self.lm_head, {"lm_head.weight": vocab}))
        return sources

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | GroupQuantized]],
                     quantization: Quantization = Quantization()) -> None:  # noqa: B008
        """Copy checkpoint tensors (any dtype or device) into the parameters, then put the
        matmul weights in `quantization`'s form (`kvpool.model.quantization`): a layer whose
        every part came quantized (a GGUF's blocks, as `GroupQuantized`) keeps them so;
        int8/int4 quantize the float ones. Under tensor parallelism each tensor must already
        be this rank's slice (`checkpoint_slices`), but for fused ones (Phi-3's `qkv_proj`,
        `gate_up_proj`), given whole and split here.

        Raises ValueError naming the tensor for an unknown name, a shape mismatch, or a tensor
        the model needs that `weights` never gave.
        """
        targets = self.checkpoint_tensors()
        missing = set(targets)
        staged: dict[str, GroupQuantized] = {}
        for name, tensor in _unfused(self.config, self.tp, weights):
            target = targets.get(name)
            if target is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(target.shape)}{self._shard_note()}"
                )
            missing.discard(name)
            if isinstance(tensor, GroupQuantized):
                staged[name] = tensor
                continue
            target.copy_(tensor)
            if name.endswith("norm.weight"):  # every RMSNorm: stored as weight - offset
                target.add_(self.config.norm_offset)
        if missing:
            shown = ", ".join(f"{n} {tuple(targets[n].shape)}" for n in sorted(missing)[:5])
            raise ValueError(f"checkpoint lacks {len(missing)} tensors the model needs: {shown}")
        quantize_linears(self.linear_sources(), targets, staged, quantization)
        if self.embedding.quantized is not None:  # the table's float copy is gone
            self.embed_tokens = empty_parameter(0, dtype=self.dtype, device=self.device)

    def _shard_note(self) -> str:
        if not self.tp.is_parallel:
            return ""
        return f" (rank {self.tp.rank}'s shard at tensor_parallel_size {self.tp.size})"


def checkpoint_shapes(
    config: ModelConfig, tp: TensorParallel = TensorParallel.single()  # noqa: B008
) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor a model of `config` needs, with the shape of the part `tp`'s
    rank holds (the full shape at tp=1); no memory is used."""
    model = LlamaModel(config, None, device="meta", tp=tp)  # type: ignore[arg-type]
    return {name: tuple(t.shape) for name, t in model.checkpoint_tensors().items()}


def checkpoint_slices(
    config: ModelConfig, tp: TensorParallel = TensorParallel.single()  # noqa: B008
) -> dict[str, ShardSlice]:
    """Checkpoint name -> the (dimension, range) of the FULL checkpoint tensor `tp`'s rank
    needs, or None where it needs all of it (`shard_slice`, for every name)."""
    return {name: shard_slice(config, tp, name) for name in checkpoint_shapes(config, tp)}


def _unfused(config: ModelConfig, tp: TensorParallel,
             weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """`weights` with each fused tensor (whole) replaced by its parts, each cut to `tp`'s
    rank's slice as the unfused checkpoint tensor of that name would be."""
    for name, tensor in weights:
        parts = split_fused(config, name, tensor)
        if parts is None:
            yield name, tensor
            continue
        for part_name, part in parts:
            yield part_name, take_slice(part, shard_slice(config, tp, part_name))


def _mlp_linears(mlp: MLP | SparseMoE) -> tuple[Linear, ...]:
    """The `Linear`s of a layer's MLP: the dense one's two, or a mixture's router."""
    return (mlp.gate,) if isinstance(mlp, SparseMoE) else (mlp.gate_up, mlp.down)
