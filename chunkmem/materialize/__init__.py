"""Giving values to a model built on the meta device, one parameter at a time, so that no rank
ever holds the whole model: its own initialisation recorded on meta and replayed exactly
(``record_init``), or a safetensors checkpoint read slice by slice (``SafetensorsWeights``).
``model_values`` picks the source for a model being boosted."""

from .model_init import RecordedInit, is_transformers_model, record_init
from .safetensors_weights import SafetensorsWeights
from .sources import MetaModelValues, model_values

__all__ = [
    "MetaModelValues",
    "RecordedInit",
    "SafetensorsWeights",
    "is_transformers_model",
    "model_values",
    "record_init",
]
