"""What Astra decides before vLLM starts, checked without vLLM: the tiny model's Hugging Face
tokenizer files, the launcher's defaults, which Python runs vLLM, the one-line error when none
can, and the engine's own error line when it cannot start. tests/test_vllm_real.py checks the
same against the real server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from astra.engine.char_hf import char_tokenizer_files
from astra.engine.http.launch import error_line
from astra.engine.http.vllm_env import PYTHON_ENV, vllm_python
from astra.engine.http.vllm_launch import EXTENSION_CLS, EXTENSION_DIR, launch_defaults, launch_env
from astra.engine.tiny import TINY_CONFIG, save_tiny
from astra.engine.tokenizer import CharTokenizer, load_tokenizer
from astra.errors import FailedPrecondition

ROOT = Path(__file__).resolve().parents[1]


def test_the_tiny_export_carries_tokenizer_files_that_equal_the_char_tokenizer(
    tmp_path: Path,
) -> None:
    directory = save_tiny(tmp_path / "tiny")
    names = {p.name for p in directory.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
    tok = json.loads((directory / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    char = CharTokenizer()
    assert len(vocab) == char.vocab_size == TINY_CONFIG["vocab_size"]
    assert sorted(vocab.values()) == list(range(char.vocab_size))
    for ch in CharTokenizer.chars:  # every character has CharTokenizer's id
        assert vocab[ch] == char.encode(ch)[0]
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert specials == {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    assert tok["post_processor"] is None and tok["decoder"] == {"type": "Fuse"}
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<eos>" and config["add_bos_token"] is False
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] == char.eos_id == TINY_CONFIG["eos_token_id"]
    # Astra itself still reads the directory with its own tokenizer.
    assert isinstance(load_tokenizer(directory), CharTokenizer)


def test_the_files_are_the_same_bytes_every_time() -> None:
    assert char_tokenizer_files() == char_tokenizer_files()


def test_launch_defaults_take_the_models_dtype_and_turn_chunked_prefill_off(
    tmp_path: Path,
) -> None:
    directory = save_tiny(tmp_path / "tiny")
    args = launch_defaults(directory, [])
    assert args[args.index("--dtype") + 1] == "float32"  # vLLM on CPU would run bfloat16
    assert "--no-enable-chunked-prefill" in args
    assert args[args.index("--worker-extension-cls") + 1] == EXTENSION_CLS
    # What the user says wins, in either spelling.
    mine = ["--dtype=bfloat16", "--enable-chunked-prefill", "--worker-extension-cls", "x.Y"]
    assert launch_defaults(directory, mine) == []
    assert launch_defaults(tmp_path / "missing", []) == [
        "--no-enable-chunked-prefill",
        "--worker-extension-cls",
        EXTENSION_CLS,
    ]


def test_launch_env_sets_dev_mode_a_kv_cache_and_the_extensions_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = launch_env([])
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["PYTHONPATH"].split(":") == [str(EXTENSION_DIR), "/elsewhere"]
    assert (EXTENSION_DIR / "astra_vllm_ext.py").is_file()
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert launch_env([])["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "VLLM_CPU_KVCACHE_SPACE" not in launch_env(["--kv-cache-memory-bytes", "1000000"])


def test_the_worker_extension_imports_nothing_of_astra() -> None:
    """vLLM's Python has no astra: the extension must import without it."""
    source = (EXTENSION_DIR / "astra_vllm_ext.py").read_text()
    assert "import astra" not in source and "from astra" not in source


def test_a_python_without_vllm_is_one_line_naming_make_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PYTHON_ENV, sys.executable)  # this venv has no vllm
    with pytest.raises(FailedPrecondition) as info:
        vllm_python()
    assert info.value.reason == "VLLM_NOT_INSTALLED"
    assert "make vllm" in info.value.message and "\n" not in info.value.message
    assert sys.executable in info.value.message


def without_vllm(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m ARGS` where the only Python offered for vLLM is this one, which lacks it."""
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", PYTHON_ENV: sys.executable},
        check=False,
    )


def test_astra_run_on_vllm_without_vllm_stops_at_start_up_with_exit_2(tmp_path: Path) -> None:
    recipe = ROOT / "configs" / "recipes" / "vllm_cpu.yaml"
    done = without_vllm("astra.run", str(recipe), "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and "raas.0.engine=vllm" in lines[0] and "make vllm" in lines[0]
    assert not (tmp_path / "run").exists()  # nothing was started


def test_error_line_finds_the_servers_own_error() -> None:
    log = "\n".join(
        [
            "INFO starting",
            "(EngineCore pid=12) ERROR 12-04 [core.py:1] Traceback (most recent call last):",
            '(EngineCore pid=12) ERROR 12-04 [core.py:1]   File "x.py", line 3',
            "(EngineCore pid=12) ERROR 12-04 [core.py:1] RuntimeError: head_dim=16 unsupported",
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
            "  Value error, Model architectures ['NoSuchModel'] are not supported",
            "INFO bye",
        ]
    )
    line = error_line(log)
    assert line.startswith("pydantic_core._pydantic_core.ValidationError: 1 validation")
    assert line.endswith("['NoSuchModel'] are not supported")
    assert error_line(log.split("\npydantic")[0]) == "RuntimeError: head_dim=16 unsupported"
    assert error_line("just a line\n") == "just a line"
    assert error_line("") == "(its log is empty)"


def test_serve_raas_on_vllm_without_vllm_exits_2_with_one_line() -> None:
    done = without_vllm("astra.cli", "serve", "raas", "--engine", "vllm")
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "make vllm" in errors[0] and "Traceback" not in done.stderr


def test_generation_config_follows_the_models_own_ids(tmp_path: Path) -> None:
    """A config without an eos (as the benchmarks write) gets a generation_config.json without
    one: transformers and vLLM read it, and would otherwise stop at id 2."""
    from astra.engine.tiny import random_model, save_model

    config = {**TINY_CONFIG, "eos_token_id": None}
    save_model(tmp_path / "m", random_model(config, 0), config)
    generation = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "pad_token_id": 0}
