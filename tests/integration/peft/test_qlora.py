"""QLoRA (issue 45): a frozen base in bitsandbytes' 4-bit NF4 format, its packed bytes and scales in
chunks (placed, evicted, sharded and put on disk like any chunk, dequantized by each op), a LoRA
adapter trained over it in chunks of its own.

Against plain PEFT QLoRA over the same NF4 base, the same adapter init and data, in chunkmem's
mixed-precision recipe (``qlora_models.plain_qlora``): the arithmetic is the same (bitsandbytes'
kernels on the same bytes), so losses and the adapter are equal bit for bit, at one and two ranks,
with the base resident, evicted under a budget and on disk; the base's quantized bytes never change
and are those of plain bitsandbytes (a hash over them); the ledger holds exactly what the layers'
shapes say a 4-bit base stores (half a byte a weight and a 4-byte scale per 64), and its peak stays
under the budget. Both ways in: a base loaded quantized (bitsandbytes' API, or ``from_pretrained``
with a ``BitsAndBytesConfig``) and a base quantized at boost from its 16-bit checkpoint (the bytes
``from_pretrained`` quantizes, each rank reading only its slices). The saved adapter loads in plain
PEFT over a plain QLoRA base and gives the same outputs; a kill and resume is the uninterrupted
run. What cannot be kept is refused naming the format and the fix, before anything changes.
"""

from __future__ import annotations

import ast
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.distributed import run_ranks
from support.models import batches
from support.paths import ROOT
from support.peft_helpers import adapter_files
from support.qlora_models import (
    adamw,
    analytic_quantized_bytes,
    base_16bit,
    digest,
    in_compute_dtype,
    meta_qlora,
    plain_qlora,
    pretrained_qlora,
    quantize_linears,
    quantized_entries,
    quantized_llama,
    save_16bit,
    train,
    with_adapter,
)

from chunkmem import Booster, ChunkPlugin, NotSupportedError, StepCounters, UnmanageableParameter, plan
from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig
from chunkmem.usage.accounting import Location, MemoryKind

STEPS = 3
BUDGET = 60_000  # below the model's chunks: the base's chunks are evicted and gathered again every step
ON_DISK = StaticPlacementConfig(
    offload_optim_frac=1.0, offload_param_frac=1.0, offload_disk_frac=1.0, offload_param_disk_frac=1.0
)
PLACEMENTS = {
    "resident": lambda: StaticPlacementConfig(),
    "auto-budget": lambda: AutoPlacementConfig(device_budget=BUDGET),
    "base-on-disk": lambda: ON_DISK,
}
SLOW = pytest.mark.slow


def adamw_over(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _boost(model: Any, placement: str, disk_dir: Path | None, weights: Path | None = None) -> tuple[Any, Any, Any]:
    plugin = ChunkPlugin(
        placement=PLACEMENTS[placement](), precision="bf16", disk_dir=disk_dir if placement == "base-on-disk" else None
    )
    booster = Booster(plugin)
    chunked, optimizer, *_ = booster.boost(model, adamw(model), weights=weights)
    return chunked, optimizer, booster


def _quantized_report(chunked: Any) -> dict[str, Any]:
    """What the ledger and the chunks say of the quantized base on this rank."""
    manager = chunked.manager
    ledger = manager.ledger
    chunks = [c for c in manager.chunks if c.layout.quantized]
    return {
        "stored": sum(info.numel * c.layout.compute_dtype.itemsize for c in chunks for info in c.layout.tensors),
        "capacity": sum(c.layout.capacity * c.layout.compute_dtype.itemsize for c in chunks),
        "shards": sum(c.layout.shard_numel * c.layout.compute_dtype.itemsize for c in chunks),
        "ledger": {where.value: ledger.bytes(where, MemoryKind.QUANTIZED) for where in Location},
        "dtypes": sorted({str(c.layout.compute_dtype) for c in chunks}),
        "trainable_quantized": any(c.layout.trainable for c in chunks),
        "peak_device": chunked.stats().peak_device_bytes,
        "evictions": chunked.stats().evictions,
        "quantized_bytes": chunked.stats().quantized_bytes,
    }


def _assert_budgets(report: dict[str, Any], placement: str, analytic: int, world_size: int) -> None:
    assert report["dtypes"] == ["torch.float32", "torch.uint8"], report  # packed bytes, fp32 scales: as stored
    assert not report["trainable_quantized"]
    # The chunks hold exactly what the layers' shapes say a 4-bit base stores (the rest is padding:
    # in a model this small, a third), and this rank keeps its shard of them, nothing more.
    assert report["stored"] == analytic, report
    assert report["shards"] * world_size == report["capacity"] < 1.5 * analytic, report
    assert sum(report["ledger"].values()) == report["shards"] == report["quantized_bytes"], report
    if placement == "base-on-disk":  # nothing of the base in memory between uses
        assert report["ledger"]["disk"] == report["shards"] and report["ledger"]["host"] == 0, report
    if placement == "auto-budget":
        assert report["peak_device"] <= BUDGET and report["evictions"] > 0, report


@SLOW  # each about 3 s alone (bitsandbytes' CPU kernels, and plain PEFT QLoRA beside)
@pytest.mark.parametrize("placement", ["base-on-disk", "auto-budget"])
def test_qlora_trains_like_plain_peft_qlora_bit_for_bit(placement: str, tmp_path: Path) -> None:
    data = batches(STEPS)
    model = quantized_llama()
    base_before = digest(quantized_entries(model.state_dict()))
    analytic = analytic_quantized_bytes(model)
    chunked, optimizer, booster = _boost(model, placement, tmp_path)
    losses = train(chunked, optimizer, booster, data)
    expected, reference, masters = plain_qlora(quantized_llama, data)
    assert losses == [step[0] for step in expected]
    state = chunked.state_dict()
    for name, master in masters.items():
        assert torch.equal(state[name], master), name
    # The base: the bytes plain bitsandbytes holds, unchanged by training (state_dict gathers them).
    assert digest(quantized_entries(state)) == base_before == digest(quantized_entries(reference.state_dict()))
    _assert_budgets(_quantized_report(chunked), placement, analytic, 1)


def _adapter_outputs(directory: Path) -> torch.Tensor:
    """The logits of plain PEFT loading the adapter in ``directory`` onto a plain QLoRA base. In
    training mode (the model has no dropout): on an AVX-512 BF16 CPU plain bitsandbytes' eval forward
    repacks each weight for its inference kernel, which fails on this model's MLP (out_features not
    a multiple of 32)."""
    import peft

    model = peft.PeftModel.from_pretrained(quantize_linears(base_16bit()), directory).train()
    with torch.no_grad():
        return model(input_ids=batches(1, seed=7)[0]).logits


def assert_same_adapter(saved: Path, expected: Path) -> None:
    """The files plain PEFT writes, with the same tensors; loaded by plain PEFT over a plain
    bitsandbytes base, they give the same outputs."""
    (meta, tensors), (expected_meta, expected_tensors) = adapter_files(saved), adapter_files(expected)
    assert meta == expected_meta
    assert tensors.keys() == expected_tensors.keys()
    for name, value in expected_tensors.items():
        assert torch.equal(tensors[name], value), name
    assert torch.equal(_adapter_outputs(saved), _adapter_outputs(expected))


def _two_ranks(rank: int, world_size: int, out: str) -> dict[str, Any]:
    """Both ways in at two ranks: a base loaded quantized, on disk; a base quantized at boost from
    its 16-bit checkpoint (each rank quantizing its pieces), evicted under a budget."""
    data = batches(STEPS)
    results: dict[str, Any] = {}
    for way, build, placement, weights in (
        ("loaded", quantized_llama, "base-on-disk", None),
        ("at boost", lambda: meta_qlora(Path(out) / "base"), "auto-budget", Path(out) / "base"),
    ):
        chunked, optimizer, booster = _boost(build(), placement, Path(out), weights)
        losses = train(chunked, optimizer, booster, data, rank, world_size)
        state = chunked.state_dict()
        results[way] = {
            "losses": losses,
            "adapter": {k: v for k, v in state.items() if "lora_" in k},
            "base": digest(quantized_entries(state)),
            "report": _quantized_report(chunked),
        }
        if way == "loaded":
            chunked.save_pretrained(Path(out) / "adapter")  # every rank calls; rank 0 writes
    return results


@SLOW
@pytest.mark.multirank
def test_qlora_at_two_ranks_equals_plain_peft_qlora_both_ways_in(tmp_path: Path) -> None:
    directory = save_16bit(tmp_path / "base")
    results = run_ranks(_two_ranks, 2, args=(str(tmp_path),))
    data = batches(STEPS)
    builds = {"loaded": quantized_llama, "at boost": lambda: pretrained_qlora(directory, draw_b=False)}
    references = {way: plain_qlora(build, data, world_size=2) for way, build in builds.items()}
    analytic = analytic_quantized_bytes(quantized_llama())
    for way, (expected, reference, masters) in references.items():
        # The bytes as built, not plain's state after training: on an AVX-512 BF16 CPU plain
        # bitsandbytes repacks the weights its eval forwards ran, their scales in bf16.
        base = digest(quantized_entries(builds[way]().state_dict()))
        for rank, result in enumerate(results):
            run = result[way]
            assert run["losses"] == [step[rank] for step in expected], (way, rank)
            for name, master in masters.items():
                assert torch.equal(run["adapter"][name], master), (way, rank, name)
            assert run["base"] == base, (way, rank)  # the bytes bitsandbytes quantized, unchanged
            _assert_budgets(run["report"], "base-on-disk" if way == "loaded" else "auto-budget", analytic, 2)
        if way == "loaded":  # plain PEFT saves its fp32 masters
            with torch.no_grad():
                for name, p in reference.named_parameters():
                    if name in masters:
                        p.data = masters[name].detach()
            reference.save_pretrained(tmp_path / "plain")
            assert_same_adapter(tmp_path / "adapter", tmp_path / "plain")


@SLOW
def test_a_base_quantized_at_boost_is_what_from_pretrained_quantizes(tmp_path: Path) -> None:
    """With transformers' default compute dtype (fp32, over a bf16 base): the packed bytes, scales and
    code books a boost quantizes from the 16-bit checkpoint, and the adapter's init PEFT casts to the
    layers' compute dtype, are what from_pretrained with the same BitsAndBytesConfig gives; training
    on equals plain PEFT over it."""
    directory = save_16bit(tmp_path / "base")
    data = batches(2)
    chunked, optimizer, booster = _boost(meta_qlora(directory, compute_dtype=None), "resident", None, directory)
    state = chunked.state_dict()
    plain = pretrained_qlora(directory, draw_b=False, compute_dtype=None).state_dict()
    assert state.keys() == plain.keys()
    for name, value in plain.items():
        expected = value.to(torch.float32) if "lora_" in name else value  # the adapter as fp32 masters
        assert torch.equal(state[name], expected), name
    losses = train(chunked, optimizer, booster, data)
    expected_losses, _, masters = plain_qlora(
        lambda: pretrained_qlora(directory, draw_b=False, compute_dtype=None), data
    )
    assert losses == [step[0] for step in expected_losses]
    trained = chunked.state_dict()
    for name, master in masters.items():
        assert torch.equal(trained[name], master), name


class _GPTQLinear(torch.nn.Module):
    """Stands in for a GPTQ layer (auto-gptq's QuantLinear: int32 packed buffers)."""

    __module__ = "auto_gptq.nn_modules.qlinear.qlinear_exllama"

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("qweight", torch.zeros(8, 64, dtype=torch.int32))


class _NF4Tensor(torch.Tensor):
    """Stands in for torchao's NF4Tensor (a tensor subclass holding packed values)."""

    __module__ = "torchao.dtypes.nf4tensor"


def _trainable_4bit(model: Any) -> Any:
    model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.requires_grad_(True)
    return model


def _double_quant_at_boost(model: Any) -> Any:
    model.base_model.model.model.layers[0].mlp.up_proj.weight.compress_statistics = True
    return model


def _packed_for_cpu(model: Any) -> Any:
    model.base_model.model.model.layers[0].mlp.up_proj.weight.quant_state.packing_format_for_cpu = True
    return model


def _with_layer(model: Any, layer: torch.nn.Module) -> Any:
    model.base_model.model.model.layers[0].mlp.quantized_extra = layer
    return model


def _with_param(model: Any) -> Any:
    norm = model.base_model.model.model.norm
    norm.weight = torch.nn.Parameter(norm.weight.detach().as_subclass(_NF4Tensor), requires_grad=False)
    return model


def _with_config(model: Any) -> Any:
    model.config.quantization_config = {"quant_method": "awq", "bits": 4}
    return model


def _int8(model: Any) -> Any:
    import bitsandbytes as bnb

    return _with_layer(model, bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False))


REFUSED = {
    "8-bit bitsandbytes": (_int8, NotSupportedError, r"8-bit \(LLM\.int8.*BitsAndBytesConfig\(load_in_4bit=True"),
    "a trainable 4-bit weight": (
        lambda d: _trainable_4bit(meta_qlora(d)),
        UnmanageableParameter,
        r"q_proj\.base_layer\.weight' requires grad: a quantized weight cannot train.*get_peft_model",
    ),
    "double quantization at boost": (
        lambda d: _double_quant_at_boost(meta_qlora(d)),
        NotSupportedError,
        r"up_proj\.weight' is to be quantized at boost with double quantization.*bnb_4bit_use_double_quant=False",
    ),
    "another quant storage": (
        lambda d: with_adapter(quantize_linears(base_16bit(), quant_storage=torch.bfloat16)),
        NotSupportedError,
        r"packs its 4-bit values in torch\.bfloat16.*bnb_4bit_quant_storage=torch\.uint8",
    ),
    "weights packed for CPU inference": (
        lambda d: _packed_for_cpu(quantized_llama()),
        NotSupportedError,
        r"repacked by bitsandbytes for its CPU inference kernel.*before running it",
    ),
    "a GPTQ layer": (
        lambda d: _with_layer(quantized_llama(), _GPTQLinear()),
        NotSupportedError,
        r"quantized_extra' \(_GPTQLinear\) is quantized with GPTQ \(auto-gptq\).*BitsAndBytesConfig",
    ),
    "a torchao tensor": (
        lambda d: _with_param(quantized_llama()),
        UnmanageableParameter,
        r"norm\.weight' is a _NF4Tensor quantized with torchao.*BitsAndBytesConfig",
    ),
    "another quantizer's config": (
        lambda d: _with_config(with_adapter(base_16bit())),
        NotSupportedError,
        r"loaded with quantization_config quant_method='awq'.*BitsAndBytesConfig",
    ),
}


def _layers_as_given(model: torch.nn.Module) -> list[tuple[str, str, bool]]:
    return [
        (name, type(module.weight).__name__, "forward" in vars(module))
        for name, module in model.named_modules()
        if isinstance(getattr(module, "weight", None), torch.Tensor)
    ]


@SLOW
def test_an_eval_forward_equals_plain_bitsandbytes_whichever_kernel_this_cpu_gives_it() -> None:
    """An eval forward without gradients (a reference model's, an evaluation's), evicted under a
    budget: the logits of plain bitsandbytes' eval forward, bit for bit. On a CPU with AVX-512 BF16
    bitsandbytes computes those with its inference kernel from weights it repacks (this machine's
    kind: an AMD EPYC with avx512_bf16, 2026-12-02), elsewhere with its dequantizing kernel; the
    boosted model's stored bytes stay as loaded either way. Every layer's out_features a multiple of
    32, which bitsandbytes' repacking needs."""
    from support.models import llama

    def build() -> Any:
        base = quantize_linears(llama(intermediate_size=128).to(torch.bfloat16))
        return with_adapter(base).eval()

    model, plain = build(), in_compute_dtype(build())
    chunked, _, _ = _boost(model, "auto-budget", None)
    before = digest(quantized_entries(chunked.state_dict()))
    ids = batches(2, seed=5)
    with torch.no_grad():
        for batch in ids:
            assert torch.equal(chunked(input_ids=batch).logits, plain(input_ids=batch).logits)
    assert digest(quantized_entries(chunked.state_dict())) == before
    assert chunked.stats().evictions > 0  # the base's chunks were gathered again for the second forward


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_cannot_be_kept_is_refused_naming_the_format_and_the_fix(case: str, tmp_path: Path) -> None:
    build, error, message = REFUSED[case]
    directory = save_16bit(tmp_path / "base") if "boost" in case or "trainable" in case else tmp_path
    model = build(directory) if case != "8-bit bitsandbytes" else build(quantized_llama())
    before = _layers_as_given(model)
    with pytest.raises(error, match=message):
        _boost(model, "resident", None, directory if "boost" in case or "trainable" in case else None)
    assert _layers_as_given(model) == before  # nothing was changed


@SLOW
def test_an_optimizer_over_every_parameter_holds_4bit_weights_only_where_they_stay_themselves(tmp_path: Path) -> None:
    """``AdamW(model.parameters())``: a base loaded quantized keeps its 4-bit weights (frozen, the
    optimizer skips them) and trains as with the adapter's parameters alone; weights quantized at boost
    are replaced by their packed bytes, so such an optimizer is refused, saying what to pass."""
    data = batches(1)
    losses = []
    for every in (True, False):
        model = quantized_llama()
        params = model.parameters() if every else [p for p in model.parameters() if p.requires_grad]
        booster = Booster(ChunkPlugin(precision="bf16"))
        chunked, optimizer, *_ = booster.boost(model, adamw_over(list(params)))
        losses.append(train(chunked, optimizer, booster, data * 2))
    assert losses[0] == losses[1]
    model = meta_qlora(save_16bit(tmp_path / "base"))
    with pytest.raises(UnmanageableParameter, match=r"holds the 4-bit weight .*quantized at boost.*requires_grad"):
        Booster(ChunkPlugin(precision="bf16")).boost(model, torch.optim.AdamW(model.parameters()))


def test_no_module_but_the_compat_one_names_bitsandbytes() -> None:
    """bitsandbytes' names (its package, classes and kernels) appear in code only in
    ``chunkmem/quantized/bnb4.py``: elsewhere at most in text (docstrings, messages)."""
    names = {
        "bitsandbytes", "bnb", "Params4bit", "Linear4bit", "Int8Params", "Linear8bitLt", "QuantState",
        "matmul_4bit", "quantize_4bit", "dequantize_4bit", "get_4bit_type", "gemm_4bit",
    }  # fmt: skip
    root = ROOT / "chunkmem"
    found = {}
    for path in root.rglob("*.py"):
        text = path.read_text()
        if not any(name in text for name in names):  # most modules: nothing to parse
            continue
        tree = ast.parse(text)
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        used |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                used |= {m.split(".")[0] for m in modules}
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "get":  # sys.modules.get("...")
                used |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
        if used & names:
            found[str(path.relative_to(root))] = sorted(used & names)
    assert found == {"quantized/bnb4.py": sorted(found.get("quantized/bnb4.py", ["bitsandbytes"]))}, found
    assert "bitsandbytes" in found["quantized/bnb4.py"]


@SLOW
def test_a_double_quantized_base_from_pretrained_trains_like_plain_peft_and_copies_to_plain_bitsandbytes(
    tmp_path: Path,
) -> None:
    """``from_pretrained`` with double quantization (8-bit scales with fp32 scales of their own):
    both scale tensors in chunks, the code books beside them; bit for bit as plain PEFT; a plain copy
    is a bitsandbytes model again (Params4bit weights holding their state) with the same outputs."""
    directory = save_16bit(tmp_path / "base")
    data = batches(2)
    model = pretrained_qlora(directory, double_quant=True)
    chunked, optimizer, booster = _boost(model, "auto-budget", None)
    report = _quantized_report(chunked)
    assert report["dtypes"] == ["torch.float32", "torch.uint8"] and report["peak_device"] <= BUDGET, report
    names = {info.name for c in chunked.manager.chunks if c.layout.quantized for info in c.layout.tensors}
    assert "base_model.model.model.layers.0.mlp.up_proj.weight.nested_absmax" in names
    losses = train(chunked, optimizer, booster, data)
    expected, _, masters = plain_qlora(lambda: pretrained_qlora(directory, double_quant=True), data)
    assert losses == [step[0] for step in expected]
    state = chunked.state_dict()
    for name, master in masters.items():
        assert torch.equal(state[name], master), name
    # Against the bytes as loaded, not plain's state after training: on an AVX-512 BF16 CPU plain
    # bitsandbytes repacks the weights its eval forwards ran (the first layer's, whose input needs no
    # gradient) and its state dict re-quantizes their doubly quantized scales, best effort.
    loaded = pretrained_qlora(directory, double_quant=True).state_dict()
    assert digest(quantized_entries(state)) == digest(quantized_entries(loaded))
    plain = chunked.plain_copy()
    layer = plain.base_model.model.model.layers[0].mlp.up_proj
    assert type(layer.weight).__name__ == "Params4bit" and layer.weight.quant_state.nested
    assert "forward" not in vars(layer)  # bitsandbytes' own forward
    assert digest(quantized_entries(plain.state_dict())) == digest(quantized_entries(state))
    # The copy holds the adapter's fp32 masters and its buffers as loaded: in chunkmem's compute dtype,
    # its arithmetic is the boosted model's.
    in_compute_dtype(plain)
    with torch.no_grad():
        ids = batches(1, seed=7)[0]
        # Both in training mode (no dropout): on an AVX-512 BF16 CPU plain bitsandbytes' eval forward
        # repacks each weight, which fails on this model's MLP (out_features not a multiple of 32).
        plain.train()
        chunked.train()
        assert torch.equal(plain(input_ids=ids).logits, chunked(input_ids=ids).logits)


def _killed_job(rank: int, world_size: int, out: str) -> None:
    """Step 0 with the base on disk, a sharded checkpoint, then step 1, killed in its backward."""
    from support.killed_resume_helpers import _checkpoint_digest, _KillInBackward

    chunked, optimizer, booster = _boost(quantized_llama(), "base-on-disk", Path(out) / "scratch")
    data = batches(STEPS)
    train(chunked, optimizer, booster, data[:1])
    booster.save_model(chunked, Path(out) / "model", shard=True)
    booster.save_optimizer(optimizer, Path(out) / "optim", shard=True)
    digest = {part: _checkpoint_digest(Path(out) / part) for part in ("model", "optim")}
    (Path(out) / "digest.json").write_text(json.dumps(digest))
    layer = chunked.module.base_model.model.model.layers[0].self_attn.q_proj  # the first 4-bit layer
    layer.register_forward_hook(lambda module, args, output: _KillInBackward.apply(output, Path(out)))
    train(chunked, optimizer, booster, data[1:2])
    raise AssertionError("the job was not killed in its backward")


@SLOW
def test_a_job_killed_mid_step_resumes_from_its_checkpoint_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """Killed (SIGKILL) in a backward, the base's chunks on disk: a new job (another seed, so every
    value, the base's bytes included, comes from the checkpoint) loads the checkpoint saved before
    and trains on exactly as the uninterrupted run; the killed job's scratch goes at the next boost."""
    from support.distributed import RankFailure
    from support.killed_resume_helpers import _checkpoint_digest, _scratch

    (tmp_path / "scratch").mkdir()
    with pytest.raises(RankFailure, match=r"exit code -9"):
        run_ranks(_killed_job, 1, args=(str(tmp_path),), fresh=True, pg_timeout=30, timeout=180)
    assert (tmp_path / "killed").read_text() == "backward"
    dead = _scratch(tmp_path / "scratch")
    assert len(dead) == 1 and any(f.stat().st_size > 0 for f in dead[0].iterdir()), dead
    saved = json.loads((tmp_path / "digest.json").read_text())
    assert {part: _checkpoint_digest(tmp_path / part) for part in ("model", "optim")} == saved
    data = batches(STEPS)
    resumed, optimizer, booster = _boost(quantized_llama(seed=3), "base-on-disk", tmp_path / "scratch")
    assert not any(path.exists() for path in dead)  # the next boost into the disk_dir removed it
    booster.load_model(resumed, tmp_path / "model")
    booster.load_optimizer(optimizer, tmp_path / "optim")
    losses = train(resumed, optimizer, booster, data[1:])
    chunked, uninterrupted, plain_booster = _boost(quantized_llama(), "base-on-disk", tmp_path / "scratch")
    assert losses == train(chunked, uninterrupted, plain_booster, data)[1:]
    state, expected = resumed.state_dict(), chunked.state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(state[name], value), name
    for index, entry in uninterrupted.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(optimizer.state_dict()["state"][index][key], value), (index, key)


@SLOW
@pytest.mark.cpu_compute(reason="a plan for the CPU against a run on the CPU")
def test_a_plan_of_a_qlora_model_counts_its_quantized_bytes_as_a_run_does(tmp_path: Path) -> None:
    """``chunkmem.plan`` over the QLoRA model on the meta device (4-bit layers not quantized yet)
    predicts a run of it, step for step: gathers, the base's bytes read from disk, peaks, and what
    stays on disk and in host memory."""
    directory = save_16bit(tmp_path / "base")
    ids = torch.zeros(4, 16, dtype=torch.long)
    predicted = plan(
        meta_qlora(directory),
        ChunkPlugin(placement=ON_DISK, precision="bf16"),
        {"input_ids": ids, "labels": ids},
        optimizer=lambda params: adamw_over([p for p in params if p.requires_grad]),
        steps=3,
        device="cpu",
    )
    # The run over the base loaded quantized: boosted from weights=, its 16-bit chunks would be read in
    # place from the checkpoint, which a plan (of shapes only) does not know of.
    chunked, optimizer, booster = _boost(quantized_llama(), "base-on-disk", tmp_path)
    ledger = chunked.manager.ledger
    measured = []
    for ids in batches(3):
        before = chunked.stats()
        ledger.reset_peak()
        train(chunked, optimizer, booster, [ids])
        measured.append(StepCounters.between(before, chunked.stats(), ledger.peak_device_bytes, ledger.peak_host_bytes))
    forward = "disk_param_forward_read_bytes"  # a plan's own split of the reads (a run's counters have none)
    for planned, ran in zip(predicted.steps, measured, strict=True):
        assert 0 < vars(planned)[forward] < planned.disk_param_read_bytes
        assert {**vars(planned), forward: 0} == vars(ran)
    assert predicted.disk_bytes_per_rank == ledger.disk_bytes > _quantized_report(chunked)["ledger"]["disk"] > 0
    assert predicted.host_bytes_per_rank == ledger.host_bytes
    assert measured[-1].disk_param_read_bytes > 0  # the base is read from disk every step


@pytest.mark.parametrize("numel", [64 * 37, 64 * 37 + 10, 64 * 37 + 1])
def test_a_weight_quantized_piece_by_piece_is_bitsandbytes_whole_weight(numel: int) -> None:
    """Runs of whole blocks quantized apart (and scales computed alone) make up exactly what
    bitsandbytes gives quantizing the whole weight, a short last block and an all-zero block
    included: the packed bytes of each piece as a boost asks for them, and the scales."""
    import bitsandbytes as bnb

    from chunkmem.chunks.chunk_layout import ShardPiece
    from chunkmem.chunks.tensor_state import TensorInfo
    from chunkmem.quantized.bnb4 import Format4bit, quantize, scales

    weight = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    weight[64:128] = 0
    packed, state = bnb.functional.quantize_4bit(weight.view(-1, 1), blocksize=64, quant_type="nf4")
    fmt = Format4bit((numel, 1), torch.bfloat16, 64, "nf4", False)
    assert torch.equal(scales(weight, fmt), state.absmax)
    assert torch.equal(quantize(weight, fmt)[1], state.absmax)
    from chunkmem.quantized import QuantizedLinear, QuantizingValues

    class Source:  # the 16-bit weight, as a values source gives its pieces
        def read(self, info: TensorInfo, piece: ShardPiece) -> torch.Tensor:
            return weight[piece.param]

    packed_param = torch.nn.Parameter(torch.empty(fmt.packed_numel, dtype=torch.uint8), requires_grad=False)
    scales_param = torch.nn.Parameter(torch.empty(fmt.blocks), requires_grad=False)
    layer = QuantizedLinear(
        "w", "w", torch.nn.Module(), fmt, packed_param, ("absmax",), (scales_param,), True, None, None
    )
    layer.source = torch.nn.Parameter(weight, requires_grad=False)
    values = QuantizingValues(Source(), [layer])  # type: ignore[arg-type]

    def read(param: torch.nn.Parameter, cuts: list[int]) -> torch.Tensor:
        info = TensorInfo("w", param, 0, 0, 0, param.numel(), param.shape, False)
        return torch.cat(
            [values.read(info, ShardPiece(slice(a, b), slice(0, b - a))) for a, b in itertools.pairwise(cuts)]
        )

    assert torch.equal(read(packed_param, [0, 13, 64 * 5 // 2 + 7, fmt.packed_numel]), packed.reshape(-1))
    assert torch.equal(read(scales_param, [0, 3, 20, fmt.blocks]), state.absmax)


@SLOW
def test_a_base_quantized_at_boost_from_its_initialisation_is_the_cpu_construction_quantized(tmp_path: Path) -> None:
    """Without ``weights=``, the 4-bit layers' 16-bit weights come from the model's initialisation
    replayed piece by piece (what a benchmark of a base larger than memory uses): every entry of
    the state (packed bytes, scales, code books, the adapter's init) is that of the same model built
    on the CPU from the same seed and quantized by bitsandbytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = save_16bit(tmp_path / "base")  # for its config only
    chunked, *_ = _boost(meta_qlora(directory), "resident", None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.bfloat16)
    model.is_loaded_in_4bit = True
    expected = with_adapter(quantize_linears(model), draw_b=False).state_dict()
    state = chunked.state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(state[name], value.to(state[name].dtype)), name


def test_compiled_blocks_and_frozen_models_beside_a_4bit_base_are_refused_leaving_it_as_given() -> None:
    """Combinations no test has trained yet are refused before anything is chunked or compiled."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from chunkmem import CompileBlocks

    model = quantized_llama()
    before = _layers_as_given(model)
    with pytest.raises(NotSupportedError, match=r"compile=CompileBlocks\(\.\.\.\) with a 4-bit .*compile=None"):
        Booster(ChunkPlugin(precision="bf16", compile=CompileBlocks())).boost(model, adamw(model))
    assert _layers_as_given(model) == before
    reference = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    with pytest.raises(NotSupportedError, match=r"frozen models beside a model with a 4-bit .*adapter off"):
        Booster(ChunkPlugin(precision="bf16")).boost(model, adamw(model), frozen=reference)
    assert _layers_as_given(model) == before
    assert all(p.requires_grad for p in reference.parameters())  # the reference is given back as it was
