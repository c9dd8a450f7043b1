"""The models and training systems the activations benchmark compares (``benchmarks/activations.py``).

A ``ModelShape`` builds a GPT-2 or LLaMA language model from a config (no download), seeded, on
the device. A ``System`` builds a ``Trainer`` for a shape: the model, its optimizer and one training
step, trained the way that system trains it:

* ``plain`` / ``plain-ckpt``: the model on the device with ``torch.optim.AdamW`` (fused on CUDA);
  under bf16, fp32 weights with ``torch.autocast`` (the usual plain-PyTorch mixed precision).
  ``-ckpt``: Hugging Face gradient checkpointing (non-reentrant ``torch.utils.checkpoint`` around
  every block).
* ``fsdp2-ckpt`` / ``fsdp2-offload-ckpt``: ``fully_shard`` on every block and the root at world
  size 1 (bf16 compute through ``MixedPrecisionPolicy``), with Hugging Face gradient checkpointing;
  ``-offload`` adds ``CPUOffloadPolicy`` (parameters, gradients and the optimizer step in host
  memory).
* ``chunkmem-keep`` / ``-recompute`` / ``-offload``: boosted by chunkmem with its optimizer side
  (fp32 masters, gradient shards, AdamW states) in host memory and the compute-dtype weights on the
  device (``StaticPlacementConfig(offload_optim_frac=1.0)``) under the least ``device_budget``
  that placement accepts (gradient buffers go to the host early instead of all waiting on the
  device for the end of the backward: the most room for activations), and every block's saved activations
  kept, recomputed or offloaded (``ActivationPlacement``). ``CHUNKMEM_CHOICES`` maps a choice to
  its ``ActivationPlacement``.
* ``chunkmem-auto``: the same, with ``ActivationPlacement(auto=[block])``: one ``device_budget``
  for model data, the blocks' saved activations and one block's working set, each block call kept,
  offloaded or recomputed as ``model.activation_plan`` chose from the first step. Its plan is made
  once and a step that saves more than the first is refused, so the benchmark builds it again for
  every length (``Trainer.rebuild``) under a budget for that length, from the same initial weights:
  its losses at a length are the initial model's trained on that length's batches.
* ``chunkmem-auto-outside``: ``chunkmem-auto`` with ``offload_outside=True``: what autograd saves
  outside the blocks (embeddings, head, the loss's log-softmax of the logits) is offloaded too, each
  stretch between block calls an offloaded call of the plan, in chunkmem's ledger under its budget.

Every system gets the same initial weights (the shape's seed) and the same batches.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from benchmarks.common import GPT2Shape, release_memory, use_causal_lm_loss

__all__ = ["CHUNKMEM_CHOICES", "PRESETS", "SYSTEMS", "ModelShape", "Recipe", "System", "Trainer", "parse_shape"]


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only language model: ``layers`` blocks of width ``width``."""

    family: Literal["gpt2", "llama"]
    layers: int
    width: int
    vocab: int

    @property
    def name(self) -> str:
        return f"{'GPT-2' if self.family == 'gpt2' else 'LLaMA'} {self.layers}x{self.width}"

    @property
    def block_class(self) -> str:
        return "GPT2Block" if self.family == "gpt2" else "LlamaDecoderLayer"

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        inner = getattr(model, "module", model)  # a boosted model's own module
        return list(inner.transformer.h) if self.family == "gpt2" else list(inner.model.layers)

    def build(self, max_seq: int, device: torch.device, seed: int = 0) -> torch.nn.Module:
        """The model with room for ``max_seq`` positions, initialised from ``seed`` on ``device``."""
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        heads = max(1, self.width // 64)
        with torch.device(device):
            if self.family == "gpt2":
                config = GPT2Config(
                    vocab_size=self.vocab,
                    n_positions=max_seq,
                    n_embd=self.width,
                    n_layer=self.layers,
                    n_head=GPT2Shape(self.layers, self.width, self.vocab, max_seq).heads,
                    resid_pdrop=0.0,
                    embd_pdrop=0.0,
                    attn_pdrop=0.0,
                    bos_token_id=0,
                    eos_token_id=0,
                )
                model: torch.nn.Module = GPT2LMHeadModel(config)
            else:
                config = LlamaConfig(
                    vocab_size=self.vocab,
                    hidden_size=self.width,
                    intermediate_size=4 * self.width,
                    num_hidden_layers=self.layers,
                    num_attention_heads=heads,
                    num_key_value_heads=heads // 4 if heads % 4 == 0 else heads,
                    max_position_embeddings=max_seq,
                    tie_word_embeddings=False,
                    bos_token_id=0,
                    eos_token_id=0,
                    pad_token_id=0,
                )
                model = LlamaForCausalLM(config)
        use_causal_lm_loss(model)
        model.train()
        return model


PRESETS: dict[str, ModelShape] = {
    "gpt2-xl": ModelShape("gpt2", 48, 1600, 50257),  # GPT-2 1.5B
    "gpt2-medium": ModelShape("gpt2", 24, 1024, 50257),  # GPT-2 350M
    "llama-1b": ModelShape("llama", 16, 2048, 128256),  # the LLaMA 3.2 1B shape (4x MLP)
    "gpt2-cpu": ModelShape("gpt2", 4, 256, 8192),
    "llama-cpu": ModelShape("llama", 4, 256, 8192),
}


def parse_shape(text: str, vocab: int | None = None) -> ModelShape:
    """A preset name, or ``family:LAYERSxWIDTH`` (``gpt2:2x64``); ``vocab`` overrides the preset's
    (default 8192 for a custom shape)."""
    if text in PRESETS:
        shape = PRESETS[text]
        return shape if vocab is None else ModelShape(shape.family, shape.layers, shape.width, vocab)
    family, _, size = text.partition(":")
    layers, _, width = size.partition("x")
    if family not in ("gpt2", "llama") or not layers.isdigit() or not width.isdigit():
        raise ValueError(f"model {text!r}: give a preset ({', '.join(PRESETS)}) or family:LAYERSxWIDTH (gpt2:2x64)")
    return ModelShape(family, int(layers), int(width), vocab or 8192)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Recipe:
    device: torch.device
    precision: Literal["fp32", "bf16"]
    lr: float = 1e-4
    chunkmem_budget: int | Literal["min"] | None = "min"
    """chunkmem's ``device_budget`` (model data): bytes, ``"min"`` for the least its placement
    accepts (what leaves activations the most room), or ``None`` for none."""

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16" else torch.float32


Activations = Literal["keep", "recompute", "offload", "auto"]


@dataclass
class Trainer:
    """One system's model, ready to train, and what its device figures are made of."""

    model: torch.nn.Module | None
    """``None`` for a trainer built again at every length (``rebuild``)."""
    step_fn: Callable[[torch.Tensor], torch.Tensor]
    activations: Activations
    """How the blocks' saved activations are held: kept, recomputed (checkpointed), offloaded, or
    placed under chunkmem's device budget (``auto``)."""
    params: int
    model_bytes_fn: Callable[[], int | None]
    """Device bytes of model data in the ledger: chunkmem's accounted peak, or an analytic count."""
    meter_parameters: tuple[torch.Tensor, ...] = ()
    stats_fn: Callable[[], Any] | None = None
    max_prefetch: int = 0
    close_fn: Callable[[], None] | None = None
    rebuild: Callable[[int], None] | None = None
    """Build the model again, from its initial weights, under this ``device_budget`` (bytes): called
    before each length (``None``: one model trains every length)."""
    plan_fn: Callable[[], Any] | None = None
    """chunkmem's ``activation_plan`` (``auto``)."""
    outside_in_ledger: bool = False
    """What is saved outside the blocks is in chunkmem's ledger (``offload_outside`` with ``auto``):
    its ``device_budget`` is the whole budget."""

    def step(self, ids: torch.Tensor) -> float:
        return float(self.step_fn(ids).detach().float().item())

    def close(self) -> None:
        if self.close_fn is not None:
            self.close_fn()


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def enable_hf_checkpointing(model: torch.nn.Module) -> None:
    """Hugging Face activation checkpointing, non-reentrant (renamed in transformers 5)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    kwargs = {"use_reentrant": False}
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _plain_model_bytes(params: int) -> Callable[[], int]:
    """fp32 weights and gradients and AdamW's two fp32 moments: 16 bytes a parameter (autocast
    keeps the weights fp32)."""
    return lambda: 16 * params


@dataclass(frozen=True)
class System:
    name: str

    def build(self, shape: ModelShape, max_seq: int, recipe: Recipe) -> Trainer:
        raise NotImplementedError


@dataclass(frozen=True)
class Plain(System):
    checkpointing: bool = False

    def build(self, shape: ModelShape, max_seq: int, recipe: Recipe) -> Trainer:
        model = shape.build(max_seq, recipe.device)
        if self.checkpointing:
            enable_hf_checkpointing(model)
        fused = {"fused": True} if recipe.device.type == "cuda" else {}
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, **fused)
        autocast = recipe.dtype != torch.float32

        def step(ids: torch.Tensor) -> torch.Tensor:
            with torch.autocast(recipe.device.type, dtype=recipe.dtype, enabled=autocast):
                loss = _loss(model, ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        params = _count(model)
        return Trainer(
            model,
            step,
            "recompute" if self.checkpointing else "keep",
            params,
            _plain_model_bytes(params),
            meter_parameters=tuple(model.parameters()),
        )


@dataclass(frozen=True)
class FSDP2(System):
    offload: bool = False

    def build(self, shape: ModelShape, max_seq: int, recipe: Recipe) -> Trainer:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if self.offload and recipe.device.type != "cuda":
            raise ValueError(f"{self.name} offloads to host memory: on a CPU the host is the device; use fsdp2-ckpt")
        started = not dist.is_initialized()
        if started:  # world size 1, in this process; closed with the trainer
            backend = "nccl" if recipe.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        model = shape.build(max_seq, recipe.device)
        params = _count(model)
        enable_hf_checkpointing(model)
        mesh = init_device_mesh(recipe.device.type, (1,))
        mixed = MixedPrecisionPolicy(param_dtype=recipe.dtype, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy(pin_memory=True) if self.offload else OffloadPolicy()
        for block in shape.blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=mixed, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=mixed, offload_policy=offload)
        # Fused where plain PyTorch is (on CUDA) and where the offload steps on the host (CPU fused
        # AdamW, the kernel chunkmem's host step uses).
        fused = {"fused": True} if recipe.device.type == "cuda" else {}
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, **fused)

        def step(ids: torch.Tensor) -> torch.Tensor:
            loss = _loss(model, ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        def close() -> None:
            if started and dist.is_initialized():
                dist.destroy_process_group()

        # With the offload, model data lives on the host but for the blocks being computed: not
        # in the ledger (the allocator measures it on a GPU, the only device it runs on).
        model_bytes = (lambda: None) if self.offload else _plain_model_bytes(params)
        return Trainer(model, step, "recompute", params, model_bytes, tuple(model.parameters()), close_fn=close)


def _keep(block: str) -> Any:
    return None


def _recompute(block: str) -> Any:
    from chunkmem.placement import ActivationPlacement

    return ActivationPlacement(recompute=[block])


def _offload(block: str) -> Any:
    from chunkmem.placement import ActivationPlacement

    return ActivationPlacement(offload=[block], max_prefetch=1)


def _auto(block: str) -> Any:
    from chunkmem.placement import ActivationPlacement

    return ActivationPlacement(auto=[block])


def _auto_outside(block: str) -> Any:
    from chunkmem.placement import ActivationPlacement

    return ActivationPlacement(auto=[block], offload_outside=True)


CHUNKMEM_CHOICES: dict[str, tuple[Activations, Callable[[str], Any]]] = {
    "keep": ("keep", _keep),
    "recompute": ("recompute", _recompute),
    "offload": ("offload", _offload),
    "auto": ("auto", _auto),
    "auto-outside": ("auto", _auto_outside),
}
"""A chunkmem choice: how its ledger counts the blocks' activations, and its ``ActivationPlacement``
for a block class (``None``: keep)."""


def _boost(
    shape: ModelShape, max_seq: int, recipe: Recipe, activations: Any, budget: int | Literal["min"] | None
) -> tuple[Any, Callable[[torch.Tensor], torch.Tensor], int]:
    """The model boosted by chunkmem (optimizer side in host memory) under ``budget``, its training
    step, and its parameter count."""
    from chunkmem import Booster, BudgetTooSmallError, ChunkPlugin
    from chunkmem.placement import StaticPlacementConfig

    model = shape.build(max_seq, recipe.device)
    params = _count(model)

    def plugin(budget: int | None) -> ChunkPlugin:
        placement = StaticPlacementConfig(offload_optim_frac=1.0, device_budget=budget)
        return ChunkPlugin(placement=placement, precision=recipe.precision, activations=activations)

    if budget == "min":
        # Asked by offering one byte: chunkmem refuses before it touches the model, naming the least.
        try:
            Booster(plugin(1)).boost(model, torch.optim.AdamW(model.parameters(), lr=recipe.lr))
        except BudgetTooSmallError as error:
            budget = int(error.minimum)
        else:
            raise AssertionError("chunkmem accepted a one-byte device budget")
    booster = Booster(plugin(budget))
    chunked, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=recipe.lr))

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = _loss(chunked, ids)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return chunked, step, params


@dataclass(frozen=True)
class Chunkmem(System):
    choice: str = "keep"

    def build(self, shape: ModelShape, max_seq: int, recipe: Recipe) -> Trainer:
        held, placement_for = CHUNKMEM_CHOICES[self.choice]
        activations = placement_for(shape.block_class)
        if held == "auto":
            return self._rebuilt(shape, max_seq, recipe, activations)
        chunked, step, params = _boost(shape, max_seq, recipe, activations, recipe.chunkmem_budget)
        return Trainer(
            chunked,
            step,
            held,
            params,
            lambda: chunked.stats().peak_device_bytes,
            stats_fn=chunked.stats,
            max_prefetch=activations.max_prefetch if activations is not None else 0,
        )

    @staticmethod
    def _rebuilt(shape: ModelShape, max_seq: int, recipe: Recipe, activations: Any) -> Trainer:
        """A trainer whose model is boosted at each ``rebuild(device_budget)``."""
        current: dict[str, Any] = {}

        def rebuild(budget: int) -> None:
            current.clear()  # the last length's model goes before the next is built
            release_memory(recipe.device)
            current["model"], current["step"], _ = _boost(shape, max_seq, recipe, activations, budget)

        def model() -> Any:
            if "model" not in current:
                raise RuntimeError("chunkmem-auto: call Trainer.rebuild(device_budget) before each length")
            return current["model"]

        def step(ids: torch.Tensor) -> torch.Tensor:
            model()
            return current["step"](ids)

        return Trainer(
            None,
            step,
            "auto",
            _count(shape.build(max_seq, torch.device("meta"))),
            lambda: model().stats().peak_device_bytes,
            stats_fn=lambda: model().stats(),
            close_fn=current.clear,
            rebuild=rebuild,
            plan_fn=lambda: model().activation_plan,
            outside_in_ledger=activations.offload_outside,
        )


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        Chunkmem("chunkmem-keep", "keep"),
        Chunkmem("chunkmem-offload", "offload"),
        Chunkmem("chunkmem-recompute", "recompute"),
        Chunkmem("chunkmem-auto", "auto"),
        Chunkmem("chunkmem-auto-outside", "auto-outside"),
        Plain("plain"),
        Plain("plain-ckpt", checkpointing=True),
        FSDP2("fsdp2-ckpt"),
        FSDP2("fsdp2-offload-ckpt", offload=True),
    )
}
"""Every system, in the order a run visits them (FSDP2 last: it opens a process group)."""

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
