"""The boosted model: ``ChunkedModel`` (``model``) and what it carries: the checks a saved state passes
(``model_state``), the step its state belongs to (``progress``), what ``p.grad`` shows
(``grad_markers``), which parameters are boosted (``boosted_params``), where a boost's values come from
(``backing``), and the entries a PEFT model saves (``peft_adapter``)."""
