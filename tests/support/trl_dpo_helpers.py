"""Pieces of ``integration/trainers/test_trl_dpo.py`` that other tests use too."""

from __future__ import annotations

from typing import Any

from support.models import VOCAB


def word_tokenizer() -> Any:
    """A word-level tokenizer over the test vocabulary (token i is "t{i}"; t0 pads and ends), built
    offline: TRL's trainers need one even for a model built from its config."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t0", unk_token="t1")
