"""What a ``transformers`` KV cache of ``generate`` holds: its size forecast from the model's config
and the call's arguments, and the bytes a cache object holds on a device.

This is the one place that reads ``transformers``' generation arguments and cache internals (for
transformers 5): the length ``generate`` may reach (``max_new_tokens`` over ``max_length``, each from
the call's keywords, the ``generation_config`` passed, the model's, then transformers' defaults: 20
new tokens, at most ``max_position_embeddings``), how many sequences it runs (``num_beams`` or
``num_return_sequences`` copies of each prompt), and where a cache keeps its tensors (its ``layers``,
each with ``keys`` and ``values``, and for an encoder-decoder its two caches; a module call's output
holds it as ``cache``).

The forecast is that of the default dynamic cache: every position but the last generated token's
(never fed back) keeps one key and one value per layer, ``num_key_value_heads x head_dim`` values
each, in the compute dtype. A cache whose keys another way holds (a static or quantized cache, one the
caller passes in) is refused before decoding, as is a model whose config does not give these sizes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from chunkmem.placement.policy import format_bytes

from ..errors import NotSupportedError

__all__ = ["CacheForecast", "cache_bytes", "forecast_cache", "output_cache"]

_DEFAULT_NEW_TOKENS = 20
"""transformers' default when neither ``max_new_tokens`` nor ``max_length`` is set."""


@dataclass(frozen=True, slots=True)
class CacheForecast:
    """The KV cache of one ``generate`` call at its longest."""

    sequences: int
    """Rows of the cache: the prompts' batch times its copies (beams or returned sequences)."""
    positions: int
    """Positions cached at the longest: the prompt and every generated token but the last."""
    position_bytes: int
    """Bytes one position of one sequence holds over all layers (keys and values)."""
    prompt: int
    """Positions of the prompt (the batch's padded length)."""
    shape: str
    """How ``position_bytes`` is made, for messages."""

    @property
    def nbytes(self) -> int:
        return self.sequences * self.positions * self.position_bytes

    def describe(self) -> str:
        return (
            f"{format_bytes(self.nbytes)} for the KV cache ({self.sequences} sequences x {self.positions} positions: "
            f"a prompt of {self.prompt} and the new tokens but the last; {self.shape})"
        )

    def new_tokens_within(self, nbytes: int) -> int:
        """The most new tokens whose cache fits in ``nbytes`` at this batch (0: not even the prompt's)."""
        return max(0, nbytes // max(1, self.sequences * self.position_bytes) - self.prompt + 1)

    def sequences_within(self, nbytes: int) -> int:
        """The most sequences whose cache fits in ``nbytes`` at these lengths."""
        return nbytes // max(1, self.positions * self.position_bytes)

    def agreed(self, sequences: int, prompt: int, positions: int) -> CacheForecast:
        """This forecast at the ranks' largest batch, prompt and length."""
        return CacheForecast(sequences, positions, self.position_bytes, prompt, self.shape)


def _setting(name: str, kwargs: Mapping[str, Any], model: torch.nn.Module) -> Any:
    """A generation setting as ``generate`` resolves it: the call's keyword, the ``generation_config``
    passed, then the model's (``None``: unset everywhere)."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _prompt_shape(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[int, int]:
    first = args[0] if args else None
    for value in (kwargs.get("input_ids"), kwargs.get("inputs"), first, kwargs.get("inputs_embeds")):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    raise NotSupportedError(
        "generate() on a boosted model needs the prompt as a batch of token ids (input_ids, or the first argument, of "
        "shape [batch, length]) or inputs_embeds: the KV cache is reserved under the device budget from its size"
    )


def _refuse(model: torch.nn.Module, why: str) -> NotSupportedError:
    return NotSupportedError(
        f"generate() on the boosted {type(model).__name__} refused: {why}. chunkmem reserves the KV cache under the "
        "device budget before decoding, from the size of transformers' default dynamic cache. Generate with the "
        "default cache (no cache= / past_key_values=, no cache_implementation), or with use_cache=False, or from a "
        "plain copy (model.plain_copy())"
    )


def forecast_cache(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], dtype: torch.dtype
) -> CacheForecast:
    """The KV cache ``model.generate(*args, **kwargs)`` reaches at its longest, in ``dtype`` (the
    compute dtype); 0 bytes with ``use_cache=False``."""
    sequences, prompt = _prompt_shape(args, kwargs)
    copies = max(_setting("num_beams", kwargs, model) or 1, _setting("num_return_sequences", kwargs, model) or 1)
    config = getattr(model, "config", None)
    new_tokens, max_length = _setting("max_new_tokens", kwargs, model), _setting("max_length", kwargs, model)
    if new_tokens is not None:
        length = prompt + int(new_tokens)
    elif max_length is not None:
        length = int(max_length)
    else:
        length = prompt + _DEFAULT_NEW_TOKENS
        most = getattr(config, "max_position_embeddings", None)
        length = min(length, most) if most is not None else length
    positions = max(prompt, length - 1)
    if _setting("use_cache", kwargs, model) is False:
        return CacheForecast(sequences * copies, positions, 0, prompt, "use_cache=False: no cache")
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        raise _refuse(model, "it is handed a cache (cache= or past_key_values=), whose size chunkmem does not know")
    implementation = _setting("cache_implementation", kwargs, model)
    if implementation not in (None, "dynamic"):
        raise _refuse(model, f"cache_implementation={implementation!r} keeps its keys otherwise than the default cache")
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    if text is None or getattr(config, "is_encoder_decoder", False):
        raise _refuse(model, "it is not a decoder-only transformers model with a config")
    try:
        layers, heads, hidden = text.num_hidden_layers, text.num_attention_heads, text.hidden_size
    except AttributeError as missing:
        raise _refuse(model, f"its config does not give the cache's size ({missing})") from None
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    shape = f"2 x {layers} layers x {kv_heads} kv heads x {head_dim} head dim x {itemsize} bytes a position"
    return CacheForecast(sequences * copies, positions, 2 * layers * kv_heads * head_dim * itemsize, prompt, shape)


def output_cache(out: object) -> object | None:
    """The cache a module call returned (``cache`` of its output; ``None``: none)."""
    return getattr(out, "cache", None)


def _tensors(cache: object) -> Iterator[torch.Tensor]:
    for name in ("self_attention_cache", "cross_attention_cache"):  # an encoder-decoder's two caches
        inner = getattr(cache, name, None)
        if inner is not None:
            yield from _tensors(inner)
    for layer in getattr(cache, "layers", None) or ():
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                yield value


def cache_bytes(cache: object, device: torch.device) -> int:
    """Bytes the storages of ``cache``'s tensors on ``device`` hold (each storage once)."""
    seen: dict[int, int] = {}
    for tensor in _tensors(cache):
        if tensor.device == device and tensor.numel():
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
