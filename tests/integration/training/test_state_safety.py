"""Nothing lost, nothing silent: refused loads change nothing, the training loop a PyTorch user
writes either works as in plain PyTorch or raises saying what to do, and a boosted Hugging Face
model round-trips (generate, save_pretrained, a plain copy for evaluation). Each refusal checks
that the state is bit-identical afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch
from support.distributed import run_ranks
from support.models import (
    adamw_two_groups,
    as_reference,
    assert_close_on_cpu,
    assert_state_close,
    batches,
    boost,
    copies,
    gpt2,
    llama,
    lm_loss,
    reference_device,
    tolerance,
    train_chunked,
)
from support.state_helpers import assert_identical, raw_state
from transformers import GPT2LMHeadModel

from chunkmem import (
    Booster,
    ChunkPlugin,
    LossScaleConfig,
    NotSupportedError,
    ShardedGradientError,
    StateDictMismatchError,
    UnscaledBackwardError,
)
from chunkmem.placement import StaticPlacementConfig, load_placement_config

OFFLOADED = StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0)


# --- the training loop ------------------------------------------------------------------------
def test_fp16_plain_backward_is_refused_at_step() -> None:
    chunked, optimizer, booster = boost(gpt2(n_layer=1), adamw_two_groups, precision="fp16", chunk_size=8_000)
    ids = batches(1)[0]
    lm_loss(chunked, ids).backward()  # no loss scaling
    before = raw_state(chunked, optimizer)
    with pytest.raises(UnscaledBackwardError, match=r"booster\.backward\(loss, optimizer\)"):
        optimizer.step()
    with pytest.raises(UnscaledBackwardError):
        optimizer.clip_grad_norm(1.0)
    assert_identical(raw_state(chunked, optimizer), before)
    optimizer.zero_grad()
    booster.backward(lm_loss(chunked, ids), optimizer)
    optimizer.step()
    assert chunked.stats().optimizer_steps == 1


def test_clip_grad_norm_on_parameters_raises_naming_the_supported_call() -> None:
    model, ref = copies(llama(n_layer=1))
    for m in (model, ref):
        m.model.layers[0].mlp.requires_grad_(False)
    chunked, optimizer, booster = boost(model, adamw_two_groups, precision="fp32", chunk_size=8_000)
    reference_optimizer = adamw_two_groups(ref)
    first, second = batches(2, batch=2)
    # Two backward passes accumulate before one step, in both.
    for ids in (first, second):
        lm_loss(ref, ids).backward()
        booster.backward(lm_loss(chunked, ids), optimizer)
    # p.grad is set exactly where plain PyTorch has a gradient.
    assert {n for n, p in chunked.module.named_parameters() if p.grad is not None} == {
        n for n, p in ref.named_parameters() if p.grad is not None
    }
    before = raw_state(chunked, optimizer)
    with pytest.raises(ShardedGradientError, match=r"optimizer\.clip_grad_norm\(max_norm"):
        torch.nn.utils.clip_grad_norm_(chunked.parameters(), 1.0)
    with pytest.raises(ShardedGradientError):
        torch.nn.utils.clip_grad_norm_(chunked.parameters(), 1.0, foreach=True)
    assert_identical(raw_state(chunked, optimizer), before)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    norm = optimizer.clip_grad_norm(0.05)
    assert norm.item() > 0.05
    reference_optimizer.step()
    optimizer.step()
    reference_optimizer.zero_grad()
    optimizer.zero_grad()
    assert all(p.grad is None for p in chunked.parameters())
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=1e-4, atol=1e-5))


def test_model_moves_and_casts_are_refused_with_what_to_do() -> None:
    chunked, optimizer, booster = boost(gpt2(n_layer=1), adamw_two_groups, precision="fp32", chunk_size=8_000)
    train_chunked(chunked, optimizer, booster, batches(1))
    here = chunked.compute_device
    assert chunked.to(here) is chunked and chunked.to(here.type) is chunked  # already there: nothing to do
    # The move to where it computes is accepted, the move away refused (below), on either device.
    stay, leave = (chunked.cpu, chunked.cuda) if here.type == "cpu" else (chunked.cuda, chunked.cpu)
    assert stay() is chunked and chunked.float() is chunked and chunked.to(torch.float32) is chunked
    before = raw_state(chunked, optimizer)
    calls = {
        "half": lambda: chunked.half(),
        "to(float16)": lambda: chunked.to(torch.float16),
        "double": lambda: chunked.double(),
        "bfloat16": lambda: chunked.bfloat16(),
        f"{leave.__name__} (away from {here.type})": leave,
        "to(meta)": lambda: chunked.to("meta"),
        "type": lambda: chunked.type(torch.float64),
    }
    for name, call in calls.items():
        with pytest.raises(NotSupportedError, match=r"ChunkPlugin\(precision=\.\.\.\).*model\.plain_copy") as error:
            call()
        assert "boosted model refused" in str(error.value), name
    with pytest.raises(NotSupportedError, match=r"hold placeholders.*model\.state_dict\(\)"):
        chunked.module.state_dict()  # used to return NaN placeholders silently
    assert_identical(raw_state(chunked, optimizer), before)
    train_chunked(chunked, optimizer, booster, batches(1, seed=4))


def test_model_zero_grad_drops_the_chunk_gradients() -> None:
    model, ref = copies(gpt2(n_layer=1))
    reference_optimizer = adamw_two_groups(ref)
    chunked, optimizer, booster = boost(model, adamw_two_groups, precision="fp32", chunk_size=8_000)
    for ids in batches(3):
        lm_loss(ref, ids).backward()
        reference_optimizer.step()
        ref.zero_grad()
        booster.backward(lm_loss(chunked, ids), optimizer)
        optimizer.step()
        chunked.zero_grad()  # not the optimizer's: used to leave gradients accumulating
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=1e-4, atol=1e-5))


def test_default_precision_follows_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ChunkPlugin(precision="bf16").precision == "bf16"
    # Each kind of machine substituted, so the test means the same on any machine it runs on.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ChunkPlugin().precision == "fp32"  # a CPU computes: 16-bit matmuls are emulated there
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert ChunkPlugin().precision == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert ChunkPlugin().precision == "fp32"


def test_loss_scale_accepts_a_validated_mapping() -> None:
    plugin = ChunkPlugin(precision="fp16", loss_scale={"initial_scale": 1024, "growth_interval": 5})
    assert plugin.loss_scale == LossScaleConfig(initial_scale=1024, growth_interval=5)
    model = gpt2(n_layer=1)
    _, optimizer, *_ = Booster(plugin=plugin).boost(model, adamw_two_groups(model))
    assert optimizer is not None and optimizer.loss_scale == 1024
    with pytest.raises(pydantic.ValidationError) as error:
        ChunkPlugin(precision="fp16", loss_scale={"growth_factor": 0.5})
    assert error.value.errors()[0]["loc"] == ("growth_factor",)
    with pytest.raises(pydantic.ValidationError, match="scale_window"):
        ChunkPlugin(precision="fp16", loss_scale={"scale_window": 10})
    with pytest.raises(TypeError, match="loss_scale must be a LossScaleConfig or a mapping"):
        ChunkPlugin(precision="fp16", loss_scale=[1024])  # type: ignore[arg-type]


def test_chunk_size_beyond_the_model_is_refused_before_allocating() -> None:
    with pytest.raises(ValueError, match="above the limit"):
        ChunkPlugin(chunk_size=2**31)
    model = gpt2(n_layer=1)
    total = sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match=rf"more than 4x the whole model \({total} parameter elements\)"):
        Booster(plugin=ChunkPlugin(precision="fp32", chunk_size=10**9)).boost(model, adamw_two_groups(model))
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # untouched
    Booster(plugin=ChunkPlugin(precision="fp32", chunk_size=2 * total)).boost(model)  # one roomy chunk is fine


def test_placement_config_errors_name_the_policy_key_and_the_budget(tmp_path: Path) -> None:
    with pytest.raises(pydantic.ValidationError) as error:
        load_placement_config({"device_budget": "3GiB"})
    assert error.value.errors()[0]["loc"] == ("policy",)
    assert "no 'policy' key" in str(error.value) and "policy: static" in str(error.value)
    path = tmp_path / "placement.yaml"
    path.write_text("device_budget: 3GiB\n")
    with pytest.raises(pydantic.ValidationError, match=r"placement\.yaml has no 'policy' key"):
        load_placement_config(path)
    for budget in (-1, "-2GiB", "lots"):
        with pytest.raises(pydantic.ValidationError, match="must be a number of bytes > 0 or a string") as error:
            load_placement_config({"policy": "auto", "device_budget": budget})
        assert "could not parse" not in str(error.value)


# --- transactional loads ----------------------------------------------------------------------
def test_a_refused_model_load_writes_nothing() -> None:
    """A late entry with the wrong shape used to fail after every earlier tensor was written."""
    chunked, optimizer, booster = boost(gpt2(), adamw_two_groups, precision="fp32", chunk_size=12_000)
    train_chunked(chunked, optimizer, booster, batches(2))
    other = gpt2(seed=3).state_dict()
    last = list(other)[-1]
    bad_cases: dict[str, tuple[dict[str, Any], str]] = {
        "late shape": ({**other, last: torch.zeros(7, 7)}, f"size mismatch for {last}"),
        "not a tensor": ({**other, last: [1.0, 2.0]}, f"'{last}' is a list, not a tensor"),
        "missing": ({k: v for k, v in other.items() if k != last}, "Missing key"),
        "unexpected": ({**other, "extra.weight": torch.zeros(1)}, "Unexpected key"),
    }
    before = raw_state(chunked, optimizer)
    for name, (state, message) in bad_cases.items():
        with pytest.raises(StateDictMismatchError, match=message):
            chunked.load_state_dict(state)
        assert_identical(raw_state(chunked, optimizer), before, name)
    chunked.load_state_dict({k: v for k, v in other.items() if k != last}, strict=False)
    assert torch.equal(chunked.state_dict()["transformer.wte.weight"], other["transformer.wte.weight"])


def test_a_refused_buffer_dtype_writes_nothing() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    chunked, optimizer, _ = boost(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), precision="fp32")
    before = raw_state(chunked, optimizer)
    state["0.weight"] = state["0.weight"] + 1
    state["1.num_batches_tracked"] = torch.tensor(1.5)
    with pytest.raises(StateDictMismatchError, match=r"dtype mismatch for 1\.num_batches_tracked"):
        chunked.load_state_dict(state)
    assert_identical(raw_state(chunked, optimizer), before)


def test_a_refused_optimizer_load_writes_nothing() -> None:
    chunked, optimizer, booster = boost(gpt2(n_layer=1), adamw_two_groups, precision="fp32", chunk_size=8_000)
    train_chunked(chunked, optimizer, booster, batches(2))

    def stepped(model: torch.nn.Module, make: Any) -> dict[str, Any]:
        opt = make(model)
        lm_loss(model, batches(1)[0]).backward()
        opt.step()
        return opt.state_dict()

    two_sgd_groups = lambda m: torch.optim.SGD(  # noqa: E731
        [{"params": [p for p in m.parameters() if p.ndim >= 2]}, {"params": [p for p in m.parameters() if p.ndim < 2]}],
        lr=0.1,
        momentum=0.9,
    )
    lacking = stepped(gpt2(n_layer=1), adamw_two_groups)
    del lacking["state"][3]["exp_avg_sq"]
    cases = {
        "same names, other shapes": (stepped(gpt2(n_layer=1, n_embd=32), adamw_two_groups), "has shape"),
        "another optimizer class": (stepped(gpt2(n_layer=1), two_sgd_groups), r"lacks the settings \['amsgrad'"),
        "a state key missing": (lacking, r"has the keys \['exp_avg', 'step'\], but AdamW with these settings keeps"),
        "other param groups": (stepped(gpt2(n_layer=1), lambda m: torch.optim.AdamW(m.parameters())), "sizes"),
        "a model state": (gpt2(n_layer=1).state_dict(), "holds a model state dict"),
    }
    before = raw_state(chunked, optimizer)
    for name, (state, message) in cases.items():
        with pytest.raises(StateDictMismatchError, match=message):
            optimizer.load_state_dict(state)
        assert_identical(raw_state(chunked, optimizer), before, name)
    train_chunked(chunked, optimizer, booster, batches(1, seed=7))  # the next step works


def test_a_refused_scheduler_load_changes_nothing(tmp_path: Path) -> None:
    chunked, optimizer, booster = boost(gpt2(n_layer=1), adamw_two_groups, precision="fp32", chunk_size=8_000)
    step_lr = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    train_chunked(chunked, optimizer, booster, batches(1))
    step_lr.step()
    booster.save_lr_scheduler(step_lr, tmp_path / "sched.pt", optimizer)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)
    before = raw_state(chunked, optimizer, lambda_lr)
    with pytest.raises(StateDictMismatchError, match="saved by another LR scheduler class"):
        booster.load_lr_scheduler(lambda_lr, tmp_path / "sched.pt")
    assert_identical(raw_state(chunked, optimizer, lambda_lr), before)
    fresh = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    booster.load_lr_scheduler(fresh, tmp_path / "sched.pt")
    assert fresh.last_epoch == step_lr.last_epoch


# --- Hugging Face round trip ------------------------------------------------------------------
def _prompt(device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """From a CPU generator (the same tokens on every machine), on ``device`` (default: the CPU;
    the boosted model moves them itself)."""
    ids = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(4)).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_generate_save_pretrained_and_plain_copy(tmp_path: Path) -> None:
    model, ref = copies(llama())
    chunked, *_ = Booster(plugin=ChunkPlugin(precision="fp32", chunk_size=12_000, placement=OFFLOADED)).boost(model)
    resident = chunked.stats().device_bytes
    expected = ref.generate(**_prompt(reference_device()), max_new_tokens=6, do_sample=False)
    assert torch.equal(chunked.generate(**_prompt(), max_new_tokens=6, do_sample=False).cpu(), expected.cpu())
    assert chunked.stats().device_bytes == resident  # every chunk gathered for a decoding step was released

    model, ref = copies(gpt2())
    chunked, optimizer, booster = boost(model, adamw_two_groups, precision="fp32", chunk_size=12_000)
    reference_optimizer = adamw_two_groups(ref)
    for ids in batches(2):
        lm_loss(ref, ids).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    train_chunked(chunked, optimizer, booster, batches(2))
    chunked.save_pretrained(tmp_path / "hf")
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied
    within = tolerance(chunked, rtol=1e-4, atol=1e-5)
    assert_state_close(loaded.state_dict(), ref.state_dict(), *within)
    plain = chunked.plain_copy()
    assert plain is not None and not any(type(p) is not torch.nn.Parameter for p in plain.parameters())
    assert all(p.device.type == "cpu" for p in plain.parameters())  # plain_copy's default device
    assert plain.lm_head.weight is plain.transformer.wte.weight
    assert_state_close(plain.state_dict(), ref.state_dict(), *within)
    plain = as_reference(plain)  # evaluated with the reference's kernels
    assert plain.lm_head.weight is plain.transformer.wte.weight
    plain.eval()
    ref.eval()
    with torch.no_grad():
        prompt = _prompt(reference_device())
        assert_close_on_cpu(plain(**prompt).logits, ref(**prompt).logits, within)
    train_chunked(chunked, optimizer, booster, batches(1, seed=3))  # the boosted model trains on


def _hf_on_two_ranks(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    model, ref = copies(gpt2(seed=2))
    chunked, *_ = Booster(plugin=ChunkPlugin(precision="fp32", chunk_size=6_000)).boost(model)
    out = chunked.generate(**_prompt(), max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = ref.generate(**_prompt(reference_device()), max_new_tokens=6, do_sample=False, pad_token_id=0)
    chunked.save_pretrained(Path(directory) / "hf")
    plain = chunked.plain_copy()
    return {"generate_equal": torch.equal(out.cpu(), expected.cpu()), "has_copy": plain is not None}


@pytest.mark.multirank
def test_generate_and_save_pretrained_on_two_ranks(tmp_path: Path) -> None:
    results = run_ranks(_hf_on_two_ranks, args=(str(tmp_path),))
    assert [r["generate_equal"] for r in results] == [True, True]
    assert [r["has_copy"] for r in results] == [True, False]  # built on rank 0 only
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    for name, value in gpt2(seed=2).state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_a_loss_scale_is_refused_where_no_precision_reads_it() -> None:
    """Loss scaling is fp16's; under bf16 or fp32 nothing would read the setting, so it is refused
    rather than accepted and ignored (fp16 with it, and every precision without it, still build)."""
    for precision in ("bf16", "fp32", None):
        with pytest.raises(ValueError, match=r"loss_scale applies to precision='fp16' only"):
            ChunkPlugin(precision=precision, loss_scale={"initial_scale": 1024})
        ChunkPlugin(precision=precision)
    assert ChunkPlugin(precision="fp16", loss_scale={"initial_scale": 1024}).loss_scale is not None
