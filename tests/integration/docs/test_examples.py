"""Every example in examples/ runs as written, small: ``--help`` prints its help and trains nothing,
and each run trains what it says against its own plain reference (plain PyTorch, plain Trainer,
plain SFTTrainer, plain Lightning), within its budget. Each runs as its ``__main__`` forked from
the tests' fork server (tests/support/forked.py), in a temporary directory."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.child_env import child_env
from support.forked import run_main, run_script
from support.paths import ROOT

EXAMPLES = sorted(path.name for path in (ROOT / "examples").glob("*.py"))
# Where a GPU would otherwise be picked (the examples compute where chunkmem does): these tests check
# the CPU run, whose references are exact.
CPU = {"CUDA_VISIBLE_DEVICES": ""}


def _run(example: str, *argv: str, cwd: Path) -> str:
    done = run_main(str(ROOT / "examples" / example), *argv, cwd=str(cwd), env=child_env(**CPU))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


def _figure(pattern: str, out: str) -> float:
    found = re.search(pattern, out)
    assert found, f"{pattern!r} not in:\n{out}"
    return float(found[1].replace(",", ""))


def test_every_example_is_tested() -> None:
    assert set(EXAMPLES) == {
        "disk_tier.py",
        "hf_trainer.py",
        "lightning_train.py",
        "meta_7b.py",
        "qlora.py",
        "train_loop.py",
        "trl_grpo.py",
        "trl_sft_lora.py",
    }, "a new example needs its test here"


# Every example's ``--help``, one after the other in one process (the trainer libraries they import
# are imported once): each prints its usage and exits 0 before training anything.
_HELP = """
import contextlib, io, json, runpy, sys
answers = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(path, run_name="__main__")
            code = "returned without exiting"
        except SystemExit as exit_:
            code = exit_.code
    answers[path] = [code, out.getvalue()]
print(json.dumps(answers))
"""


@pytest.mark.slow  # the trainer libraries' imports (transformers' Trainer, TRL, Lightning): 5-10 s
def test_help_prints_help_and_trains_nothing(tmp_path: Path) -> None:
    paths = [str(ROOT / "examples" / name) for name in EXAMPLES]
    code = f"import os; os.chdir({str(tmp_path)!r})\n" + _HELP
    done = run_script(code, *paths, children=True)
    assert done.returncode == 0, done.stderr[-5000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    for path in paths:
        exit_code, out = answers[path]
        assert exit_code == 0, (path, exit_code)
        assert out.startswith("usage: ") and "options:" in out, (path, out[:300])
        assert not re.search(r"^step  ", out, re.MULTILINE), f"{path}: --help ran the job"
    assert list(tmp_path.iterdir()) == [], "--help wrote files"


@pytest.mark.slow
def test_train_loop_trains_as_plain_pytorch_within_the_budget(tmp_path: Path) -> None:
    out = _run("train_loop.py", "--json", str(tmp_path / "result.json"), cwd=tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 1 and len(result["losses"]) == 6
    # The same arithmetic as plain PyTorch on the CPU, step for step (fp32).
    for ours, theirs in zip(result["losses"], result["plain_losses"], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-6)
    assert result["weight_difference"] < 1e-6
    assert result["losses"][-1] < result["losses"][0], "the counting pattern is learned"
    assert result["peak_device_bytes"] <= result["budget"] and result["evictions"] > 0
    assert result["reloaded_loss"] == result["trained_loss"], "the checkpoint loads the trained weights"
    assert "peak device bytes" in out and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def _llama_parameters(vocab: int, hidden: int, intermediate: int, layers: int) -> int:
    """LLaMA's parameter count from its shape: embedding and head (untied), per layer q, k, v, o,
    the three MLP matrices and two norms, a final norm."""
    return 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden) + hidden


@pytest.mark.slow  # planning the 7B shape on meta: about 10 s
def test_meta_7b_prints_the_7b_plan_and_trains_the_small_model_as_a_cpu_build(tmp_path: Path) -> None:
    out = _run("meta_7b.py", cwd=tmp_path)
    assert f"({_llama_parameters(32000, 4096, 11008, 32):,})" in out  # 6,738,415,616
    assert re.search(r"^fits +yes$", out, re.MULTILINE), out
    assert _figure(r"device budget +([\d.]+) GiB", out) == 10.0
    assert f"{_llama_parameters(256, 64, 172, 2):,} parameters" in out
    # Boosted from the meta device: its own init replayed, so the losses equal a CPU build's.
    assert _figure(r"largest loss difference: ([\d.e+-]+)", out) == 0.0
    planned = _figure(r"planned peak device bytes ([\d,]+)", out)
    measured = _figure(r"; measured ([\d,]+)", out)
    assert planned == measured <= 256 * 1024


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_disk_tier_keeps_nothing_in_host_memory_and_trains_as_plain_pytorch(lora: bool, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    out = _run("disk_tier.py", "--disk-dir", str(disk), *(["--lora"] if lora else []), cwd=tmp_path)
    assert _figure(r"largest loss difference from plain PyTorch: ([\d.e+-]+)", out) == 0.0
    assert _figure(r"in host memory between steps: ([\d,]+) bytes", out) == 0
    assert _figure(r"on disk: ([\d,]+) bytes", out) > 0
    rows = re.findall(r"^ +\d+ +[\d.]+ +[\d.]+ +(\d+) KiB +(\d+) KiB$", out, re.MULTILINE)
    assert len(rows) == 3 and all(int(read) > 0 and int(written) > 0 for read, written in rows), out
    assert "left after the run: 0" in out and list(disk.iterdir()) == []


@pytest.mark.slow
def test_qlora_trains_as_plain_peft_qlora_with_its_4bit_base_on_disk(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")  # the test extra installs it
    disk = tmp_path / "disk"
    disk.mkdir()
    out = _run("qlora.py", "--disk-dir", str(disk), "--steps", "2", cwd=tmp_path)
    assert _figure(r"largest loss difference from plain PEFT QLoRA: ([\d.e+-]+)", out) == 0.0
    assert _figure(r"in host memory between steps: ([\d,]+) bytes", out) == 0
    # Two layers 128 wide: q and o 128x128, k and v 128x64 (2 key-value heads), three 128x320 MLP
    # matrices; half a byte a weight and a 4-byte scale per 64 (the rest is chunk padding).
    weights = 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 320)
    quantized = _figure(r"quantized base: ([\d,]+) bytes in chunks", out)
    assert weights // 2 + 4 * weights // 64 <= quantized <= _figure(r"on disk in all: ([\d,]+) bytes", out)
    rows = re.findall(r"^ +\d+ +[\d.]+ +[\d.]+ +(\d+) KiB +(\d+) KiB$", out, re.MULTILINE)
    assert len(rows) == 2 and all(int(read) > 0 for read, _ in rows), out
    assert "equal to plain PEFT QLoRA's: True" in out
    assert list(disk.iterdir()) == [], "scratch files left behind"


@pytest.mark.slow
def test_trl_sft_with_lora_trains_as_plain_sft_trainer(tmp_path: Path) -> None:
    out = _run("trl_sft_lora.py", cwd=tmp_path)
    assert _figure(r"largest loss difference from plain SFTTrainer: ([\d.e+-]+)", out) == 0.0
    peak = _figure(r"peak device bytes (\d+)", out)
    assert peak <= _figure(r"<= budget (\d+)", out) and _figure(r"; (\d+) evictions", out) > 0
    assert "tokenizer of" in out


@pytest.mark.slow
def test_trl_grpo_trains_the_policy_beside_its_reference_and_reward_model_as_plain_grpo(tmp_path: Path) -> None:
    out = _run("trl_grpo.py", cwd=tmp_path)
    assert "losses and rewards equal plain GRPOTrainer's: yes" in out
    assert "3 models boosted together" in out
    chunks = _figure(r"reward model\): ([\d,]+) bytes of chunks", out)
    budget = _figure(r"<= budget (\d+)", out)
    assert _figure(r"peak device bytes (\d+)", out) <= budget < chunks
    assert _figure(r"; (\d+) evictions", out) > 0


@pytest.mark.slow
def test_hf_trainer_example_logs_plain_trainers_losses(tmp_path: Path) -> None:
    out = _run("hf_trainer.py", "--steps", "4", cwd=tmp_path)
    rows = re.findall(r"^ +(\d+) +([\d.]+) +([\d.]+)$", out, re.MULTILINE)
    assert [int(step) for step, *_ in rows] == [2, 4]
    for _, plain, ours in rows:
        assert float(ours) == pytest.approx(float(plain), rel=1e-5)
    assert "checkpoints: ['checkpoint-2', 'checkpoint-4']" in out


@pytest.mark.slow
def test_lightning_example_resumes_to_plain_lightnings_losses(tmp_path: Path) -> None:
    out = _run("lightning_train.py", "--batches", "2", cwd=tmp_path)
    assert _figure(r"largest relative difference over 4 micro-batch losses: ([\d.e+-]+)", out) < 1e-6
    assert _figure(r"peak device bytes (\d+)", out) <= _figure(r"<= budget (\d+)", out)
